"""The native writer of fetched objects (``_core.write_objects``, copy/objects.*): a batch
of bodies written whole to their files (bytes, mode, times, chunk digests), files
already there replaced, and per-file errors that name the file and leave no temporary:
a full disk, a read-only file system, a missing folder."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastload import _core
from kit import fs, trees

pytestmark = pytest.mark.native

MODE = 0o644


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if trees.TMP_MARK in p.name)


def _chunks(data: bytes, stripe: int) -> bytes:
    return b"".join(_core.fl64(data[i:i + stripe]).to_bytes(8, "little")
                    for i in range(0, max(1, len(data)), stripe))  # fmt: skip


def test_a_batch_is_written_whole(tmp_path: Path) -> None:
    rng = random.Random(5)
    (tmp_path / "a" / "b").mkdir(parents=True)
    bodies: dict[str, Any] = {
        "top.bin": rng.randbytes(10_000),
        "a/empty": b"",
        "a/b/exact": rng.randbytes(3 * 4096),  # three whole stripes
        "a/b/view": memoryview(rng.randbytes(5000))[100:4200],  # a slice: no copy
        "a/ba": bytearray(rng.randbytes(1)),
    }
    (tmp_path / "top.bin").write_bytes(b"an older copy, replaced whole")
    stripe = 4096
    items = [(name, body, 1_600_000_000_123_456_789 + k * 1_000_000_007)
             for k, (name, body) in enumerate(bodies.items())]  # fmt: skip
    got = _core.write_objects(str(tmp_path), items, MODE, stripe)
    assert len(got) == len(items)
    for (name, body, mtime), digests in zip(items, got, strict=True):
        data = bytes(body)
        path = tmp_path / name
        st = path.stat()
        assert path.read_bytes() == data, name
        assert st.st_mode & 0o7777 == MODE & ~_umask(), name
        assert st.st_mtime_ns == st.st_atime_ns == mtime, name
        assert digests == _chunks(data, stripe), name
        assert len(digests) == 8 * max(1, -(-len(data) // stripe))
    assert _leftovers(tmp_path) == []
    # Negative times (before 1970) and a second batch over the same names.
    again = _core.write_objects(tmp_path, [("a/empty", b"now full", -1_500_000_001)], MODE, 3)
    assert (tmp_path / "a/empty").read_bytes() == b"now full"
    assert (tmp_path / "a/empty").stat().st_mtime_ns == -1_500_000_001
    assert again == [_chunks(b"now full", 3)]


def test_bad_items_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name, body, mtime_ns"):
        _core.write_objects(tmp_path, [("x", b"y")], MODE, 4096)
    with pytest.raises(TypeError):
        _core.write_objects(tmp_path, [("x", 12, 0)], MODE, 4096)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        _core.write_objects(tmp_path / "nowhere", [("x", b"y", 0)], MODE, 4096)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_fails_that_file_only(tmp_path: Path) -> None:
    got = _core.write_objects(tmp_path, [("ok1", b"1", 0), ("no/such/f", b"2", 0),
                                         ("ok2", b"3", 0)], MODE, 4096)  # fmt: skip
    assert got[0] == _chunks(b"1", 4096) and got[2] == _chunks(b"3", 4096)
    err = got[1]
    assert isinstance(err, FileNotFoundError) and err.errno == errno.ENOENT
    assert str(tmp_path / "no/such/f") in str(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok1", "ok2"]


def test_a_full_disk_names_the_file_and_leaves_no_temporary(small_fs: Any) -> None:
    mnt = small_fs("1m")
    items, failed = fs.objects_until_full(mnt, MODE)
    assert _leftovers(mnt) == [] and sorted(p.name for p in mnt.iterdir()) == sorted(
        items[k][0] for k in range(len(items)) if k not in failed)


def test_a_read_only_destination_names_the_file(small_fs: Any) -> None:
    mnt = small_fs("1m", ro=True)
    got = _core.write_objects(mnt, [("x.bin", b"data", 0)], MODE, 4096)
    assert isinstance(got[0], OSError) and got[0].errno == errno.EROFS
    assert str(mnt / "x.bin") in str(got[0])


def test_an_unwritable_folder_names_the_file(world_dir: Path, unprivileged: dict[str, Any]
                                             ) -> None:  # fmt: skip
    """A folder the (unprivileged) writer may not write into: EACCES naming the file."""
    locked = world_dir / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    code = ("import sys; from fastload import _core; "
            "r = _core.write_objects(sys.argv[1], [('x.bin', b'data', 0)], 0o644, 4096)[0]; "
            "print(isinstance(r, PermissionError), r.errno, r)")  # fmt: skip
    popen: dict[str, Any] = {}
    if "as_user" in unprivileged:
        popen = {"user": unprivileged["as_user"], "group": unprivileged["as_user"],
                 "extra_groups": []}  # fmt: skip
    r = subprocess.run([*unprivileged.get("wrapper", []), sys.executable, "-c", code,
                        str(locked)], cwd="/", capture_output=True, text=True, check=False,
                       timeout=120, **popen)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"True {errno.EACCES}" in r.stdout, r.stdout
    assert str(locked / "x.bin") in r.stdout
    assert list(locked.iterdir()) == []


def test_a_mark_is_recorded_with_the_file(tmp_path: Path) -> None:
    """A 4th item, the object's mark, is the file's xattr user.fastload.object (set on the
    temporary, before it is in place); an older copy's mark is replaced with the file."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.fastload.object", b"x")
    except OSError:
        pytest.skip("the test's file system keeps no user xattrs")
    old = tmp_path / "old.bin"
    old.write_bytes(b"an older copy")
    os.setxattr(old, "user.fastload.object", b"the older object")
    items = [("new.bin", b"new", 1, b"\x01" * 16), ("old.bin", b"replaced", 2, b'"v2"'),
             ("plain.bin", b"unmarked", 3)]  # fmt: skip
    got = _core.write_objects(str(tmp_path), items, MODE, 4096)
    assert all(isinstance(g, bytes) for g in got), got
    assert os.getxattr(tmp_path / "new.bin", "user.fastload.object") == b"\x01" * 16
    assert os.getxattr(old, "user.fastload.object") == b'"v2"' and old.read_bytes() == b"replaced"
    with pytest.raises(OSError):
        os.getxattr(tmp_path / "plain.bin", "user.fastload.object")
    assert _leftovers(tmp_path) == []
