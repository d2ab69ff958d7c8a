"""An archive that is not in the page cache is read with O_DIRECT (issue 3): the disk
writes straight into the extractor's read blocks, with no copy through the cache and
without filling it with an archive read once. Blocks that are cached are still read
through the cache. What must hold either way: the extraction is GNU tar's, byte for
byte, across blocks read both ways, after a seek over skipped members (which leaves
blocks unaligned), with a published checksum, gzip, a tar of tars, and a truncated
archive; and the archive's pages are left as they were found.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest

import fastload
from fastload import _core
from kit import fs, tars, trees
from kit.tars import Made
from kit.tools import missing

pytestmark = pytest.mark.native

Stage = Callable[..., Any]
MiB = trees.MiB
cached, drop = fs.cached, fs.drop


def warm(path: Path, offset: int, length: int) -> None:
    """Reads [offset, offset + length) into the page cache, no readahead beyond it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        done = 0
        while done < length:
            done += len(os.pread(fd, min(MiB, length - done), offset + done))
    finally:
        os.close(fd)
    assert cached(path, offset, length) == length


@contextlib.contextmanager
def direct_reads(enabled: bool) -> Iterator[None]:
    with mock.patch.dict(os.environ, {"FASTLOAD_DIRECT_READS": "1" if enabled else "0"}):
        yield


def extract_by_prefetcher(made: Made, out: Path, engine: str = "auto") -> Any:
    """``made``'s archive extracted into ``out`` (made here) by a job fed by the Python
    read-ahead itself, 1 MiB blocks, 4 in flight, direct reads on; returns the reader."""
    from fastload.staging.readers import Prefetcher

    out.mkdir()
    options = _core.ExtractOptions(engine=engine, threads=4, files_in_flight=8,
                                   chunk_size=1 << 20, read_block_size=MiB, read_blocks=8)
    job = _core.ExtractJob(str(out), str(made.archive), options)
    with direct_reads(True):
        reader = Prefetcher(made.archive, made.size, job, depth=4)
    try:
        for _off, _n, b, data in reader:
            job.feed_block(b, len(data))
    finally:
        reader.close()
    job.finish()
    return reader


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    """A GNU tar of ~48 MiB whose read blocks start and end inside members and
    headers (300 small files), and GNU tar's own extraction of it."""
    return tars.block_spanning_archive(tmp_path_factory.mktemp("direct"), 300, 5)


def test_uncached_archive_is_read_direct_and_left_uncached(stage: Stage, made: Made,
                                                           tmp_path: Path) -> None:
    drop(made.archive)
    with direct_reads(True):
        stage(made.archive, tmp_path / "out")
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    # Only what sniffing the format read is cached (its first bytes and their readahead).
    assert cached(made.archive, 2 * MiB) == 0
    assert fastload.verify(tmp_path / "out").ok


def test_buffered_reads_when_disabled(stage: Stage, made: Made, tmp_path: Path) -> None:
    """FASTLOAD_DIRECT_READS=0: the same archive read through the page cache (which is
    what shows the test above read around it). This VM's cache drops pages now and then
    on its own, so "most of it", not all."""
    drop(made.archive)
    with direct_reads(False):
        stage(made.archive, tmp_path / "out")
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    assert cached(made.archive, 2 * MiB) > (made.size - 2 * MiB) // 2


def test_partly_cached_archive(stage: Stage, made: Made, tmp_path: Path) -> None:
    """MiB 8-16 cached, the rest not: blocks of both kinds in one extraction; what was
    not cached still is not."""
    drop(made.archive)
    warm(made.archive, 8 * MiB, 8 * MiB)
    with direct_reads(True):
        stage(made.archive, tmp_path / "out")
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    assert cached(made.archive, 16 * MiB) == 0
    assert cached(made.archive, 2 * MiB, 6 * MiB) == 0


