"""Running the native jobs of staging: their options, progress (a tqdm bar or a
callback, a few times a second), Ctrl-C, and the read-back of files already in a
destination (digests of files a manifest or journal of an earlier boot describes).

Used by the tree pipeline (tree.py), the archive pipeline (archive.py) and verify().
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Union

from .. import _core
from .._util import usable_cores
from .engine import fs_kind, resolve_engine
from .state import Record, Records, quick_same

Patterns = Union[str, Sequence[str], None]
ProgressCallback = Callable[[int, int, int, int], None]
Progress = Union[bool, ProgressCallback, None]

DEFAULT_STRIPE = 16 << 20
DEFAULT_BIG_BUFFERS = 8
# Files in flight per submitter (a core, up to 8; the copier's default_submitters) by the
# storage's latency: local disks answer in tens of microseconds, so a few files per core
# keep them busy; a network or FUSE file system answers in milliseconds, and Little's
# law wants rate x latency in flight (RESULTS.md, issue 33: CPU per file): a core copies
# about 20,000 small files a second, each some 3 round trips (open, read, close), so
# about 64 files per core per millisecond of one request's latency, where it was
# measured (engine.request_latency), else NETWORK_PER_CORE (1 ms). At most
# MAX_NETWORK_PER_CORE: a server answers only so many requests at once (netsim 64, an
# NFS server its threads), and past that more in flight only queue: on netsim, 2 or more
# and 8 times NETWORK_PER_CORE were no faster at 2 ms and 10-20% slower at 10 ms (RESULTS.md,
# issue 33: warm CPU per file). So a fast network file system (under 1 ms) gets fewer
# files and threads, a slower one the former figure.
LOCAL_PER_CORE = 16
NETWORK_PER_CORE = 64
NETWORK_PER_CORE_MS = 64
MAX_NETWORK_PER_CORE = NETWORK_PER_CORE
MAX_SUBMITTERS = 8
MAX_NETWORK_FILES = MAX_NETWORK_PER_CORE * MAX_SUBMITTERS
POLL_MS = 100
# A thread's own poll where set (schedule.py's chunks: a reader waits for the files a
# chunk finished until they are taken from it).
_poll = threading.local()


def set_poll_ms(ms: int, eager: bool = False) -> None:
    """How often run_job takes finished files on this thread (default POLL_MS); with
    ``eager``, also as soon as one is (a job of files readers wait for: a few dozen)."""
    _poll.ms = ms
    _poll.eager = eager


def set_background() -> None:
    """The copy jobs this thread makes from now on run their threads at nice 19
    (CopyOptions.lowest_priority: a stage in the background's own order,
    schedule.yield_cpu)."""
    _poll.background = True


def runs_background() -> bool:
    """Whether :func:`set_background` was called on this thread."""
    return bool(getattr(_poll, "background", False))
PROGRESS_EVERY = 0.25  # seconds between progress callbacks
JOURNAL_EVERY = 1.0  # seconds between journal flushes (each costs a syncfs)

# Entry kinds of a native tree listing.
FILE, DIR, LINK = 0, 1, 2


class Bar:
    """A progress bar (tqdm) driven by the native counters."""

    def __init__(self, desc: str, total: int | None, initial: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total,
            initial=initial,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=desc,
            dynamic_ncols=True,
            smoothing=0.1,
        )

    def __call__(
        self, bytes_done: int, bytes_total: int, files_done: int, files_total: int
    ) -> None:
        self._bar.n = bytes_done
        # An archive's member count is known only at its end (files_total 0 till then).
        files = f"{files_done}/{files_total}" if files_total else f"{files_done}"
        self._bar.set_postfix_str(f"{files} files", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def progress_callback(
    progress: Progress, desc: str, total: int | None, initial: int
) -> tuple[ProgressCallback | None, Bar | None]:
    if progress is True:
        bar = Bar(desc, total, initial)
        return bar, bar
    if callable(progress):
        return progress, None
    return None, None


def run_job(
    job: Any,
    *,
    on_progress: ProgressCallback | None,
    base_bytes: int,
    base_files: int,
    total_bytes: int,
    total_files: int,
    on_done: Callable[[list[tuple[int, bytes]], bool], None],
) -> None:
    """Runs a started CopyJob to its end: progress, journal, Ctrl-C, errors."""
    last = 0.0

    def report() -> None:
        if on_progress is not None:
            on_progress(
                base_bytes + job.bytes_done, total_bytes, base_files + job.files_done, total_files
            )

    poll, eager = getattr(_poll, "ms", POLL_MS), getattr(_poll, "eager", False)
    try:
        while not job.wait(poll, eager):
            now = time.monotonic()
            on_done(job.take_done(), False)
            if now - last >= PROGRESS_EVERY:
                last = now
                report()
    except BaseException:
        # Ctrl-C (or an error in a callback): stop the native job, keep what finished.
        job.cancel()
        while not job.wait(POLL_MS):
            pass
        on_done(job.take_done(), True)
        raise
    on_done(job.take_done(), True)
    job.rethrow()
    report()


@dataclasses.dataclass(frozen=True)
class InFlight:
    """How many files a native job keeps in flight, and the pread pool's threads."""

    files: int
    threads: int
    cores: int
    """The cores this process may run on (its affinity: taskset, a cgroup's cpuset)."""
    network: bool | None
    """Whether the storage the job waits on is a network or FUSE file system (None: no
    path given, or statfs could not tell)."""
    fuse: bool = False
    """Whether it is a FUSE one."""


