"""An archive file is read by the extraction job itself (issue 33:
``ExtractJob.read_source`` over io::ReadAhead, the reads on the I/O engine the engine
rule gives the archive's file system): one native call for the whole file instead of a
Python loop per block. What must hold, on both engines: the extraction is GNU tar's;
uncached blocks are read O_DIRECT; a file cut short while it is read is a
SourceChangedError naming it; members already done are seeked over; a corrupt archive
is a TarFormatError naming it; Ctrl-C stops it and a re-run completes;
``FASTLOAD_NATIVE_READS=0`` keeps the Python read-ahead. A published checksum is hashed
from the job's own reads, on its hasher thread, every block in order and before the
block is reused; a mismatch drops the journal. On a FUSE file system with latency
(netsim) the reads run on the pread pool, buffered, and a file cut short names its
path there.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from fastload.staging import archive as _archive  # imported before the readers are patched
from fastload.staging import readers as _readers
from fastload.staging.engine import resolve_engine
from fastload.staging.state import read_manifest
from kit import fs, netsim, procs, tars, trees
from kit.tars import Made

pytestmark = pytest.mark.native

Stage = Callable[..., Any]
MiB = trees.MiB


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    """A GNU tar of ~40 MiB whose read blocks start and end inside members and
    headers (200 small files), and GNU tar's own extraction of it."""
    return tars.block_spanning_archive(tmp_path_factory.mktemp("native"), 200, 7)


