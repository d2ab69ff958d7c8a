"""The named-temporary fallback, on a real file system that refuses O_TMPFILE.

Files land through a temporary: an O_TMPFILE linked into place where the file system has
them, else ``.NAME.fl-tmp`` renamed into place. tmpfs and ext4 have O_TMPFILE, so the
other tests never reach the second branch. Here the destination is netsim mounted
writable (tests/kit/netsim.c, ``write=True``): a FUSE file system whose server has no
tmpfile call (libfuse has none), so the kernel refuses O_TMPFILE there with EOPNOTSUPP,
as NFS does; the fixture checks that before each test. Nothing is mocked and nothing in
the product is switched: each writer finds the refusal itself.

What each writer does there (read in cpp/copy/):
- the objects' writer (objects.cpp, ``_core.write_objects``) tries O_TMPFILE, is refused,
  and writes every later file under a named temporary: the refusal branch;
- the copier (copier.cpp) tries O_TMPFILE only on a local destination (``direct_dst_``):
  FUSE counts as network storage, so it goes to named temporaries at once, created and
  written through the engine, not run on the submitter. Its own refusal branch (an
  O_TMPFILE refused on a *local* file system: kOpenDst's EOPNOTSUPP) needs a local file
  system without O_TMPFILE, which this kernel does not have (ext2/3/4, XFS, btrfs, tmpfs,
  ramfs all have it): it is not tested here;
- the extraction (extract_write.cpp) tries O_TMPFILE on any file system, is refused on
  the first member, and creates named temporaries (O_EXCL) from then on.
"""

from __future__ import annotations

import errno
import os
import random
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import _core
from kit import fs, netsim, tars, trees
from kit.jobs import run_copy_job
from kit.trees import MiB

pytestmark = pytest.mark.native

