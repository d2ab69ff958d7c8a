"""Helpers the benchmark modules share: scales, sources, page-cache control, fresh
destinations per round, and the metadata report.py reads."""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from _cpu import CpuMeter, CpuRound, summary
from _guard import missing, require_module


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    tree_files: int
    tree_classes: int
    tree_mean_kb: float
    large_count: int
    large_bytes: int
    netsim_files: int
    netsim_classes: int
    digest_bytes: int
    rounds: int
    """Measured rounds per case; each round gets a fresh destination."""


SCALES = {
    # A few hundred files and a few MiB: the whole suite in seconds.
    "small": Scale("small", 300, 10, 8, 2, 8 << 20, 150, 5, 8 << 20, 1),
    # ImageNet-like: 20,000 files of ~100 KB (~1.9 GiB), two 1 GiB files, and a 1,000-file
    # tree (~100 MiB) for the network mount, where every request costs a millisecond.
    "full": Scale("full", 20_000, 200, 100, 2, 1 << 30, 1_000, 20, 256 << 20, 3),
}


@dataclasses.dataclass(frozen=True)
class Source:
    path: Path
    files: int
    bytes: int


# --- simulated network storage ----------------------------------------------------------

# netsim is the tests' (tests/kit/netsim.c, built on first use into build/netsim/): its
# module is loaded by path (the tests' folder is not a package).
_NETSIM_KIT = Path(__file__).resolve().parents[1] / "tests" / "kit" / "netsim.py"


def _netsim_kit() -> ModuleType | None:
    name = "_fastload_netsim_kit"
    if name not in sys.modules:
        if not _NETSIM_KIT.exists():
            return None
        spec = importlib.util.spec_from_file_location(name, _NETSIM_KIT)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


NETSIM = Path(__file__).resolve().parents[1] / "build" / "netsim" / "netsim"


def netsim_unavailable() -> str | None:
    """Why netsim (a latency-adding FUSE mount) cannot run here, or None (building it on
    first use)."""
    kit = _netsim_kit()
    if kit is None:
        return f"{_NETSIM_KIT} is not here (an installed benchmark run)"
    why: str | None = kit.netsim_unavailable()
    return why


def unmount_netsim(mnt: Path) -> None:
    kit = _netsim_kit()
    assert kit is not None
    kit.unmount(mnt)


# --- page cache ------------------------------------------------------------------------

_drop_ok: bool | None = None


def drop_caches() -> bool:
    """Writes back dirty pages and drops the page cache, dentries and inodes (root only).
    Returns False where that is not possible (not root, read-only /proc/sys)."""
    global _drop_ok
    if _drop_ok is False or os.geteuid() != 0:
        _drop_ok = False
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        _drop_ok = False
        return False
    _drop_ok = True
    return True


def warm(path: Path) -> None:
    """Reads every file under ``path`` once, so it sits in the page cache."""
    buf = bytearray(1 << 20)
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


def drop_files(path: Path) -> None:
    """Takes every file under ``path`` out of the page cache (posix_fadvise DONTNEED,
    after an fsync: no root needed, unlike drop_caches; dentries and inodes stay)."""
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def prepare_cache(cache: str, src: Path) -> None:
    """Per-round cache state: ``cold`` drops the page cache, ``uncached`` only the
    source's files (:func:`drop_files`), ``warm`` pre-reads ``src``,
    ``none`` leaves it (the network mount bypasses the cache on every open anyway)."""
    if cache == "cold":
        if not drop_caches():
            missing("cold-cache rounds need root and a writable /proc/sys/vm/drop_caches")
    elif cache == "uncached":
        drop_files(src)
    elif cache == "warm":
        warm(src)
    elif cache != "none":
        raise ValueError(f"unknown cache state {cache!r}")


def check_cache(cache: str) -> None:
    """Skips a cold-cache case up front where the cache cannot be dropped."""
    if cache == "cold" and not drop_caches():
        missing("cold-cache rounds need root and a writable /proc/sys/vm/drop_caches")


