"""Members are written O_DIRECT where the destination allows it (issue 3): straight from
the extractor's read blocks (or, for compressed archives, its write slots) to the disk,
with no copy into the page cache and no dirty pages left for writeback. Only the last
partial page of each member goes through the cache, written once the member's direct
writes are done. stage() does so when the archive is read without touching the
destination's disk (another device, or the page cache); an uncached archive on the
same disk is extracted through the cache, so the writes do not compete with its reads.

What must hold: the extraction is GNU tar's byte for byte whatever the member sizes
(below, at and around the threshold and page boundaries, bigger than a read block), the
members' bodies never enter the page cache, exactly the expected bytes go direct (plain,
Python's three formats, gzip, nested), stage() chooses as above, and a destination that
cannot take O_DIRECT (tmpfs) or ``FASTLOAD_DIRECT_WRITES=0`` writes everything buffered.
"""

from __future__ import annotations

import gzip
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from fastload import _core
from kit import fs, tars, trees
from kit.tools import missing

pytestmark = pytest.mark.native

Stage = Callable[..., Any]
MiB = trees.MiB
cached = fs.cached
PAGE = 4096
# Sizes around what decides how a member is written: the threshold the tests set (8 KiB),
# the page (the buffered tail), the 512-byte tar block, and more than one read block.
SIZES = [1, 511, 4095, 4096, 4097, 8191, 8192, 8193, 8704, 12288, 12289, 65536 + 777,
         3 * MiB, 3 * MiB + 1, 9 * MiB + 4096 + 5]
THRESHOLD = 8192
TMPFS_MAGIC = 0x01021994
BIG = sum(s >= 64 << 10 for s in SIZES)  # members stage() writes direct by default


def expected_direct(sizes: list[int], threshold: int = THRESHOLD) -> int:
    """Bytes written O_DIRECT: every whole page of each member of threshold or more."""
    return sum(s - s % PAGE for s in sizes if s >= threshold)


class Made:
    def __init__(self, src: Path, archive: Path, ref: Path, sizes: list[int]) -> None:
        self.src, self.archive, self.ref, self.sizes = src, archive, ref, sizes


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Made:
    """A GNU tar (posix) of the boundary sizes plus 200 files of random sizes around the
    threshold, in a few directories, with odd modes; and GNU tar's extraction of it."""
    base = tmp_path_factory.mktemp("dw")
    src = base / "src"
    rng = random.Random(7)
    sizes = []
    (src / "edge").mkdir(parents=True)
    for i, size in enumerate(SIZES):
        trees.write_patterned(src / "edge" / f"e{i:02d}.bin", size, i)
        sizes.append(size)
    for i in range(200):
        size = rng.randrange(1, 40_000)
        trees.write_file(src / f"r/{i // 40}/f{i:03d}.bin", rng.randbytes(size))
        sizes.append(size)
    os.chmod(src / "edge" / "e03.bin", 0o640)
    os.chmod(src / "edge" / "e12.bin", 0o755)
    archive = tars.gnu_create(src, base / "a.tar", "posix")
    ref = tars.gnu_extract(archive, base / "ref")
    return Made(src, archive, ref, sizes)


@pytest.fixture
def capable(tmp_path: Path) -> None:
    if not fs.direct_capable(tmp_path):
        missing(f"{tmp_path} does not take O_DIRECT writes")


def assert_bodies_uncached(out: Path, threshold: int = 64 << 10) -> int:
    """Every member of ``threshold`` bytes or more was written around the cache (nothing
    has read the files yet): none of its whole pages is there. Returns how many."""
    n = 0
    for rel, size in trees.regular_files(out).items():
        if size >= threshold:
            assert cached(out / rel, 0, size - size % PAGE) == 0, rel
            n += 1
    return n


def assert_bodies_cached(out: Path) -> None:
    """Written through the cache: most of the big members' bytes are there (dirty, or
    just written back)."""
    big = {rel: size for rel, size in trees.regular_files(out).items() if size >= 3 * MiB}
    assert sum(cached(out / rel) for rel in big) > sum(big.values()) // 2


