"""This process's side of :func:`fastload.monitor`: the counters a DataLoader worker (or
the main process, when it reads) keeps in its row of the monitor's shared block, and
the trace events it writes.

The block is a file of float64 rows (``/dev/shm`` where there is one), made by the
monitor before the workers start and mapped by each of them once (the monitor's
``worker_init_fn``): a worker adds to its own row with plain stores, the main process
reads every row when asked. Nothing costs a system call per sample; while tracing, a
worker appends its spans to its own file once per batch.

When no monitor is on (:data:`ACTIVE` is None) the datasets use their functions as they
are: :func:`timed` returns its argument.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .. import _core
from ..cache import store
from ..staging import waits
from .collate import PackedBatch

__all__ = ["ACTIVE", "FIELDS", "Probe", "timed"]

#: Reads that waited on a stage in the background, and their seconds (staging/waits.py).
STAGE_WAITS = ("stage_waits", "stage_wait_s")

#: The fields of a row. Stage times are exclusive (a read's time leaves out the shard
#: fetches inside it).
FIELDS = (
    "batches", "samples", "bytes", "read_s", "fetch_s", "transform_s", "collate_s",
    *store.Counters.FIELDS, *STAGE_WAITS, "pid",
)  # fmt: skip
F = {name: i for i, name in enumerate(FIELDS)}
BATCHES, SAMPLES, BYTES, READ, FETCH, TRANSFORM, COLLATE = range(7)
PID = F["pid"]
_CACHE = [(F[name], name) for name in store.Counters.FIELDS]
_WAITS = [(F[name], name) for name in STAGE_WAITS]
#: The header (row 0): the monitor's clock origin, whether workers trace (1) or not, and
#: whether the loader is iterated through the monitor now (1): a worker started by
#: iterating the loader itself records nothing.
T0, TRACING, ON = 0, 1, 2
#: Trace spans of one name closer than this (seconds) are drawn as one (a transform
#: applied sample by sample would otherwise be thousands of tiny spans).
_MERGE = 50e-6

#: Lists of samples whose bytes are counted exactly: the first _EXACT batches of a
#: process, then one in _EVERY (see Probe.batch).
_EXACT, _EVERY = 32, 8

_NAMES = {READ: "read", FETCH: "fetch shard", TRANSFORM: "transform", COLLATE: "collate"}

#: This process's probe while a monitor is on, else None.
ACTIVE: Probe | None = None

Fn = TypeVar("Fn", bound=Callable[..., Any])
OptFn = TypeVar("OptFn", bound="Callable[..., Any] | None")


def open_block(path: str) -> np.ndarray:
    """The block at ``path`` as an array of rows, mapped shared."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        mm = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.float64).reshape(-1, len(FIELDS))


