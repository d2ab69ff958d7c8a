"""A cached, uncompressed archive is mapped, not read (issue 3): the extractor writes
members straight from the mapping (``ExtractJob.map_source``/``feed_mapped``), so the
archive's cached pages are the writes' source and nothing is copied into read blocks.

What must hold: stage() maps exactly when the archive is cached, on a local file system,
uncompressed and without a checksum to compute (``FASTLOAD_MAPPED_READS`` overrides);
the extraction is GNU tar's whatever the split of the windows fed (and every whole page
of a big member is written O_DIRECT from the mapping, even across windows); and an
archive truncated under the mapping (which would raise SIGBUS and kill the process) fails
with SourceChangedError naming it, leaving only whole files, before or after its pages
were mapped in, while a SIGBUS from any other mapping still reaches faulthandler.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from fastload import _core
from fastload.staging import archive as _archive  # noqa: F401 - imported before `readers`
from fastload.staging import readers as _readers  # is patched (archive binds its classes)
from kit import fs, tars, trees

pytestmark = pytest.mark.native

Stage = Callable[..., Any]
MiB = trees.MiB
PAGE = 4096


class Made:
    def __init__(self, archive: Path, ref: Path, sizes: list[int]) -> None:
        self.archive, self.ref, self.sizes = archive, ref, sizes


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    """A GNU tar (posix) of ~26 MiB: members bigger than the 8 MiB windows stage() feeds,
    and 300 small ones of random sizes; with GNU tar's extraction of it."""
    base = tmp_path_factory.mktemp("mapped")
    src = base / "src"
    rng = random.Random(3)
    sizes = [9 * MiB + 4097, 5 * MiB, 70_000, 4096, 1]
    (src / "big").mkdir(parents=True)
    for i, size in enumerate(sizes):
        trees.write_patterned(src / "big" / f"b{i}.bin", size, 60 + i)
    for i in range(300):
        size = rng.randrange(1, 60_000)
        trees.write_file(src / f"small/{i // 50}/s{i:03d}.bin", rng.randbytes(size))
        sizes.append(size)
    archive = tars.gnu_create(src, base / "a.tar", "posix")
    return Made(archive, tars.gnu_extract(archive, base / "ref"), sizes)


@pytest.fixture
def readers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which reader each stage() of an archive used ("mapped", "native": the job reads it
    itself, or "read": the Python read-ahead): the real readers, subclassed to record
    it."""
    used: list[str] = []

    class Mapped(_readers.MappedReader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            used.append("mapped")
            super().__init__(*args, **kwargs)

    class Read(_readers.Prefetcher):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            used.append("read")
            super().__init__(*args, **kwargs)

    class Native(_readers.NativeReader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            used.append("native")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_readers, "MappedReader", Mapped)
    monkeypatch.setattr(_readers, "Prefetcher", Read)
    monkeypatch.setattr(_readers, "NativeReader", Native)
    monkeypatch.delenv("FASTLOAD_MAPPED_READS", raising=False)
    monkeypatch.delenv("FASTLOAD_NATIVE_READS", raising=False)
    return used


def test_a_cached_archive_is_mapped(stage: Stage, made: Made, tmp_path: Path,
                                    readers: list[str]) -> None:
    # Held in the page cache (CI's sanitized pass beside the benchmarks evicted an
    # archive just read, and the stage then rightly read it: ['native']).
    with fs.resident(made.archive):
        res = stage(made.archive, tmp_path / "out")
    assert readers == ["mapped"]
    assert res.files == len(made.sizes) and res.bytes == sum(made.sizes)
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    assert fastload.verify(tmp_path / "out").ok


def test_an_uncached_archive_is_read(stage: Stage, made: Made, tmp_path: Path,
                                     readers: list[str]) -> None:
    fs.drop(made.archive)
    stage(made.archive, tmp_path / "out")
    assert readers == ["native"]  # local, uncompressed, no checksum: the job reads it
    tars.assert_same_extraction(made.ref, tmp_path / "out")


def test_the_environment_overrides(stage: Stage, made: Made, tmp_path: Path,
                                   readers: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTLOAD_MAPPED_READS", "0")
    made.archive.read_bytes()
    stage(made.archive, tmp_path / "read")
    monkeypatch.setenv("FASTLOAD_MAPPED_READS", "1")
    fs.drop(made.archive)
    stage(made.archive, tmp_path / "mapped")  # the pages are read in by populate()
    assert readers == ["native", "mapped"]
    tars.assert_same_extraction(made.ref, tmp_path / "read")
    tars.assert_same_extraction(made.ref, tmp_path / "mapped")


def test_checksummed_and_compressed_archives_are_read(stage: Stage, made: Made, tmp_path: Path,
                                                      readers: list[str]) -> None:
    """A published checksum is computed from the read blocks: the job reads them
    itself and hands them to its hasher (test_archive_native.py); a compressed archive
    is decoded into write slots anyway: read, by the job itself where it decodes it,
    else by the Python read-ahead that feeds the decoder."""
    import hashlib

    from fastload.staging.archive import python_decompressor

    digest = hashlib.sha256(made.archive.read_bytes()).hexdigest()
    stage(made.archive, tmp_path / "sum", checksum=f"sha256:{digest}")
    gz = tars.gzip_file(made.archive, tmp_path / "a.tar.gz")
    gz.read_bytes()
    stage(gz, tmp_path / "gz")
    assert readers == ["native", "read" if python_decompressor("gzip") else "native"]
    tars.assert_same_extraction(made.ref, tmp_path / "sum")
    tars.assert_same_extraction(made.ref, tmp_path / "gz")


def test_members_selected_by_globs_from_the_mapping(stage: Stage, made: Made, tmp_path: Path,
                                                    readers: list[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Excluded members (the big ones) are seeked over in the mapping (forced: the
    archive read just before may have left the page cache under memory pressure, as in
    the sanitized pass beside the benchmarks, and then it is rightly read, not mapped)."""
    monkeypatch.setenv("FASTLOAD_MAPPED_READS", "1")
    made.archive.read_bytes()
    res = stage(made.archive, tmp_path / "out", exclude=["big/*"])
    assert readers == ["mapped"]
    got = trees.regular_files(tmp_path / "out")
    assert not any(p.startswith("big/") for p in got)
    assert res.files == len(got) == len(made.sizes) - 5
    for rel in got:
        assert (tmp_path / "out" / rel).read_bytes() == (made.ref / rel).read_bytes()