def test_extraction_is_gnu_tars_and_bodies_stay_out_of_the_cache(
        stage: Stage, made: Made, tmp_path: Path, capable: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTLOAD_DIRECT_WRITES", str(THRESHOLD))
    out = tmp_path / "out"
    stage(made.archive, out)
    direct = assert_bodies_uncached(out, THRESHOLD)
    assert direct == sum(s >= THRESHOLD for s in made.sizes) > 10
    tars.assert_same_extraction(made.ref, out)
    assert fastload.verify(out).ok


def test_everything_buffered_when_disabled(stage: Stage, made: Made, tmp_path: Path,
                                           capable: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """FASTLOAD_DIRECT_WRITES=0: the bodies are written into the cache (still dirty or
    just written back when the test looks, so nearly all of them are there)."""
    monkeypatch.setenv("FASTLOAD_DIRECT_WRITES", "0")
    out = tmp_path / "out"
    made.archive.read_bytes()  # what would make it choose direct writes
    stage(made.archive, out)
    assert_bodies_cached(out)
    tars.assert_same_extraction(made.ref, out)


def test_auto_direct_when_the_archive_is_cached(stage: Stage, made: Made, tmp_path: Path,
                                                capable: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTLOAD_DIRECT_WRITES", raising=False)
    made.archive.read_bytes()
    stage(made.archive, tmp_path / "out")
    assert assert_bodies_uncached(tmp_path / "out") == BIG
    tars.assert_same_extraction(made.ref, tmp_path / "out")


def test_auto_buffered_when_the_archive_comes_from_the_same_disk(
        stage: Stage, made: Made, tmp_path: Path, capable: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTLOAD_DIRECT_WRITES", raising=False)
    if os.stat(made.archive).st_dev != os.stat(tmp_path).st_dev:
        missing("the archive and the destination are on different devices here")
    fs.drop(made.archive)
    stage(made.archive, tmp_path / "out")
    assert_bodies_cached(tmp_path / "out")
    tars.assert_same_extraction(made.ref, tmp_path / "out")


def test_auto_direct_from_another_device(stage: Stage, made: Made, tmp_path: Path,
                                         capable: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The archive on tmpfs (like network storage: reading it does not touch the
    destination's disk), not in any sense "cached" by the destination."""
    monkeypatch.delenv("FASTLOAD_DIRECT_WRITES", raising=False)
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        missing("no /dev/shm on another device")
    archive = shm / f"fastload-dw-{os.getpid()}.tar"
    try:
        shutil.copyfile(made.archive, archive)
        stage(archive, tmp_path / "out")
    finally:
        archive.unlink(missing_ok=True)
    assert assert_bodies_uncached(tmp_path / "out") == BIG
    tars.assert_same_extraction(made.ref, tmp_path / "out")


def _run_job(archive: Path, out: Path, engine: str, *, compression: str = "none",
             direct_write_min: int = THRESHOLD, nested: bool = False,
             data: bytes | None = None) -> Any:
    """Extracts ``archive`` through the job's lent read blocks (64 KiB, so members span
    many of them), or feeds ``data`` (a compressed archive) as it is."""
    out.mkdir()
    options = _core.ExtractOptions(compression=compression, nested=nested, engine=engine,
                                   threads=4, files_in_flight=16, chunk_size=1 << 20,
                                   read_block_size=64 << 10, read_blocks=16,
                                   direct_write_min=direct_write_min)
    job = _core.ExtractJob(str(out), str(archive), options)
    if data is not None:
        for i in range(0, len(data), 100_000):
            job.feed(data[i:i + 100_000])
    else:
        with open(archive, "rb") as f:
            while True:
                lent = job.lend(True)
                assert lent is not None
                b, buf = lent
                n = f.readinto(memoryview(buf))
                if not n:
                    job.release(b)
                    break
                job.feed_block(b, n)
                job.release(b)
    job.finish()
    return job


@pytest.fixture(params=["uring", "pread"])
def engine(request: pytest.FixtureRequest) -> str:
    if request.param not in fastload.available_engines():
        missing(f"{request.param} is not available here")
    return str(request.param)


def test_exactly_the_whole_pages_of_big_members_go_direct(made: Made, tmp_path: Path,
                                                          capable: None, engine: str) -> None:
    job = _run_job(made.archive, tmp_path / "out", engine)
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    assert job.bytes_out == sum(made.sizes)
    assert job.bytes_direct == expected_direct(made.sizes)


def test_threshold_zero_writes_nothing_direct(made: Made, tmp_path: Path, capable: None,
                                              engine: str) -> None:
    job = _run_job(made.archive, tmp_path / "out", engine, direct_write_min=0)
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    assert job.bytes_direct == 0


def test_compressed_members_go_direct_from_the_write_slots(made: Made, tmp_path: Path,
                                                           capable: None, engine: str) -> None:
    """gzip: members are copied into 1 MiB write slots (page-aligned); each slot that
    ends a member is split where its buffered tail begins."""
    data = gzip.compress(made.archive.read_bytes(), compresslevel=1)
    job = _run_job(made.archive, tmp_path / "out", engine, compression="gzip", data=data)
    tars.assert_same_extraction(made.ref, tmp_path / "out")
    assert job.bytes_direct == expected_direct(made.sizes)


def test_nested_members_go_direct(made: Made, tmp_path: Path, capable: None,
                                  engine: str) -> None:
    """A tar of tars: the inner members' data lies 512-byte aligned in the read blocks
    (an inner tar starts on a block of the outer), so it is written direct in place."""
    tot = tars.members_archive(tmp_path / "tot.tar", [
        (tars.tinfo("one.tar"), made.archive.read_bytes()),
        (tars.tinfo("two.tar"), made.archive.read_bytes()),
    ])
    job = _run_job(tot, tmp_path / "out", engine, nested=True)
    for part in ("one", "two"):
        tars.assert_same_extraction(made.ref, tmp_path / "out" / part)
    assert job.bytes_direct == 2 * expected_direct(made.sizes)


def test_python_tarfile_formats(tmp_path: Path, capable: None, engine: str) -> None:
    """Python's tarfile in all three formats: long names put extra header blocks (pax
    records, GNU long names, the ustar prefix) before members, so their data starts at
    512-byte offsets that are not page-aligned in the read blocks."""
    src = tmp_path / "src"
    sizes = [9000, 4096 * 5, 70_000, 1 * MiB + 3]
    deep = src / ("d" * 120)
    deep.mkdir(parents=True)
    for i, size in enumerate(sizes):
        trees.write_patterned(deep / f"{'n' * (90 + i)}.bin", size, 40 + i)
    for fmt in ("ustar", "gnu", "pax"):
        archive = tars.py_create(src, tmp_path / f"{fmt}.tar", fmt)
        ref = tars.gnu_extract(archive, tmp_path / f"ref-{fmt}")
        job = _run_job(archive, tmp_path / f"out-{fmt}", engine)
        tars.assert_same_extraction(ref, tmp_path / f"out-{fmt}")
        assert job.bytes_direct == expected_direct(sizes)


def test_destination_without_direct_io(made: Made, tmp_path: Path, engine: str) -> None:
    """tmpfs reports no O_DIRECT alignment: everything is written through the cache."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or _core.fs_type(str(shm)) != TMPFS_MAGIC:
        missing("no tmpfs at /dev/shm")
    out = shm / f"fastload-dw-{os.getpid()}-{engine}"
    try:
        job = _run_job(made.archive, out, engine)
        tars.assert_same_extraction(made.ref, out)
        assert job.bytes_direct == 0
    finally:
        shutil.rmtree(out, ignore_errors=True)