# Peers that do their work in one single-threaded process: their CPU over the wall time
# is their busiest thread's share.
ONE_PROCESS_TOOLS = frozenset({"cp -r", "cp", "tar -xf", "tar -xzf", "GNU tar"})


class Rounds:
    """Runs ``fn(dst)`` under pytest-benchmark with a fresh, not yet existing destination
    per round; setup (remove the previous round's copy, flush, set the cache state) is
    not timed."""

    def __init__(self, benchmark: Any, work: Path, scale: Scale, *, sync: bool = True) -> None:
        self.benchmark = benchmark
        self.work = work
        self.scale = scale
        # Time until the copy is on disk: each round ends with syncfs() of the destination
        # (none of the tools waits for the disk, fastload included unless sync=True).
        # Without it, each tool is timed to its return.
        self.sync = sync
        self.last: Path | None = None
        self.result: Any = None
        self._n = 0
        self.cpu: list[CpuRound] = []
        spread_subdirs(work)

    def run(
        self,
        fn: Callable[[Path], Any],
        *,
        src: Path,
        cache: str,
        rounds: int | None = None,
    ) -> Any:
        def setup() -> tuple[tuple[Path], dict[str, Any]]:
            self.clean()
            if not getattr(self.benchmark, "disabled", False):
                settle_deletions()  # timing off (CI's one small pass): nothing to protect
            self._n += 1
            dst = self.work / f"round{self._n}" / "dst"
            dst.parent.mkdir(parents=True)
            syncfs(dst.parent)  # the previous round's writeback must not land in this one
            prepare_cache(cache, src)
            self.last = dst
            return (dst,), {}

        def target(dst: Path) -> None:
            with CpuMeter() as meter:
                self.result = fn(dst)
                if self.sync:
                    syncfs(dst.parent)
            assert meter.result is not None
            self.cpu.append(meter.result)

        self.cpu = []
        self.benchmark.pedantic(
            target,
            setup=setup,
            rounds=rounds or self.scale.rounds,
            iterations=1,
            warmup_rounds=0,
        )
        info = self.benchmark.extra_info
        info.update(
            summary(
                self.cpu,
                int(info.get("files", 0)),
                int(info.get("bytes", 0)),
                one_process=str(info.get("tool", "")) in ONE_PROCESS_TOOLS,
            )
        )
        return self.result

    def clean(self) -> None:
        if self.last is not None:
            remove_tree(self.last.parent)
            self.last = None


# ext4 without a journal (this machine's root) passes over every inode freed in the last
# 60 s when it allocates one (fs/ext4/ialloc.c, recently_deleted(): the freed inode's
# table block is read to see when it died). A round that follows the deletion of the
# previous round's 40,000 files pays that on each create: a quarter of the CPU samples of
# an extraction, GNU tar's rounds up to twice as long. A job unpacking onto a node's fresh
# local disk pays none of it, so a round waits until the deletions it follows are older
# than that (only where they were large, on such a file system: the small scale is not
# slowed).
# FASTLOAD_BENCH_SETTLE=0 turns the wait off (to see what it changes).
RECENTLY_DELETED_S = float(os.environ.get("FASTLOAD_BENCH_SETTLE", "61"))
LARGE_DELETION = 2_000  # files
_settle_until = 0.0  # time.monotonic() before which a new round would pay for deletions


def _ext4_without_journal(path: Path) -> bool:
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        name = dev.resolve().name
        return (Path("/sys/fs/ext4") / name / "journal_task").read_text().strip() == "<none>"
    except OSError:
        return False


def remove_tree(path: Path) -> None:
    """``rm -rf path``; a large deletion on ext4 without a journal makes the next round
    wait (:func:`settle_deletions`)."""
    global _settle_until
    if not path.exists():
        return
    # (the tree is counted only where a deletion can make anyone wait)
    large = _ext4_without_journal(path) and (
        sum(len(names) for _d, _s, names in os.walk(path)) >= LARGE_DELETION
    )
    shutil.rmtree(path, ignore_errors=True)
    if large:
        _settle_until = time.monotonic() + RECENTLY_DELETED_S