def _mapped_job(archive: Path, out: Path, engine: str, *, nested: bool = False,
                direct_write_min: int = 8192) -> Any:
    out.mkdir()
    options = _core.ExtractOptions(nested=nested, engine=engine, threads=4, files_in_flight=16,
                                   chunk_size=1 << 20, direct_write_min=direct_write_min)
    job = _core.ExtractJob(str(out), str(archive), options)
    fd = os.open(archive, os.O_RDONLY | os.O_CLOEXEC)
    try:
        job.map_source(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return job


def _feed_in_windows(job: Any, size: int, window: int) -> None:
    for off in range(0, size, window):
        n = min(window, size - off)
        job.populate(off, n)
        job.feed_mapped(off, n)


@pytest.mark.parametrize("window", [100_003, 196 * 512, 8 * MiB])
def test_any_split_extracts_like_gnu_tar(made: Made, tmp_path: Path, engine: str,
                                         window: int) -> None:
    """Windows that cut headers and members anywhere. Where the destination takes
    O_DIRECT and windows end on 512-byte blocks (stage() feeds 8 MiB), every whole page
    of a member of 8 KiB or more goes direct from the mapping, even where a window cuts
    it: its data lies 512-byte aligned in one contiguous mapping. (A window ending
    elsewhere leaves a misaligned piece, and the rest of that member goes buffered.)"""
    size = made.archive.stat().st_size
    job = _mapped_job(made.archive, tmp_path / "out", engine)
    _feed_in_windows(job, size, window)
    job.finish()
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    assert job.bytes_in == size
    assert job.bytes_out == sum(made.sizes)
    if fs.direct_capable(tmp_path) and window % 512 == 0:
        assert job.bytes_direct == sum(s - s % PAGE for s in made.sizes if s >= 8192)


def test_nested_from_the_mapping(made: Made, tmp_path: Path, engine: str) -> None:
    tot = tars.members_archive(tmp_path / "tot.tar", [
        (tars.tinfo("one.tar"), made.archive.read_bytes()),
        (tars.tinfo("two.tar"), made.archive.read_bytes()),
    ])
    job = _mapped_job(tot, tmp_path / "out", engine, nested=True)
    _feed_in_windows(job, tot.stat().st_size, 3 * MiB + 512)
    job.finish()
    for part in ("one", "two"):
        tars.assert_same_extraction(made.ref, tmp_path / "out" / part)


def _assert_only_whole_files(out: Path, ref: Path) -> None:
    trees.assert_no_tmp(out)
    for rel in trees.regular_files(out):
        assert (out / rel).read_bytes() == (ref / rel).read_bytes(), rel


def test_truncated_after_its_pages_were_mapped(made: Made, tmp_path: Path, engine: str) -> None:
    """The pages are mapped in (populate), then the file shrinks: parsing the mapping
    faults with SIGBUS, which the job turns into SourceChangedError."""
    archive = tmp_path / "a.tar"
    archive.write_bytes(made.archive.read_bytes())
    size = archive.stat().st_size
    job = _mapped_job(archive, tmp_path / "out", engine)
    job.populate(0, size)
    os.truncate(archive, size // 2)
    with pytest.raises(fastload.SourceChangedError, match="shorter") as e:
        job.feed_mapped(0, size)
    assert str(archive) in str(e.value)
    job.abort()
    _assert_only_whole_files(tmp_path / "out", made.ref)


def test_truncated_before_its_pages_were_mapped(made: Made, tmp_path: Path,
                                                engine: str) -> None:
    archive = tmp_path / "a.tar"
    archive.write_bytes(made.archive.read_bytes())
    size = archive.stat().st_size
    job = _mapped_job(archive, tmp_path / "out", engine)
    job.populate(0, size // 4)
    os.truncate(archive, size // 2)
    with pytest.raises(fastload.SourceChangedError, match="shorter"):
        job.populate(size // 4, size - size // 4)
    job.abort()


def test_truncated_while_staging(stage: Stage, made: Made, tmp_path: Path,
                                 readers: list[str]) -> None:
    """stage() of a cached archive that another process cuts short after the first
    window: SourceChangedError naming it, nothing marked complete, no temporaries; once
    the archive is whole again, a re-run completes."""
    archive = tmp_path / "in" / "a.tar"
    archive.parent.mkdir()
    data = made.archive.read_bytes()
    archive.write_bytes(data)
    cut = []

    def progress(done: int, total: int, *_: int) -> None:
        if done < total and not cut:
            cut.append(done)
            os.truncate(archive, 10 * MiB)

    dst = tmp_path / "dst"
    with pytest.raises(fastload.SourceChangedError) as e:
        stage(archive, dst, progress=progress)
    assert readers == ["mapped"] and cut
    assert str(archive) in str(e.value)
    _assert_only_whole_files(dst, made.ref)
    with pytest.raises(fastload.StageError):
        fastload.verify(dst)  # not complete
    archive.write_bytes(data)
    res = stage(archive, dst)
    assert not res.skipped
    tars.assert_same_extraction(made.ref, dst)


_FOREIGN_FAULT = """
import faulthandler, mmap, os, sys
faulthandler.enable()
from fastload import _core
archive, out, other = sys.argv[1:]
options = _core.ExtractOptions(engine="pread", threads=2, files_in_flight=4, chunk_size=1 << 20)
job = _core.ExtractJob(out, archive, options)
fd = os.open(archive, os.O_RDONLY)
job.map_source(fd, os.fstat(fd).st_size)  # installs the SIGBUS handler
os.close(fd)
with open(other, "r+b") as f:
    m = mmap.mmap(f.fileno(), 8192)
os.truncate(other, 0)
print("touching", flush=True)
m[4096]
print("survived", flush=True)
"""


def test_a_sigbus_from_another_mapping_still_reaches_faulthandler(made: Made,
                                                                  tmp_path: Path) -> None:
    """The handler catches only faults in a guarded mapping on the guarding thread; any
    other SIGBUS goes on to the handler that was there before (faulthandler here)."""
    other = tmp_path / "other"
    other.write_bytes(bytes(8192))
    (tmp_path / "out").mkdir()
    p = subprocess.run([sys.executable, "-c", _FOREIGN_FAULT, str(made.archive),
                        str(tmp_path / "out"), str(other)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert "touching" in p.stdout and "survived" not in p.stdout
    assert "Fatal Python error: Bus error" in p.stderr, p.stderr
    assert p.returncode != 0
    if "LD_PRELOAD" not in os.environ:  # a sanitizer may end it its own way
        assert p.returncode == -signal.SIGBUS