MODE = 0o644
# (mount, the directory behind it): what a test writes through the mount, it may check
# behind it too, where netsim's caches play no part.
Dst = tuple[Path, Path]


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def _refuses_tmpfile(path: Path) -> None:
    """Fails the test unless ``path`` refuses O_TMPFILE as a file system without it does:
    a test of this file that ran where O_TMPFILE works would test the other branch."""
    try:
        fd = os.open(path, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as e:
        assert e.errno == errno.EOPNOTSUPP, e
        return
    os.close(fd)
    raise AssertionError(f"{path} has O_TMPFILE: these tests would not reach the fallback")


@pytest.fixture
def no_tmpfile(tmp_path: Path, small_fs: Any) -> Iterator[Callable[..., Dst]]:
    """``no_tmpfile()`` mounts netsim writable over a new directory, ``no_tmpfile("4m")``
    over a tmpfs of that size (to fill up); returns (mount, the directory behind it)."""
    with netsim.mounts(tmp_path) as mount:

        def make(size: str | None = None) -> Dst:
            if size is None:
                back = tmp_path / f"back{len(list(tmp_path.glob('back*')))}"
                back.mkdir()
            else:
                back = small_fs(size)
            mnt = mount(back, 0, 0, write=True).path
            _refuses_tmpfile(mnt)
            return mnt, back

        yield make


def _leftovers(*roots: Path) -> list[str]:
    """Temporaries of fastload (``.fl-tmp``, and ``.fastload-`` of its state files), and
    what a FUSE server leaves for a file removed while open (``.fuse_hidden``)."""
    marks = (trees.TMP_MARK, ".fastload-tmp", ".tmp-", ".fuse_hidden")
    return sorted(str(p) for root in roots for p in root.rglob("*")
                  if any(m in p.name for m in marks))  # fmt: skip


def _chunks(data: bytes, stripe: int) -> bytes:
    return b"".join(_core.fl64(data[i:i + stripe]).to_bytes(8, "little")
                    for i in range(0, max(1, len(data)), stripe))  # fmt: skip


# --------------------------------------------------------------------------------------
# The objects' writer (_core.write_objects)
# --------------------------------------------------------------------------------------


def test_objects_are_written_whole_through_named_temporaries(no_tmpfile: Any) -> None:
    """O_TMPFILE refused on the first body: every body (the first one included) goes
    through ``.NAME.fl-tmp``, renamed over its name. Bytes, mode, times and digests as
    on a local disk; a file at the name is replaced by a new inode (a hard link to the old
    one keeps the old bytes: not rewritten in place); a stale temporary of an earlier run
    is reused, and nothing is left under a temporary name."""
    mnt, back = no_tmpfile()
    rng = random.Random(5)
    (mnt / "a" / "b").mkdir(parents=True)
    bodies: dict[str, Any] = {
        "top.bin": rng.randbytes(10_000),
        "a/empty": b"",
        "a/b/exact": rng.randbytes(3 * 4096),
        "a/b/big": memoryview(rng.randbytes(700_000))[100:],  # several FUSE writes
        "a/ba": bytearray(rng.randbytes(1)),
    }
    (mnt / "top.bin").write_bytes(b"an older copy, replaced whole")
    os.link(mnt / "top.bin", mnt / "old-top")
    # A killed run's temporary, with another mode: not to be taken for the file's.
    (mnt / "a" / ".ba.fl-tmp").write_bytes(b"a killed run's temporary" * 100)
    (mnt / "a" / ".ba.fl-tmp").chmod(0o600)
    stripe = 4096
    items = [(name, body, 1_600_000_000_123_456_789 + k * 1_000_000_007)
             for k, (name, body) in enumerate(bodies.items())]  # fmt: skip
    got = _core.write_objects(str(mnt), items, MODE, stripe)
    for (name, body, mtime), digests in zip(items, got, strict=True):
        assert not isinstance(digests, BaseException), (name, digests)
        data = bytes(body)
        # Both stats before a read: reading the file sets its atime.
        for st in [(root / name).stat() for root in (mnt, back)]:
            assert st.st_mode & 0o7777 == MODE & ~_umask(), name
            assert st.st_mtime_ns == st.st_atime_ns == mtime, name
        assert (mnt / name).read_bytes() == (back / name).read_bytes() == data, name
        assert digests == _chunks(data, stripe), name
    assert (mnt / "old-top").read_bytes() == b"an older copy, replaced whole"
    assert (mnt / "old-top").stat().st_ino != (mnt / "top.bin").stat().st_ino
    assert _leftovers(mnt, back) == []
    # A second batch over the same names, on the writer's named branch from its start.
    again = _core.write_objects(mnt, [("a/empty", b"now full", -1_500_000_001)], MODE, 3)
    assert again == [_chunks(b"now full", 3)]
    assert (back / "a/empty").read_bytes() == b"now full"
    assert (back / "a/empty").stat().st_mtime_ns == -1_500_000_001
    assert _leftovers(mnt, back) == []


def test_objects_on_a_full_disk_name_the_file_and_leave_no_named_temporary(
    no_tmpfile: Any,
) -> None:
    """ENOSPC in the middle of a body: the named temporary (which a crash-free O_TMPFILE
    would not leave) is removed, the error names the file's final path, the others are
    written whole, nothing partial is at a final name."""
    mnt, back = no_tmpfile("1m")
    items, failed = fs.objects_until_full(mnt, MODE)
    assert len(failed) < len(items)
    assert _leftovers(mnt, back) == []
    assert sorted(p.name for p in back.iterdir()) == sorted(
        items[k][0] for k in range(len(items)) if k not in failed)


# --------------------------------------------------------------------------------------
# The copier (a tree's stage; CopyJob)
# --------------------------------------------------------------------------------------


def test_a_tree_is_staged_through_named_temporaries(tmp_path: Path, no_tmpfile: Any) -> None:
    """fastload.stage of a tree onto the mount: the copier never asks a FUSE (network)
    destination for O_TMPFILE; its named temporaries are created, written, timed and
    renamed through the engine. The staged tree is the source's (bytes, modes, ns
    mtimes, symlinks, a sparse file, 255-byte names whose temporary name is hashed to
    fit); nothing is left under a temporary name. Staged again after a file changed, the
    file is replaced by a new inode (the old copy, hard-linked, keeps its bytes)."""
    src = tmp_path / "src"
    trees.build_rich_tree(src)
    mnt, back = no_tmpfile()
    dst = mnt / "dst"
    res = fastload.stage(src, dst)
    assert res.copied_files == len(trees.regular_files(src)), res
    trees.assert_same_tree(src, dst)
    trees.assert_same_tree(src, back / "dst")
    assert _leftovers(mnt, back) == []

    os.link(dst / "top.txt", mnt / "old-top")
    trees.write_file(src / "top.txt", b"changed, and longer than before\n", mtime_index=99)
    res = fastload.stage(src, dst)
    assert res.copied_files == 1, res
    trees.assert_same_tree(src, dst)
    assert (mnt / "old-top").read_bytes() == b"top level\n"
    assert _leftovers(mnt, back) == []


def _copy_job(src: Path, dst: Path, names: list[str], modes: list[int],
              mtimes: list[int] | None = None, sizes: list[int] | None = None,
              **opts: Any) -> Any:  # fmt: skip
    sizes = sizes or [(src / n).stat().st_size for n in names]
    mtimes = mtimes or [(src / n).stat().st_mtime_ns for n in names]
    files = _core.CopyFiles(names, names, sizes, [(s + 511) // 512 for s in sizes], modes,
                            mtimes)  # fmt: skip
    opts.setdefault("stripe_size", 64 << 10)
    return _core.CopyJob(src, dst, files, _core.CopyOptions(**opts))


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_named_temporaries_modes_and_stale_ones(tmp_path: Path, no_tmpfile: Any,
                                                engine: str, umask: int) -> None:
    """The named branch's own cases (test_submitters has the O_TMPFILE ones): created
    with O_EXCL and the final mode where the umask keeps it, else 0600 and chmod-ed; one
    a killed run left under the name (mode 0600, stale bytes) makes the O_EXCL create
    fail, and is truncated and used instead, so none is left; an older copy at the final
    name is replaced whole. The copies have the source's modes, bytes and times."""
    modes = [0o644, 0o640, 0o600, 0o664, 0o755, 0o444, 0o400, 0o2755, 0o1777]
    names = [f"d/m{i}" for i in range(len(modes))] + ["d/big"]
    modes.append(0o640)
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i, rel in enumerate(names[:-1]):
        (src / rel).write_bytes(os.urandom(1000 + i))
    (src / "d/big").write_bytes(os.urandom(300_000))  # striped: sized first, then written
    mnt, back = no_tmpfile()
    (mnt / "d").mkdir()
    trees.leave_interrupted_run(mnt, names, b"stale" * 100_000)
    old = os.umask(umask)
    try:
        job = _copy_job(src, mnt, names, modes, engine=engine)
        done = run_copy_job(job)
    finally:
        os.umask(old)
    job.rethrow()
    assert sorted(done) == list(range(len(names)))
    for rel, mode in zip(names, modes, strict=True):
        st = (back / rel).stat()
        assert oct(st.st_mode & 0o7777) == oct(mode), rel
        assert st.st_mtime_ns == (src / rel).stat().st_mtime_ns, rel
        assert (back / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert _leftovers(mnt, back) == []


@pytest.mark.parametrize("how", ["grew", "modified"])
def test_a_changed_source_names_it_and_leaves_no_named_temporary(
    tmp_path: Path, no_tmpfile: Any, how: str
) -> None:
    """A source file that changed after it was listed fails the copy, naming it, and its
    named temporary is removed: "grew", a small file listed shorter than it is (found by
    its read); "modified", a striped file listed with another mtime (found once all of it
    is written to the temporary, when its metadata is to be set)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_bytes(b"whole")
    size = 5000 if how == "grew" else 2 * MiB
    (src / "changed").write_bytes(os.urandom(size))
    names = ["ok", "changed"]
    mtimes = [(src / n).stat().st_mtime_ns for n in names]
    sizes = [5, size]
    if how == "grew":
        sizes[1] = 3000
    else:
        mtimes[1] += 1
    mnt, back = no_tmpfile()
    job = _copy_job(src, mnt, names, [0o644, 0o644], mtimes, sizes, files_in_flight=1)
    run_copy_job(job)
    with pytest.raises(fastload.SourceChangedError) as info:
        job.rethrow()
    assert str(src / "changed") in str(info.value)
    assert "grew" in str(info.value) if how == "grew" else "modified" in str(info.value)
    assert not (back / "changed").exists()
    assert _leftovers(mnt, back) == []


def test_a_full_disk_fails_the_copy_and_leaves_no_named_temporary(
    tmp_path: Path, no_tmpfile: Any
) -> None:
    """A CopyJob (no space check: that is stage()'s) onto the mount over a 1 MiB tmpfs:
    ENOSPC names a file at the destination, its named temporary is removed, and what
    is at a final name is whole."""
    src = tmp_path / "src"
    src.mkdir()
    names = [f"f{i}.bin" for i in range(8)]
    for i, n in enumerate(names):
        trees.write_patterned(src / n, 300_000 + i, seed=i)
    mnt, back = no_tmpfile("1m")
    job = _copy_job(src, mnt, names, [0o644] * len(names), files_in_flight=2)
    run_copy_job(job)
    with pytest.raises(OSError) as info:
        job.rethrow()
    assert info.value.errno == errno.ENOSPC, info.value
    assert any(str(mnt / n) in str(info.value) for n in names), info.value
    trees.assert_no_partial_files(src, back)
    assert _leftovers(mnt, back) == []


# --------------------------------------------------------------------------------------
# Archive extraction
# --------------------------------------------------------------------------------------


def test_an_archive_is_extracted_through_named_temporaries(tmp_path: Path,
                                                           no_tmpfile: Any) -> None:
    """A GNU tar archive (long names, hard links, symlinks, odd modes) staged onto the
    mount: the extraction's first O_TMPFILE is refused, every member is then written
    under a named temporary (O_EXCL; a stale one an earlier run left at the name is
    removed first) and renamed. The result is GNU tar's own extraction of it; nothing is
    left under a temporary name."""
    src = trees.build_archive_tree(tmp_path / "src")
    archive = tars.gnu_create(src, tmp_path / "a.tar", "gnu")
    ref = tars.gnu_extract(archive, tmp_path / "ref")
    mnt, back = no_tmpfile()
    dst = mnt / "dst"
    (dst / "sizes").mkdir(parents=True)
    stale = dst / "sizes" / f".b{MiB + 123}.fl-tmp"
    stale.write_bytes(b"a killed run's temporary")
    fastload.stage(archive, dst)
    tars.assert_extracts_like_gnu_tar(archive, ref, dst)
    assert _leftovers(mnt, back) == []
    assert trees.hardlink_groups(back / "dst") == trees.hardlink_groups(ref)


def test_an_extraction_that_fills_the_disk_leaves_no_named_temporary(
    tmp_path: Path, no_tmpfile: Any
) -> None:
    """A .tar.gz of 12 MiB, a few KiB compressed (so stage()'s space check, by the
    archive's size, passes), onto the mount over a 4 MiB tmpfs: ENOSPC, a StageError
    naming the destination, the named temporaries removed, nothing partial at a final
    name; once there is room, the same stage completes."""
    src = tmp_path / "src"
    for i in range(6):
        line = f"file {i:04d} of a tree that compresses well\n".encode()
        trees.write_file(src / f"d{i % 3}" / f"f{i:04d}.txt",
                         (line * (2 * MiB // len(line) + 1))[:2 * MiB], mtime_index=i)
    archive = tmp_path / "a.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for p in sorted(src.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(src)), recursive=False)
    assert archive.stat().st_size < MiB
    mnt, back = no_tmpfile("4m")
    dst = mnt / "dst"
    with pytest.raises(fastload.StageError) as info:
        fastload.stage(archive, dst)
    e = info.value
    assert e.errno == errno.ENOSPC, repr(e)
    assert str(dst) in f"{e} {e.filename}", e
    # `info` is kept to the end: the job it references has let go of the destination
    # (its folder held open would keep the mount busy at its unmount).
    trees.assert_no_partial_files(src, back / "dst")
    assert _leftovers(mnt, back) == []

    assert fs.remount_tmpfs_size(back, 64 * MiB) == 0
    fastload.stage(archive, dst)
    trees.assert_same_tree(src, dst, mtimes=False)  # tarfile keeps them to 100 ns
    assert _leftovers(mnt, back) == []