def settle_deletions() -> None:
    """Waits until the large deletions made by :func:`remove_tree` are older than the
    window in which ext4 without a journal passes over freed inodes."""
    left = _settle_until - time.monotonic()
    if left > 0:
        time.sleep(left)


_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_TOPDIR_FL = 0x00020000


def spread_subdirs(path: Path) -> None:
    """Marks ``path`` as the top of a directory hierarchy (``chattr +T``; ext2/3/4), so
    each round's directory is spread to block groups with many free inodes. That alone
    does not keep a round away from the inodes the previous round freed (just freed, those
    groups are the emptiest): :func:`settle_deletions` does. Where the flag is not
    supported this does nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        buf = bytearray(fcntl.ioctl(fd, _FS_IOC_GETFLAGS, b"\0" * 8))
        flags = int.from_bytes(buf[:4], "little") | _FS_TOPDIR_FL
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags.to_bytes(4, "little") + bytes(4))
    except OSError:
        pass
    finally:
        os.close(fd)


_libc: Any = None


def syncfs(path: Path) -> None:
    """Flushes the file system holding ``path`` (only that one, unlike sync())."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)


def describe(
    benchmark: Any, *, group: str, tool: str, src: Source, cache: str, scale: Scale, **more: Any
) -> None:
    """Names the group and records what report.py needs to derive MB/s and files/s."""
    benchmark.group = group
    benchmark.extra_info.update(
        {
            "tool": tool,
            "files": src.files,
            "bytes": src.bytes,
            "cache": cache,
            "scale": scale.name,
            **more,
        }
    )


# --- fastload itself, and shards with an index ----------------------------------------


def import_fastload(*, torch: bool = False) -> ModuleType:
    """fastload, or a skip when it is not installed (and, with torch, when torch is not)."""
    try:
        import fastload
    except ModuleNotFoundError as e:
        if e.name in ("fastload", "fastload._core"):
            missing(f"fastload is not installed ({e})")
        raise
    if torch:
        require_module("torch")
    # The staging pipelines a stage imports on first use (issue 33: `import fastload`
    # imports them no more), imported here, outside the timed rounds: the benchmarks time
    # the work, as they did when the package imported them. Where a build predates them
    # (FASTLOAD_BENCH_OTHER), whatever it lacks is skipped.
    import importlib

    for name in _LAZY_PIPELINES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            if e.name != name:
                raise
    return fastload


_LAZY_PIPELINES = ("fastload.staging", "fastload.staging.archive", "fastload.staging.readers",
                   "fastload.staging.stream", "fastload.staging.remote")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class IndexedShards:
    """webdataset-style shards from data.small_record_shards, with a fastload index."""

    folder: Path
    paths: list[str]
    counts: list[int]
    index: Path
    bytes: int

    @property
    def samples(self) -> int:
        return sum(self.counts)

    def source(self) -> Source:
        return Source(self.folder, self.samples, self.bytes)


def indexed_shards(index: Path, n: int, per: int, kb: float) -> IndexedShards:
    """``n`` records of ``kb`` KB, ``per`` to a shard (cached by data.py), indexed at
    ``index``."""
    from data import keyed, small_record_shards

    folder = small_record_shards(
        keyed("shards", n=n, kb=kb, per=per, s=0), n, kb, per, seed=0, fmt="gnu"
    )
    paths = sorted(str(p) for p in folder.glob("shard-*.tar"))
    counts = [min(per, n - i * per) for i in range(len(paths))]
    import_fastload().ShardIndex.build(paths, index)
    return IndexedShards(folder, paths, counts, index, sum(os.path.getsize(p) for p in paths))


def touch_packed(batch: Any) -> int:
    """The payload bytes of a fastload PackedBatch, every page of its blocks read once in
    this process, so the shared-memory faults of the hand-over are timed (as unpickling
    times the peers' copies)."""
    total = 0
    for _name, field in batch.items():
        if field.data.numel():
            field.data[::4096].sum()
        total += field.nbytes
    return total