class Probe:
    """Row ``row`` of the block at ``path``; spans to ``trace`` (a file of JSON events,
    one per line) while the header says so. ``label`` names the process in the trace."""

    def __init__(self, path: str, row: int, trace: str | None, label: str) -> None:
        self.block = open_block(path)
        self.row = self.block[row]
        self.header = self.block[0]
        self.row[PID] = os.getpid()
        self._base = store.COUNTERS.snapshot()
        self._waits = waits.snapshot()
        self._inner = 0.0
        self._batches = 0
        self._walked = [0, 0]  # bytes and samples of the batches walked
        self._unwalked = 0
        self._t0 = float(self.header[T0])
        self._pid = os.getpid()
        self._events: list[str] = []
        self._last: dict[tuple[str, int], list[float]] = {}
        self._fd = -1
        self._lock = threading.Lock()
        if trace is not None and self.header[TRACING]:
            self._fd = os.open(trace, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                               0o644)  # fmt: skip
            self._meta("process_name", label)
            store.on_event = self.cache_event

    # --- timing ---------------------------------------------------------------------------

    def timed(self, field: int, fn: Fn) -> Fn:
        """``fn``, its time added to ``field`` (less that of timed calls inside it)."""
        row, name = self.row, _NAMES[field]

        def run(*args: Any, **kwargs: Any) -> Any:
            outer = self._inner
            self._inner = 0.0
            t0 = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.monotonic()
                dt = t1 - t0
                if self.header[ON]:
                    row[field] += dt - self._inner
                self._inner = outer + dt
                if self._fd >= 0:
                    self.span(name, t0, t1)

        return run  # type: ignore[return-value]

    def batch(self, out: Any) -> None:
        """A batch is ready to be handed over: counts it, takes this process's cache
        counters, writes the spans of the batch while tracing. Nothing while the loader
        is not iterated through the monitor (its counters start again from there)."""
        if not self.header[ON]:
            self._base = store.COUNTERS.snapshot()
            self._waits = waits.snapshot()
            return
        row = self.row
        row[BATCHES] += 1
        n = samples_of(out)
        row[SAMPLES] += n
        # Bytes: a packed batch or a tensor says its size; a list of samples is walked
        # (about 0.5 us a sample) for the first batches and one in _EVERY after, the
        # others counted at the mean bytes per sample of those walked.
        self._batches += 1
        if (self._batches <= _EXACT or self._batches % _EVERY == 0
                or not isinstance(out, (list, tuple))):
            self._walked[0] += nbytes(out)
            self._walked[1] += n
        else:
            self._unwalked += n
        walked, walked_n = self._walked
        row[BYTES] = walked + (self._unwalked * walked / walked_n if walked_n else 0.0)
        now = store.COUNTERS.snapshot()
        for i, name in _CACHE:
            row[i] = now[name] - self._base[name]
        waited = waits.snapshot()
        for i, name in _WAITS:
            row[i] = waited[name] - self._waits[name]
        if self._fd >= 0:
            self.flush()

    # --- tracing ----------------------------------------------------------------------------

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 1)

    def _meta(self, kind: str, name: str, tid: int = 0) -> None:
        self._events.append(json.dumps({"ph": "M", "name": kind, "pid": self._pid,
                                        "tid": tid, "args": {"name": name}}))

    def span(self, name: str, t0: float, t1: float, cat: str = "data",
             args: dict[str, Any] | None = None) -> None:  # fmt: skip
        """A span on this thread (merged into the last one of its name if they touch)."""
        tid = threading.get_native_id()
        with self._lock:
            last = self._last.get((name, tid))
            if args is None and last is not None and t0 - last[1] < _MERGE:
                last[1] = t1
                return
            self._close_span(name, tid)
            if args is None:
                self._last[(name, tid)] = [t0, t1]
                return
            self._events.append(json.dumps({
                "name": name, "cat": cat, "ph": "X", "pid": self._pid, "tid": tid,
                "ts": self._us(t0), "dur": round((t1 - t0) * 1e6, 1), "args": args,
            }))  # fmt: skip

    def _close_span(self, name: str, tid: int) -> None:
        last = self._last.pop((name, tid), None)
        if last is not None:
            self._events.append(json.dumps({
                "name": name, "cat": "data", "ph": "X", "pid": self._pid, "tid": tid,
                "ts": self._us(last[0]), "dur": round((last[1] - last[0]) * 1e6, 1),
            }))  # fmt: skip

    def cache_event(self, op: str, name: str, size: int, t0: float, t1: float) -> None:
        """A download or eviction of the cache in this process (its hook)."""
        shard = name.split("-", 2)[-1]
        self.span(f"{op} {shard}", t0, t1, "cache", {"bytes": size, "entry": name})

    def flush(self) -> None:
        """Writes the spans so far (one write), or stops tracing once the monitor has."""
        with self._lock:
            for key in list(self._last):
                self._close_span(*key)
            events, self._events = self._events, []
        if self._fd < 0:
            return
        if events:
            os.write(self._fd, ("\n".join(events) + "\n").encode())
        if not self.header[TRACING]:
            self.stop_tracing()

    def stop_tracing(self) -> None:
        if store.on_event == self.cache_event:
            store.on_event = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def timed(field: int, fn: OptFn) -> OptFn:
    """``fn`` timed into ``field`` while a monitor is on; ``fn`` itself otherwise (and
    None stays None)."""
    p = ACTIVE
    if p is None or fn is None:
        return fn
    return p.timed(field, fn)


def activate(probe: Probe | None) -> None:
    global ACTIVE
    ACTIVE = probe


def samples_of(batch: Any) -> int:
    """Samples in a batch: its length (a list, a PackedBatch), a tensor's first
    dimension, that of a dict's first value; 1 for anything else."""
    if isinstance(batch, (list, tuple, PackedBatch)):
        return len(batch)
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    if isinstance(batch, dict) and batch:
        return samples_of(next(iter(batch.values())))
    return 1


def nbytes(obj: Any, depth: int = 0) -> int:
    """Payload bytes of a batch: bytes-like values, tensors and arrays, PackedBatches,
    inside lists, tuples and dicts (three levels down; strings and numbers count 0).
    A list of sample dicts of bytes, the common case, costs about 0.1 us per value."""
    t = type(obj)
    if t is bytes or t is _PAYLOAD or t is bytearray:
        return len(obj)
    if t is list or t is tuple:
        if depth >= 3:
            return 0
        total = 0
        for v in obj:
            if type(v) is dict:
                for x in v.values():
                    tx = type(x)
                    if tx is bytes or tx is _PAYLOAD:
                        total += len(x)
                    elif tx is not str and tx is not int:
                        total += nbytes(x, depth + 2)
            else:
                total += nbytes(v, depth + 1)
        return total
    if t is dict:
        return 0 if depth >= 3 else sum(nbytes(v, depth + 1) for v in obj.values())
    if t is str or t is int or t is float or obj is None:
        return 0
    n = getattr(obj, "nbytes", None)  # PackedBatch, tensors, arrays, memoryviews
    if isinstance(n, int):
        return n
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    return 0


_PAYLOAD = _core.Payload