@pytest.fixture
def used(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The readers each stage() of an archive used: the real classes, subclassed to
    record their instances (a NativeReader's counts are read after its run)."""
    seen: list[Any] = []

    class Native(_readers.NativeReader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self)

    class Read(_readers.Prefetcher):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(_readers, "NativeReader", Native)
    monkeypatch.setattr(_readers, "Prefetcher", Read)
    monkeypatch.setattr(_archive, "NativeReader", Native)
    monkeypatch.delenv("FASTLOAD_MAPPED_READS", raising=False)
    monkeypatch.delenv("FASTLOAD_NATIVE_READS", raising=False)
    monkeypatch.delenv("FASTLOAD_DIRECT_READS", raising=False)
    return seen


def _complete(dst: Path) -> bool:
    """Whether a stage into ``dst`` finished (its manifest says so)."""
    manifest = read_manifest(dst)
    return bool(manifest and manifest.get("complete"))


def _copy(made: Made, where: Path) -> Path:
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(made.archive.read_bytes())
    fs.drop(where)
    return where


def test_an_uncached_local_tar_is_read_natively(stage: Stage, made: Made, tmp_path: Path,
                                               used: list[Any]) -> None:
    fs.drop(made.archive)
    res = stage(made.archive, tmp_path / "out")
    assert [type(r).__name__ for r in used] == ["Native"]
    native = used[0]
    assert native.bytes_read == made.size  # every byte once, nothing seeked over
    assert native.blocks == -(-made.size // _readers.BLOCK)
    if fs.direct_capable(made.archive.parent):
        # Uncached: O_DIRECT, and the archive is left out of the page cache.
        assert native.direct_reads == native.blocks
        assert fs.cached(made.archive, 2 * MiB) == 0
    assert res.copied_files == res.files
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    assert fastload.verify(tmp_path / "out").ok


def test_buffered_when_direct_reads_are_off(stage: Stage, made: Made, tmp_path: Path,
                                            used: list[Any],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTLOAD_DIRECT_READS", "0")
    fs.drop(made.archive)
    stage(made.archive, tmp_path / "out")
    assert [type(r).__name__ for r in used] == ["Native"]
    assert used[0].direct_reads == 0 and used[0].bytes_read == made.size
    tars.assert_same_extraction(made.ref, tmp_path / "out")


def test_python_readahead_where_asked(stage: Stage, made: Made, tmp_path: Path,
                                     used: list[Any],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """FASTLOAD_NATIVE_READS=0: the Python read-ahead, with or without a checksum."""
    digest = hashlib.sha256(made.archive.read_bytes()).hexdigest()
    monkeypatch.setenv("FASTLOAD_NATIVE_READS", "0")
    fs.drop(made.archive)
    stage(made.archive, tmp_path / "sum", checksum=f"sha256:{digest}")
    fs.drop(made.archive)
    stage(made.archive, tmp_path / "off")
    assert [type(r).__name__ for r in used] == ["Read", "Read"]
    tars.assert_same_extraction(made.ref, tmp_path / "sum")
    tars.assert_same_extraction(made.ref, tmp_path / "off")


# --------------------------------------------------------------------------------------
# A published checksum: the job's hasher thread takes the blocks as they are fed
# --------------------------------------------------------------------------------------


def test_a_checksum_is_hashed_from_the_native_reads(stage: Stage, made: Made,
                                                    tmp_path: Path,
                                                    used: list[Any]) -> None:
    """sha256 and md5 of the blocks the job reads: every byte read once (O_DIRECT
    where uncached), even with members skipped (nothing is seeked over: the checksum
    needs them), the extraction GNU tar's."""
    data = made.archive.read_bytes()
    for algo in ("sha256", "md5"):
        fs.drop(made.archive)
        stage(made.archive, tmp_path / algo,
              checksum=f"{algo}:{hashlib.new(algo, data).hexdigest()}")
        tars.assert_same_extraction(made.ref, tmp_path / algo)
    fs.drop(made.archive)
    res = stage(made.archive, tmp_path / "some", include=["big/*"],
                checksum=f"sha256:{hashlib.sha256(data).hexdigest()}")
    assert res.files == 2
    assert sorted(str(r) for r in trees.regular_files(tmp_path / "some")) == [
        "big/a.bin", "big/b.bin"]
    assert [type(r).__name__ for r in used] == ["Native"] * 3
    for native in used:
        assert native.bytes_read == made.size and native.blocks == -(-made.size // _readers.BLOCK)
    if fs.direct_capable(made.archive.parent):
        assert all(native.direct_reads == native.blocks for native in used)


def test_a_checksum_mismatch_drops_the_journal(stage: Stage, made: Made, tmp_path: Path,
                                               used: list[Any]) -> None:
    """A wrong checksum through the native reader: ChecksumMismatchError naming the
    archive, nothing marked complete, and nothing of the run trusted later: the re-run
    with the right checksum writes every member again."""
    good = f"sha256:{hashlib.sha256(made.archive.read_bytes()).hexdigest()}"
    bad = good[:-1] + ("0" if good[-1] != "0" else "1")
    dst = tmp_path / "dst"
    fs.drop(made.archive)
    with pytest.raises(fastload.ChecksumMismatchError) as e:
        stage(made.archive, dst, checksum=bad)
    assert str(made.archive) in str(e.value)
    with pytest.raises(fastload.StageError):
        fastload.verify(dst)
    res = stage(made.archive, dst, checksum=good)
    assert [type(r).__name__ for r in used] == ["Native", "Native"]
    assert res.copied_files == res.files and not res.skipped
    tars.assert_same_extraction(made.ref, dst)
    assert fastload.verify(dst).ok


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_a_checksum_of_a_compressed_archive(stage: Stage, made: Made, tmp_path: Path,
                                            used: list[Any], kind: str) -> None:
    """The checksum is of the compressed file: hashed from the job's reads where the job
    decodes it, from the Python read-ahead where a Python decoder does."""
    from fastload.staging.archive import python_decompressor

    if kind == "zstd":
        packed = tars.zstd_file(made.archive, tmp_path / "a.tar.zst", frames=2)
    else:
        packed = tars.gzip_file(made.archive, tmp_path / "a.tar.gz", members=2)
    good = f"sha256:{hashlib.sha256(packed.read_bytes()).hexdigest()}"
    fs.drop(packed)
    stage(packed, tmp_path / "out", checksum=good)
    with pytest.raises(fastload.ChecksumMismatchError):
        stage(packed, tmp_path / "bad", checksum="sha256:" + "0" * 64)
    want = "Read" if python_decompressor(kind) is not None else "Native"
    assert [type(r).__name__ for r in used] == [want, want]
    tars.assert_same_extraction(made.ref, tmp_path / "out")


class _SlowHasher:
    """A hasher that copies every block it is given, slowly (the hasher thread lags
    behind the reads), and fails at block ``fail_at`` if set."""

    def __init__(self, fail_at: int = -1) -> None:
        self.blocks: list[bytes] = []
        self.fail_at = fail_at

    def update(self, data: Any) -> None:
        if len(self.blocks) == self.fail_at:
            raise RuntimeError("hasher failed on purpose")
        time.sleep(0.02)  # the next blocks are read meanwhile, into other blocks
        self.blocks.append(bytes(memoryview(data)))


def _read_natively(made: Made, out: Path, hasher: Any) -> _readers.NativeReader:
    """``made``'s archive read and fed by the job itself with ``hasher``, 1 MiB blocks
    (many of them), 4 in flight, 8 to lend."""
    from fastload import _core

    out.mkdir()
    options = _core.ExtractOptions(threads=4, files_in_flight=8, chunk_size=MiB,
                                   read_block_size=MiB, read_blocks=8)
    job = _core.ExtractJob(str(out), str(made.archive), options)
    reader = _readers.NativeReader(made.archive, made.size, job, depth=4, hasher=hasher)
    try:
        reader.run(None)
        job.finish()
    except BaseException:
        job.abort()
        raise
    finally:
        reader.close()
    return reader


def test_the_hasher_gets_every_block_in_order_before_its_reuse(made: Made,
                                                               tmp_path: Path) -> None:
    """A hasher slower than the reads, over ~40 one-MiB blocks of which 8 exist: what
    it was handed, joined, is the file, byte for byte (a block reused before it was
    hashed would show here); the extraction is GNU tar's."""
    fs.drop(made.archive)
    hasher = _SlowHasher()
    reader = _read_natively(made, tmp_path / "out", hasher)
    assert b"".join(hasher.blocks) == made.archive.read_bytes()
    assert reader.blocks == len(hasher.blocks) == -(-made.size // MiB)
    assert reader.hash_wait_seconds > 0  # the feeding waited for the hasher
    tars.assert_same_extraction(made.ref, tmp_path / "out")


def test_a_failing_hasher_stops_the_reading(made: Made, tmp_path: Path) -> None:
    """What the hasher raises comes out of the native call unchanged; only whole files
    are left."""
    with pytest.raises(RuntimeError, match="on purpose"):
        _read_natively(made, tmp_path / "out", _SlowHasher(fail_at=5))
    trees.assert_no_tmp(tmp_path / "out")


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_compressed_decoded_by_the_job_is_read_natively(stage: Stage, made: Made,
                                                        tmp_path: Path, used: list[Any],
                                                        kind: str) -> None:
    """A compressed archive the job decodes itself is read by it too; one a Python
    decoder (isal, zstandard) decodes keeps the Python read-ahead, which feeds it."""
    from fastload.staging.archive import python_decompressor

    if kind == "zstd":
        packed = tars.zstd_file(made.archive, tmp_path / "a.tar.zst", frames=2)
    else:
        packed = tars.gzip_file(made.archive, tmp_path / "a.tar.gz", members=2)
    fs.drop(packed)
    stage(packed, tmp_path / "out")
    want = "Read" if python_decompressor(kind) is not None else "Native"
    assert [type(r).__name__ for r in used] == [want]
    if want == "Native":
        assert used[0].bytes_read == packed.stat().st_size
    tars.assert_same_extraction(made.ref, tmp_path / "out")


def test_truncated_while_read_names_it(stage: Stage, made: Made, tmp_path: Path,
                                       used: list[Any],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """One block in flight; after the first block is fed another process cuts the file
    to 4 MiB: the next read comes back short, a SourceChangedError naming the archive;
    only whole files are left, nothing is marked complete; once the archive is whole
    again, a re-run completes."""
    monkeypatch.setattr(_readers, "_PREFETCH", 1)
    archive = _copy(made, tmp_path / "in" / "a.tar")
    cut: list[int] = []

    def progress(done: int, total: int, *_: int) -> None:
        if done < total and not cut:
            cut.append(done)
            os.truncate(archive, 4 * MiB)

    dst = tmp_path / "dst"
    with pytest.raises(fastload.SourceChangedError, match="shorter") as e:
        stage(archive, dst, progress=progress)
    assert cut and [type(r).__name__ for r in used] == ["Native"]
    assert str(archive) in str(e.value)
    trees.assert_no_tmp(dst)
    for rel in trees.regular_files(dst):
        assert (dst / rel).read_bytes() == (made.ref / rel).read_bytes(), rel
    with pytest.raises(fastload.StageError):
        fastload.verify(dst)  # not complete
    _copy(made, archive)
    res = stage(archive, dst)
    assert not res.skipped
    tars.assert_same_extraction(made.ref, dst)


def test_done_members_are_seeked_over(stage: Stage, made: Made, tmp_path: Path,
                                      used: list[Any]) -> None:
    """The big members staged first (include): staging the whole archive into the same
    destination then skips them, and the reader seeks over their data instead of
    reading it."""
    dst = tmp_path / "dst"
    fs.drop(made.archive)
    first = stage(made.archive, dst, include=["big/*"])
    assert first.copied_files == 2
    fs.drop(made.archive)
    res = stage(made.archive, dst)
    assert [type(r).__name__ for r in used] == ["Native", "Native"]
    assert res.copied_files == res.files - 2
    # a.bin's data past the block its header is in (>= 9 MiB) and b.bin's (>= 5 MiB).
    assert used[1].bytes_read <= made.size - 14 * MiB
    tars.assert_same_extraction(made.ref, dst)
    assert fastload.verify(dst).ok


def test_a_corrupt_tar_is_refused_naming_it(stage: Stage, made: Made, tmp_path: Path,
                                            used: list[Any]) -> None:
    """A header well past the first read block has a byte of its name changed after its
    checksum was computed: a TarFormatError naming the archive; only whole files."""
    buf = bytearray(made.archive.read_bytes())
    off = next(o for o, _ in tars.header_offsets(bytes(buf)) if o > 20 * MiB)
    buf[off + 3] ^= 0x01
    bad = tmp_path / "in" / "bad.tar"
    bad.parent.mkdir()
    bad.write_bytes(buf)
    fs.drop(bad)
    dst = tmp_path / "dst"
    with pytest.raises(fastload.TarFormatError) as e:
        stage(bad, dst)
    assert [type(r).__name__ for r in used] == ["Native"]
    assert str(bad) in str(e.value)
    trees.assert_no_tmp(dst)


@pytest.mark.parametrize("with_checksum", [False, True])
def test_an_exception_from_progress_stops_it(stage: Stage, made: Made, tmp_path: Path,
                                             used: list[Any], with_checksum: bool) -> None:
    """What the callback raises between blocks (KeyboardInterrupt here, as Ctrl-C
    raises there) stops the native read (and its hasher) and comes out of stage()
    unchanged; a re-run completes."""
    archive = _copy(made, tmp_path / "in" / "a.tar")
    checksum = None
    if with_checksum:
        checksum = f"sha256:{hashlib.sha256(archive.read_bytes()).hexdigest()}"
        fs.drop(archive)

    def progress(done: int, total: int, *_: int) -> None:
        if 0 < done < total:
            raise KeyboardInterrupt

    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        stage(archive, dst, progress=progress, checksum=checksum)
    assert [type(r).__name__ for r in used] == ["Native"]
    assert used[0].blocks == 0  # run() never returned
    trees.assert_no_tmp(dst)
    fs.drop(archive)
    res = stage(archive, dst, checksum=checksum)
    assert not res.skipped
    tars.assert_same_extraction(made.ref, dst)


def test_ctrl_c_stops_a_native_read(engine: str, made: Made, tmp_path: Path) -> None:
    """A real SIGINT to a child staging through the native reader (mapped reads off, no
    progress callback: only the native call's checks between its blocks can see it):
    KeyboardInterrupt, no partial files, and a re-run completes. Signalled at a point
    in the extraction (so many of the 200 files whole), ever earlier until one lands
    mid-way."""
    archive = _copy(made, tmp_path / "in" / "a.tar")
    env = procs.child_env(FASTLOAD_MAPPED_READS="0")
    for attempt, whole in enumerate((100, 20, 1)):
        dst = tmp_path / f"dst{attempt}"
        fs.drop(archive)
        child = procs.Child(procs.stage_spec(archive, dst, engine=engine), env=env)
        assert child.wait_line("START") is not None, child.finish().stderr
        procs.act_when(child, lambda d=dst, n=whole: trees.files_at_final_names(d) >= n,
                       lambda c=child: c.signal(signal.SIGINT))
        child.finish(timeout=60)
        # (A Ctrl-C after stage() returned, before the child printed, is late.)
        if child.result is None and not _complete(dst):
            break
    else:
        pytest.fail("every extraction finished before Ctrl-C arrived")
    assert child.error is None, f"Ctrl-C became another exception: {child.error}"
    assert "KeyboardInterrupt" in child.stderr, child.stderr[-2000:]
    trees.assert_no_partial_files(made.ref, dst)
    res = procs.run_child(procs.stage_spec(archive, dst, engine=engine), env=env,
                          timeout=180).expect_result()
    assert res["skipped"] is False
    tars.assert_same_extraction(made.ref, dst)


@pytest.mark.parametrize("faults", ["eintr=0.3,short=0.4,seed=1,ops=read",
                                    "eio=1,seed=2,ops=read,after=3"])
def test_injected_read_faults(engine: str, made: Made, tmp_path: Path, faults: str) -> None:
    """FASTLOAD_FAULTS on the native reads (buffered, in a child): EINTR and short reads
    are retried invisibly; EIO is a StageError with the errno, naming the archive, and
    leaves only whole files, which a clean run completes."""
    archive = _copy(made, tmp_path / "in" / "a.tar")
    env = {"FASTLOAD_MAPPED_READS": "0", "FASTLOAD_DIRECT_READS": "0"}
    dst = tmp_path / "dst"
    spec = procs.stage_spec(archive, dst, engine=engine)
    child = procs.run_child(spec, env=procs.child_env(FASTLOAD_FAULTS=faults, **env))
    if faults.startswith("eintr"):
        assert child.expect_result()["engine"] == engine
        tars.assert_same_extraction(made.ref, dst)
        return
    err = child.expect_error()
    assert err["is"]["StageError"] and err["errno"] == errno.EIO, err
    assert str(archive) in f"{err['filename']} {err['str']}", err
    trees.assert_no_partial_files(made.ref, dst)
    res = procs.run_child(spec, env=procs.child_env(**env)).expect_result()
    assert res["skipped"] is False
    tars.assert_same_extraction(made.ref, dst)


# --------------------------------------------------------------------------------------
# A network or FUSE file system (netsim: every request 2 ms late)
# --------------------------------------------------------------------------------------


@pytest.fixture
def latency_mount(made: Made, tmp_path: Path) -> Iterator[tuple[Path, netsim.Mount]]:
    """A copy of the archive (in its own folder) served through netsim, 2 ms per
    request: (the folder behind the mount, the mount)."""
    remote = tmp_path / "remote"
    _copy(made, remote / "a.tar")
    with netsim.mounts(tmp_path) as mount:
        yield remote, mount(remote, 2000, 2000)


def test_an_archive_on_a_latency_mount_is_read_natively(made: Made, tmp_path: Path,
                                                       used: list[Any],
                                                       latency_mount: Any,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:  # fmt: skip
    """An archive on a FUSE file system is read by the job itself: the reads on the
    pread pool (the engine rule's choice there, the writes keep the destination's), no
    O_DIRECT, every byte once; the extraction is GNU tar's; with a published checksum
    too."""
    monkeypatch.delenv("FASTLOAD_ENGINE", raising=False)
    _remote, mnt = latency_mount
    archive = mnt.path / "a.tar"
    res = fastload.stage(archive, tmp_path / "out")
    digest = hashlib.sha256(made.archive.read_bytes()).hexdigest()
    fastload.stage(archive, tmp_path / "sum", checksum=f"sha256:{digest}")
    assert [type(r).__name__ for r in used] == ["Native", "Native"]
    for native in used:
        assert native.engine == "pread" and native.stripe == _readers._NET_STRIPE
        assert native.direct_reads == 0 and native.bytes_read == made.size
    assert res.engine == resolve_engine("auto", tmp_path)
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    tars.assert_same_extraction(made.ref, tmp_path / "sum")
    served = mnt.unmount()
    assert served["read_bytes"] >= made.size  # the reads went through it


def test_an_archive_cut_short_on_a_latency_mount_names_it(made: Made, tmp_path: Path,
                                                         used: list[Any],
                                                         latency_mount: Any,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:  # fmt: skip
    """The file behind the mount is cut to 4 MiB after the first block is fed: the
    next read through the mount comes back short, a SourceChangedError naming the
    archive's path on the mount; only whole files are left."""
    monkeypatch.setattr(_readers, "_PREFETCH", 1)
    remote, mnt = latency_mount
    archive = mnt.path / "a.tar"
    cut: list[int] = []

    def progress(done: int, total: int, *_: int) -> None:
        if done < total and not cut:
            cut.append(done)
            os.truncate(remote / "a.tar", 4 * MiB)

    dst = tmp_path / "dst"
    with pytest.raises(fastload.SourceChangedError, match="shorter") as e:
        fastload.stage(archive, dst, progress=progress)
    assert cut and [type(r).__name__ for r in used] == ["Native"]
    assert str(archive) in str(e.value)
    trees.assert_no_tmp(dst)
    for rel in trees.regular_files(dst):
        assert (dst / rel).read_bytes() == (made.ref / rel).read_bytes(), rel


def test_a_malformed_stripe_is_refused_naming_it(made: Made, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """FASTLOAD_READ_STRIPE that is not a number: a ValueError naming the variable;
    nothing is marked complete, and the stage runs once it is fixed (64 KiB stripes,
    buffered, on this local file system)."""
    monkeypatch.setenv("FASTLOAD_READ_STRIPE", "lots")
    monkeypatch.delenv("FASTLOAD_MAPPED_READS", raising=False)
    dst = tmp_path / "dst"
    fs.drop(made.archive)
    with pytest.raises(ValueError, match="FASTLOAD_READ_STRIPE='lots'"):
        fastload.stage(made.archive, dst)
    assert not _complete(dst)
    monkeypatch.setenv("FASTLOAD_READ_STRIPE", "65536")  # buffered: striped here too
    monkeypatch.setenv("FASTLOAD_DIRECT_READS", "0")
    assert not fastload.stage(made.archive, dst).skipped
    tars.assert_same_extraction(made.ref, dst)
