"""Full disks, for real: a small tmpfs (the ``small_fs`` fixture) that fills up under an
archive's extraction, an S3 stage, the remote shard cache's downloads and a pack. Each
fails with ENOSPC, leaves no temporary and no partial file at a final name, and the
same call succeeds once there is room. Also pack against a source changed under it and
Ctrl-C, both with real processes and real signals.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import tarfile
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit import fs, procs, trees
from kit.trees import MiB

pytestmark = pytest.mark.native

SmallFs = Callable[..., Path]


def fill_up(mount: Path) -> Path:
    """Writes a file into ``mount`` until the file system has no block left; returns it
    (remove it to free the space)."""
    filler = mount / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        for chunk in (MiB, 4096):
            block = b"\0" * chunk
            while True:
                try:
                    if os.write(fd, block) < chunk:
                        break
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
    finally:
        os.close(fd)
    assert os.statvfs(mount).f_bavail == 0
    return filler


def temporaries(root: Path) -> list[str]:
    """Names fastload writes before a rename (``.NAME.fastload-tmp``, ``.fl-tmp``,
    ``.tmp-PID``, ``.part``) anywhere under ``root``."""
    marks = (".fastload-", trees.TMP_MARK, ".tmp-", ".part")
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if any(m in p.name for m in marks))  # fmt: skip


def _compressible_tree(root: Path, n: int, size: int) -> None:
    """``n`` files of ``size`` bytes that gzip to almost nothing (a short line
    repeated), each different."""
    for i in range(n):
        line = f"file {i:04d} of a tree that compresses well\n".encode()
        data = (line * (size // len(line) + 1))[:size]
        trees.write_file(root / f"d{i % 3}" / f"f{i:04d}.txt", data, mtime_index=i)


# --------------------------------------------------------------------------------------
# Archive extraction
# --------------------------------------------------------------------------------------


def test_archive_extraction_fills_the_disk(tmp_path: Path, small_fs: SmallFs) -> None:
    # A .tar.gz of 12 MiB that is a few KiB compressed: the space check (which can only
    # go by the archive's size) passes, and the 4 MiB file system fills up midway.
    src = tmp_path / "src"
    _compressible_tree(src, 6, 2 * MiB)
    archive = tmp_path / "a.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        for p in sorted(src.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(src)), recursive=False)
    assert archive.stat().st_size < MiB
    mnt = small_fs("4m")
    dst = mnt / "dst"
    with pytest.raises(OSError) as info:
        fastload.stage(archive, dst)
    e = info.value
    assert e.errno == errno.ENOSPC and isinstance(e, fastload.StageError), repr(e)
    assert str(dst) in f"{e} {e.filename}", e
    trees.assert_no_partial_files(src, dst)
    assert temporaries(mnt) == []
    with pytest.raises(FileNotFoundError):
        fastload.verify(dst)  # not marked complete

    assert fs.remount_tmpfs_size(mnt, 64 * MiB) == 0
    fastload.stage(archive, dst)
    trees.assert_same_tree(src, dst, mtimes=False)  # tarfile keeps them to 100 ns
    assert temporaries(mnt) == []


# --------------------------------------------------------------------------------------
# An S3 stage
# --------------------------------------------------------------------------------------


def _s3_stage_onto_a_disk_that_fills(s3: Any, bucket: str, proxy: Any,
                                     mnt: Path) -> tuple[dict[str, bytes], Path]:  # fmt: skip
    """Uploads objects, and stages them into ``mnt`` while the disk fills up: asserts
    the stage fails with ENOSPC; returns the objects and the filler file."""
    from sources.s3server import upload

    rng = random.Random(3)
    # Objects of one GET and one write (256 KiB), and streamed ones (1.5 MiB: over the
    # one-write size, under a stripe).
    files = {f"small/{i:02d}.bin": rng.randbytes(256 << 10) for i in range(12)}
    files |= {f"mid/{i}.bin": rng.randbytes(3 << 19) for i in range(3)}
    upload(s3, bucket, files)
    # The proxy holds the objects' GETs: once one is held the stage is past its space
    # check; then the disk is filled, and the GETs let through.
    proxy.gate.clear()
    caught: list[BaseException] = []

    def run() -> None:
        try:
            fastload.stage(f"s3://{bucket}/", mnt / "dst", workers=4)
        except BaseException as e:
            caught.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        proxy.wait_in_flight(1)
        filler = fill_up(mnt)
    finally:
        proxy.gate.set()
        t.join(180)
    assert not t.is_alive(), "the stage hung on a full disk"
    assert caught, "the stage succeeded on a full disk"
    e = caught[0]
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC, repr(e)
    return files, filler


@pytest.mark.slow
def test_s3_stage_fills_the_disk_then_resumes(s3: Any, bucket: str, proxy: Any,
                                              small_fs: SmallFs) -> None:  # fmt: skip
    from sources.s3server import tree_of

    mnt = small_fs("32m")
    dst = mnt / "dst"
    files, filler = _s3_stage_onto_a_disk_that_fills(s3, bucket, proxy, mnt)
    with pytest.raises(FileNotFoundError):
        fastload.verify(dst)  # not marked complete
    staged = {k: v for k, v in tree_of(dst).items() if not k.rsplit("/", 1)[-1].startswith(".")}
    assert all(files[k] == v for k, v in staged.items())  # whole objects only

    filler.unlink()
    r = fastload.stage(f"s3://{bucket}/", dst)
    assert tree_of(dst) == files
    assert r.copied_files == len(files) - len(staged)
    assert temporaries(mnt) == []


@pytest.mark.slow
def test_s3_stage_on_a_full_disk_leaves_no_temporaries(s3: Any, bucket: str, proxy: Any,
                                                       small_fs: SmallFs) -> None:  # fmt: skip
    mnt = small_fs("32m")
    _s3_stage_onto_a_disk_that_fills(s3, bucket, proxy, mnt)
    # Nothing left behind: a failed stage that is not retried must not hold space.
    assert temporaries(mnt / "dst") == []


# --------------------------------------------------------------------------------------
# The remote shard cache's downloads
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cache_download_fills_the_disk(s3: Any, bucket: str, tmp_path: Path,
                                       small_fs: SmallFs) -> None:  # fmt: skip
    from cache.remote_kit import plain, put_shards, write_shards

    paths = write_shards(tmp_path / "local", [40, 40])
    url = put_shards(s3, bucket, paths)
    local = fastload.ShardIndexDataset([str(p) for p in paths])
    biggest = max(p.stat().st_size for p in paths)
    mnt = small_fs(str(biggest * 2 // 3))  # the cache's file system holds no shard
    cache = mnt / "c"
    with pytest.raises(OSError) as info:
        remote = fastload.ShardIndexDataset(url, cache_dir=cache)
        remote.__getitems__(list(range(len(local))))
    assert info.value.errno == errno.ENOSPC, repr(info.value)
    assert temporaries(mnt) == [], "a failed download left its partial file"

    # Room for the shards and the header skeletons the index is built from (on a file
    # system of 4 KiB pages, a skeleton of small members takes about a shard's space).
    assert fs.remount_tmpfs_size(mnt, 8 * biggest) == 0
    remote = fastload.ShardIndexDataset(url, cache_dir=cache)
    everything = list(range(len(local)))
    assert plain(remote.__getitems__(everything)) == plain(local.__getitems__(everything))
    assert temporaries(mnt) == []


# --------------------------------------------------------------------------------------
# Pack
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pack_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """384 files of 64 KiB in 4 class folders (24 MiB)."""
    root = tmp_path_factory.mktemp("pack") / "src"
    rng = random.Random(11)
    for i in range(384):
        trees.write_file(root / f"c{i % 4}" / f"{i:04d}.bin", rng.randbytes(64 << 10),
                         mtime_index=i)
    return root


def _pack_spec(src: Path, out: Path, **kwargs: Any) -> dict[str, Any]:
    # 8 samples a shard: 48 shards, many writes after the first.
    return {"op": "pack", "src": str(src), "dst": str(out),
            "kwargs": {"max_count": 8, "workers": 2, **kwargs}}  # fmt: skip


def _packed(out: Path) -> dict[str, bytes]:
    """key -> the sample's data, from the shards' index."""
    ds = fastload.ShardIndexDataset(str(out / "index.fidx"))
    return {s["__key__"]: bytes(s["bin"]) for s in ds.__getitems__(list(range(len(ds))))}


def _want(src: Path) -> dict[str, bytes]:
    return {str(p.relative_to(src).with_suffix("")): p.read_bytes()
            for p in src.rglob("*.bin")}  # fmt: skip


def _no_pack_leftovers(out: Path) -> None:
    assert temporaries(out) == []
    assert not (out / "index.fidx").exists(), "an index of an unfinished pack"


def test_pack_refuses_a_disk_too_small(pack_src: Path, small_fs: SmallFs) -> None:
    mnt = small_fs("8m")
    out = mnt / "o"
    with pytest.raises(fastload.NotEnoughSpaceError, match="not enough space to pack") as e:
        fastload.pack(pack_src, out)
    assert e.value.needed >= 24 * MiB and 0 < e.value.free <= 8 * MiB
    assert fs.mentions_size(str(e.value), e.value.needed)
    assert not out.exists() or not list(out.glob("*.tar"))
    assert fs.remount_tmpfs_size(mnt, 64 * MiB) == 0
    fastload.pack(pack_src, out)
    assert _packed(out) == _want(pack_src)


def test_pack_fills_the_disk_midway(pack_src: Path, small_fs: SmallFs) -> None:
    mnt = small_fs("64m")
    out = mnt / "o"
    # Once shards are being written (the space check passed), the file system's limit is
    # lowered to what it holds: the next writes fail.
    child, fired = procs.run_child_with_trigger(
        _pack_spec(pack_src, out), mnt, lambda: fs.shrink_tmpfs_to_used(mnt))
    assert fired, "the pack finished before the disk could be filled"
    err = child.expect_error()
    assert err["is"]["OSError"] and err["errno"] == errno.ENOSPC, err
    _no_pack_leftovers(out)

    assert fs.remount_tmpfs_size(mnt, 64 * MiB) == 0
    procs.run_child(_pack_spec(pack_src, out), env=procs.child_env()).expect_result()
    assert _packed(out) == _want(pack_src)


def test_pack_source_shortened_by_another_process(tmp_path: Path, pack_src: Path,
                                                  small_fs: SmallFs) -> None:  # fmt: skip
    src = tmp_path / "src"
    shutil.copytree(pack_src, src)
    mnt = small_fs("64m")
    out = mnt / "o"

    def shorten_every_file() -> None:
        for p in src.rglob("*.bin"):
            os.truncate(p, p.stat().st_size - 1)

    child, fired = procs.run_child_with_trigger(_pack_spec(src, out), mnt,
                                                shorten_every_file)  # fmt: skip
    assert fired, "the pack finished before its source could be changed"
    err = child.expect_error()
    assert err["is"]["SourceChangedError"], err
    assert "shorter than when the pack was planned" in err["str"], err
    _no_pack_leftovers(out)


def test_pack_ctrl_c(pack_src: Path, small_fs: SmallFs) -> None:
    mnt = small_fs("64m")
    out = mnt / "o"
    holder: list[procs.Child] = []

    def interrupt() -> None:
        # The child is stopped while this runs: SIGINT is delivered when it continues.
        holder[0].proc.send_signal(signal.SIGINT)

    child = procs.Child(_pack_spec(pack_src, out), env=procs.child_env())
    holder.append(child)
    fired = procs.trigger_on_growth(child, mnt, interrupt)
    child.finish(180)
    assert fired, "the pack finished before Ctrl-C"
    assert child.returncode == -signal.SIGINT, (child.returncode, child.stderr[-2000:])
    assert "KeyboardInterrupt" in child.stderr
    assert child.result is None and child.error is None
    _no_pack_leftovers(out)


def test_index_header_skeleton_on_a_full_disk(tmp_path: Path, small_fs: SmallFs) -> None:
    """The sparse copy of a shard's headers that a remote index is built from, written to
    a full file system: ENOSPC naming the file, and no partial file left."""
    from cache.remote_kit import write_shards
    from fastload.cache.remote import header_skeleton

    shard = write_shards(tmp_path / "local", [40])[0]
    mnt = small_fs("1m")
    fill_up(mnt)
    out = mnt / "skeleton"
    with pytest.raises(OSError) as info:
        header_skeleton(shard, out, shard.stat().st_size)
    assert info.value.errno == errno.ENOSPC, repr(info.value)
    assert str(out) in str(info.value) and info.value.filename == str(out)
    assert not out.exists()
