"""An uncompressed local archive is read by the extraction job itself (issue 33:
``ExtractJob.read_source`` over io::ReadAhead, the reads on the I/O engine of the job's
backend): one native call for the whole file instead of a Python loop per block. What
must hold, on both engines: the extraction is GNU tar's; uncached blocks are read
O_DIRECT; a file cut short while it is read is a SourceChangedError naming it; members
already done are seeked over; a corrupt archive is a TarFormatError naming it; Ctrl-C
stops it and a re-run completes; ``FASTLOAD_NATIVE_READS=0`` and a published checksum
keep the Python read-ahead.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from fastload.staging import readers as _readers
from fastload.staging.state import read_manifest
from kit import fs, procs, tars, trees
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
    monkeypatch.setattr("fastload.staging.archive.NativeReader", Native)
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


def test_python_readahead_where_asked_or_needed(stage: Stage, made: Made, tmp_path: Path,
                                                used: list[Any],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A published checksum is hashed from the blocks on a Python thread: the Python
    read-ahead; so is every archive with FASTLOAD_NATIVE_READS=0."""
    digest = hashlib.sha256(made.archive.read_bytes()).hexdigest()
    fs.drop(made.archive)
    stage(made.archive, tmp_path / "sum", checksum=f"sha256:{digest}")
    monkeypatch.setenv("FASTLOAD_NATIVE_READS", "0")
    fs.drop(made.archive)
    stage(made.archive, tmp_path / "off")
    assert [type(r).__name__ for r in used] == ["Read", "Read"]
    tars.assert_same_extraction(made.ref, tmp_path / "sum")
    tars.assert_same_extraction(made.ref, tmp_path / "off")


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


def test_an_exception_from_progress_stops_it(stage: Stage, made: Made, tmp_path: Path,
                                             used: list[Any]) -> None:
    """What the callback raises between blocks (KeyboardInterrupt here, as Ctrl-C
    raises there) stops the native read and comes out of stage() unchanged; a re-run
    completes."""
    archive = _copy(made, tmp_path / "in" / "a.tar")

    def progress(done: int, total: int, *_: int) -> None:
        if 0 < done < total:
            raise KeyboardInterrupt

    dst = tmp_path / "dst"
    with pytest.raises(KeyboardInterrupt):
        stage(archive, dst, progress=progress)
    assert [type(r).__name__ for r in used] == ["Native"]
    assert used[0].blocks == 0  # run() never returned
    trees.assert_no_tmp(dst)
    fs.drop(archive)
    res = stage(archive, dst)
    assert not res.skipped
    tars.assert_same_extraction(made.ref, dst)


def test_ctrl_c_stops_a_native_read(engine: str, made: Made, tmp_path: Path) -> None:
    """A real SIGINT to a child staging through the native reader (mapped reads off):
    KeyboardInterrupt (the signal seen between the native call's blocks), no partial
    files, and a re-run completes. Signalled ever earlier until one lands mid-way."""
    archive = _copy(made, tmp_path / "in" / "a.tar")
    env = procs.child_env(FASTLOAD_MAPPED_READS="0")
    for attempt, delay in enumerate((0.2, 0.05, 0.01, 0.0)):
        dst = tmp_path / f"dst{attempt}"
        fs.drop(archive)
        child = procs.Child(procs.stage_spec(archive, dst, engine=engine, progress=True),
                            env=env)
        assert child.wait_line("START") is not None, child.finish().stderr
        time.sleep(delay)
        child.signal(signal.SIGINT)
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