@pytest.mark.parametrize("engine", ["uring", "pread"])
def test_prefetcher_reads_cached_blocks_buffered(made: Made, tmp_path: Path,
                                                 engine: str) -> None:
    """The reader itself, 1 MiB blocks: the cached ones are copied out of the cache, the
    others read direct, and the extraction fed from both is GNU tar's."""
    if engine not in fastload.available_engines():
        missing(f"{engine} is not available here")
    out = tmp_path / "out"
    blocks = -(-made.size // MiB)
    drop(made.archive)
    warm(made.archive, 8 * MiB, 8 * MiB)
    reader = extract_by_prefetcher(made, out, engine)
    # Every uncached block direct, and (unless this VM dropped all 8 on its own) not
    # the cached ones.
    assert blocks - 8 <= reader.direct_reads < blocks
    assert cached(made.archive, 16 * MiB) == 0
    tars.assert_same_extraction(made.ref, out)


def test_seek_over_skipped_members_realigns(stage: Stage, made: Made, tmp_path: Path) -> None:
    """Excluding the 17 MiB member makes the reader seek past the 9 MiB it has not read
    of it, to the header after it (512-byte, not page, aligned): one short block up to
    the next page, then the blocks are aligned again and read direct."""
    with tarfile.open(made.archive) as tf:
        skipped = tf.getmember("./big/a.bin")
        after = next(m for m in tf.getmembers() if m.offset > skipped.offset)
    assert after.offset % 4096  # the seek lands off a page boundary
    drop(made.archive)
    with direct_reads(True):
        stage(made.archive, tmp_path / "out", exclude=["big/a.bin"])
    assert not (tmp_path / "out" / "big" / "a.bin").exists()
    trees.assert_same_file(made.ref / "big" / "b.bin", tmp_path / "out" / "big" / "b.bin")
    for rel in trees.regular_files(made.ref / "small"):
        trees.assert_same_file(made.ref / "small" / rel, tmp_path / "out" / "small" / rel)
    # Only the page the short block read is cached: everything after it was read direct.
    page = after.offset - after.offset % 4096
    assert cached(made.archive, 2 * MiB) == cached(made.archive, page, 4096)


def test_checksum_over_direct_reads(stage: Stage, made: Made, tmp_path: Path) -> None:
    digest = hashlib.sha256(made.archive.read_bytes()).hexdigest()
    drop(made.archive)
    with direct_reads(True):
        stage(made.archive, tmp_path / "ok", checksum=f"sha256:{digest}")
        drop(made.archive)
        with pytest.raises(fastload.ChecksumMismatchError):
            stage(made.archive, tmp_path / "bad", checksum="sha256:" + "0" * 64)
    tars.assert_same_extraction(made.ref, tmp_path / "ok")


def test_gzip_and_nested_uncached(stage: Stage, made: Made, tmp_path: Path) -> None:
    gz = tars.gzip_file(made.archive, tmp_path / "a.tar.gz")
    tot = tars.members_archive(tmp_path / "tot.tar", [
        (tars.tinfo("part1.tar"), made.archive.read_bytes()),
        (tars.tinfo("part2.tar"), made.archive.read_bytes()),
    ])
    drop(gz)
    drop(tot)
    with direct_reads(True):
        stage(gz, tmp_path / "gz")
        stage(tot, tmp_path / "tot", unpack="nested")
    tars.assert_same_extraction(made.ref, tmp_path / "gz")
    for part in ("part1", "part2"):
        tars.assert_same_extraction(made.ref, tmp_path / "tot" / part)
    assert cached(gz, 2 * MiB) == 0
    assert cached(tot, 2 * MiB) == 0


def test_truncated_uncached_archive_names_it(stage: Stage, made: Made, tmp_path: Path) -> None:
    cut = tmp_path / "cut.tar"
    with open(made.archive, "rb") as f, open(cut, "wb") as g:
        g.write(f.read(made.size // 2 + 777))  # mid-member, not at a page boundary
    drop(cut)
    with direct_reads(True), pytest.raises(fastload.TarFormatError, match=r"cut\.tar"):
        stage(cut, tmp_path / "out")
    trees.assert_no_tmp(tmp_path / "out")


def test_direct_read_cut_short_mid_file(made: Made, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A direct read that returns short off a page boundary in the middle of the file (a
    signal, a device's limit) is not the end of the file: the rest of the block comes
    through the cache, and the extraction is GNU tar's. (A short O_DIRECT read cannot
    be made on demand here, so the one read is cut short by hand; the rest are real.)"""
    from fastload.staging import readers

    out = tmp_path / "out"
    real, cut = os.preadv, []

    def preadv(fd: int, buffers: list[Any], offset: int) -> int:
        got = real(fd, buffers, offset)
        direct = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        if not cut and offset == 16 * MiB and direct and got == MiB:
            cut.append(offset)
            return 5000  # the rest of the block is there, but the read says not
        return got

    drop(made.archive)
    monkeypatch.setattr(readers.os, "preadv", preadv)
    extract_by_prefetcher(made, out)
    assert cut == [16 * MiB]  # the one read was cut short, and direct
    tars.assert_same_extraction(made.ref, out)