def network_per_core(latency_s: float | None) -> int:
    """Files in flight per core on a network or FUSE file system whose requests take
    ``latency_s`` (None: not measured, NETWORK_PER_CORE): NETWORK_PER_CORE_MS per
    millisecond, at least LOCAL_PER_CORE, at most MAX_NETWORK_PER_CORE."""
    if latency_s is None:
        return NETWORK_PER_CORE
    per = math.ceil(max(0.0, latency_s) * 1e3 * NETWORK_PER_CORE_MS)
    return min(max(per, LOCAL_PER_CORE), MAX_NETWORK_PER_CORE)


def in_flight(
    workers: int | None,
    where: Path | str | None = None,
    cores: int | None = None,
    latency_s: float | None = None,
) -> InFlight:
    """The one rule for files in flight of every native job (a tree copy, verify, an
    archive's extraction, the walk's threads): ``workers`` when given; else
    ``per_core x min(cores, 8)`` (a submitter per core, up to 8), ``per_core``
    being :func:`network_per_core` of ``latency_s`` (the storage's request latency,
    where measured: engine.request_latency) where ``where`` (what the job waits on: a
    tree's source, an extraction's destination) is on a network or FUSE file system,
    at most MAX_NETWORK_FILES, else LOCAL_PER_CORE. Threads of the pread pool: half the
    files, at least 4, at most 64 on local storage (blocked threads there are few) and
    256 on a network (each waits out a round trip)."""
    cores = usable_cores() if cores is None else max(1, cores)
    kind = None if where is None else fs_kind(where)
    network = None if kind is None else kind > 0
    if workers:
        files = max(1, workers)
    elif network:
        files = min(network_per_core(latency_s) * min(cores, MAX_SUBMITTERS), MAX_NETWORK_FILES)
    else:
        files = LOCAL_PER_CORE * min(cores, MAX_SUBMITTERS)
    return InFlight(files, min(max(4, files // 2), 256 if network else 64), cores, network,
                    kind == 2)  # fmt: skip


def copy_options(
    engine: str,
    workers: int | None,
    stripe_size: int,
    src: Path | None = None,
    latency_s: float | None = None,
) -> _core.CopyOptions:
    """A CopyJob's options: ``workers`` files in flight (default: :func:`in_flight`'s
    rule for ``src`` and its measured ``latency_s``), the engine's rule looking at
    ``src`` (the source of a tree copy)."""
    resolve_engine(engine)  # a malformed FASTLOAD_ENGINE: a ValueError naming it, up front
    flight = in_flight(workers, src, latency_s=latency_s)
    big = DEFAULT_BIG_BUFFERS
    return _core.CopyOptions(
        engine=engine,
        engine_path=src,
        depth=2 * flight.files + big + 8,
        threads=flight.threads,
        files_in_flight=flight.files,
        stripe_size=stripe_size,
        big_buffers=big,
        # Told, not looked up by every job (a statfs is a round trip on a network file
        # system: a background stage runs a job per chunk, a readers' job per batch).
        src_network=-1 if flight.network is None else int(flight.network),
        src_fuse=-1 if flight.network is None else int(flight.fuse),
    )


def digest_local(
    root: Path, entries: list[tuple[Any, ...]], engine: str, workers: int | None, stripe: int
) -> Records:
    """Reads files already in the destination and returns their journal records."""
    files = _core.CopyFiles(
        [e[0] for e in entries],
        None,
        [e[2] for e in entries],
        [e[3] for e in entries],
        [e[4] for e in entries],
        [e[5] for e in entries],
    )
    job = _core.CopyJob(str(root), "", files, copy_options(engine, workers, stripe))
    out: Records = {}

    def on_done(batch: list[tuple[int, bytes]], final: bool) -> None:
        for idx, digests in batch:
            e = entries[idx]
            out[e[0]] = Record(e[2], e[5], e[4], digests.hex())

    job.start()
    run_job(
        job,
        on_progress=None,
        base_bytes=0,
        base_files=0,
        total_bytes=0,
        total_files=0,
        on_done=on_done,
    )
    return out


def prove(
    root: Path,
    records: Records,
    engine: str,
    workers: int | None,
    stripe: int,
) -> Records:
    """The records (path -> size, mtime_ns, mode, digests) whose files, read back from
    ``root``, still have their size, time and digests: what a manifest or journal written
    on an earlier boot without a flush may take as done."""
    entries = [
        (p, FILE, r[0], (r[0] + 511) // 512, r[2], r[1])
        for p, r in records.items()
        if quick_same(root / p, r[0], r[1])
    ]
    got = digest_local(root, entries, engine, workers, stripe) if entries else {}
    return {p: records[p] for p, rec in got.items() if rec[3] == records[p][3]}


def say_waiting(line: str) -> None:
    """Tells a user watching progress why nothing moves (another process stages)."""
    print(f"fastload: {line}", file=sys.stderr, flush=True)
