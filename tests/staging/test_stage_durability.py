"""stage() returns once the staged data is whole in the page cache (as cp and tar do),
unless sync=True; its manifest and journal record the boot. What must hold:

- on the same boot, a complete stage is trusted at once (nothing is read back);
- with sync=True the data is flushed first and the manifest says so (trusted on any boot);
- after a reboot (here: a manifest or journal whose boot id is another), a stage that was
  not flushed is read back and only files whose digests still match are kept: a file
  whose writeback a power loss cut (here: its blocks zeroed, size and time unchanged) is
  staged again, from a tree or from an archive, and nothing else is.
"""

from __future__ import annotations

import json
import os
import struct
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.staging.state import Journal, boot_id, state_dir

pytestmark = pytest.mark.native

Stage = Callable[..., Any]


def make_tree(root: Path, n: int = 12) -> dict[str, bytes]:
    files = {}
    for i in range(n):
        rel = f"d{i % 3}/f{i:02d}.bin"
        data = os.urandom(1000 + 5000 * i)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    (root / "link").symlink_to("d0/f00.bin")
    return files


def make_archive(path: Path, files: dict[str, bytes], src: Path) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for rel in files:
            tf.add(src / rel, arcname=rel)
    return path


def source(tmp_path: Path, kind: str) -> tuple[Path, dict[str, bytes]]:
    """A tree, or a tar of the same files; and what the files hold."""
    files = make_tree(tmp_path / "src")
    if kind == "tree":
        return tmp_path / "src", files
    return make_archive(tmp_path / "a.tar", files, tmp_path / "src"), files


def manifest(dst: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((state_dir(dst) / "manifest.json").read_text())
    return data


def as_if_rebooted(dst: Path) -> None:
    """The manifest now reads as written on an earlier boot."""
    m = manifest(dst)
    m["boot_id"] = "an-earlier-boot"
    (state_dir(dst) / "manifest.json").write_text(json.dumps(m))


def lose_writeback(path: Path) -> None:
    """What a file whose data never reached the disk can read as after a power loss:
    zeros, with its size and time as they were."""
    st = path.stat()
    path.write_bytes(bytes(st.st_size))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def assert_files(dst: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (dst / rel).read_bytes() == data, rel


@pytest.mark.parametrize("kind", ["tree", "archive"])
def test_default_returns_unflushed_and_is_trusted_on_this_boot(
    stage: Stage, tmp_path: Path, kind: str
) -> None:
    src, files = source(tmp_path, kind)
    dst = tmp_path / "dst"
    r = stage(src, dst)
    assert not r.skipped
    m = manifest(dst)
    assert m["durable"] is False and m["boot_id"] == boot_id()
    assert stage(src, dst).skipped
    # sync=True on a complete stage flushes it and marks it durable, copying nothing.
    r = stage(src, dst, sync=True)
    assert r.skipped and manifest(dst)["durable"] is True
    assert_files(dst, files)


@pytest.mark.parametrize("kind", ["tree", "archive"])
def test_sync_stage_is_durable(stage: Stage, tmp_path: Path, kind: str) -> None:
    src, files = source(tmp_path, kind)
    dst = tmp_path / "dst"
    assert not stage(src, dst, sync=True).skipped
    assert manifest(dst)["durable"] is True
    as_if_rebooted(dst)
    assert stage(src, dst).skipped  # flushed before it was marked complete: trusted
    assert_files(dst, files)


@pytest.mark.parametrize("kind", ["tree", "archive"])
def test_after_reboot_unflushed_stage_is_read_back(stage: Stage, tmp_path: Path, kind: str) -> None:
    src, files = source(tmp_path, kind)
    dst = tmp_path / "dst"
    stage(src, dst)

    # Rebooted, all whole: read back, found whole, marked durable; nothing copied.
    as_if_rebooted(dst)
    r = stage(src, dst)
    assert r.skipped and r.copied_files == 0
    m = manifest(dst)
    assert m["durable"] is True and m["boot_id"] == boot_id()
    assert stage(src, dst).skipped

    # Rebooted after a stage whose writeback was cut: exactly the damaged files again.
    dst2 = tmp_path / "dst2"
    stage(src, dst2)
    as_if_rebooted(dst2)
    lose_writeback(dst2 / "d1/f04.bin")
    lose_writeback(dst2 / "d2/f11.bin")
    r = stage(src, dst2)
    assert not r.skipped
    if kind == "tree":
        assert (r.copied_files, r.copied_bytes) == (2, len(files["d1/f04.bin"]) + len(
            files["d2/f11.bin"]))
    else:  # the archive is read again; members whole on disk are not rewritten
        assert r.copied_files == 2
    assert_files(dst2, files)
    assert fastload.verify(dst2).ok
    assert stage(src, dst2).skipped


def test_after_reboot_interrupted_journal_is_read_back(stage: Stage, tmp_path: Path) -> None:
    """An interrupted stage's journal from an earlier boot: its records are proven by
    reading the files back before the resume skips them."""
    files = make_tree(tmp_path / "src", n=40)
    dst = tmp_path / "dst"

    def stop_midway(bd: int, bt: int, fd: int, ft: int) -> None:
        if fd >= 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        stage(tmp_path / "src", dst, progress=stop_midway, workers=1)
    journal = state_dir(dst) / "journal.bin"
    raw = journal.read_bytes()
    assert raw[:8] == b"FLJOURN1"
    (n,) = struct.unpack_from("<I", raw, 8)
    header = json.loads(raw[12 : 12 + n])
    assert header["durable"] is False and header["boot_id"] == boot_id()
    journalled = [p for p, *_ in Journal(dst, header["chunk_size"]).rows()]
    assert journalled, "the interrupted stage journalled the files it finished"
    header["boot_id"] = "an-earlier-boot"
    text = json.dumps(header).encode()
    journal.write_bytes(raw[:8] + struct.pack("<I", len(text)) + text + raw[12 + n :])
    lose_writeback(dst / journalled[0])

    r = stage(tmp_path / "src", dst)
    assert r.copied_files == len(files) - len(journalled) + 1
    assert_files(dst, files)
    assert fastload.verify(dst).ok
