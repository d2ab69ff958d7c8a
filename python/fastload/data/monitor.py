"""``fastload.monitor(loader)``: where the time of a training loop goes, step by step.

The loop's side, for any iterable: how long each ``next()`` kept the loop waiting for
its batch against the time the loop spent between batches (the step), samples per
second. The workers' side, for a torch ``DataLoader``: the monitor wraps the loader's
``collate_fn`` and ``worker_init_fn`` (which still run, inside the wrappers), so each
worker counts its batches, samples and the bytes it hands over, and, reading a fastload
dataset, the time of each stage (``read``, ``fetch`` of a remote shard into the cache,
``transform``, ``collate``) and its cache's hits, misses, downloads, evictions and GETs,
in its row of a small shared block (:mod:`fastload.data._probe`).

With ``trace="trace.json"`` the first ``trace_steps`` steps are written as Chrome trace
events (open in https://ui.perfetto.dev or chrome://tracing): the loop's waits and
steps, each worker's stages, the cache's downloads and evictions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from ..cache import store
from ..staging import waits
from . import _gpu, _probe
from ._probe import FIELDS, Probe

__all__ = ["Monitor", "monitor"]

T = TypeVar("T")
log = logging.getLogger("fastload.monitor")

#: Row of the main process in the block (row 0 is the header; workers follow).
_MAIN = 1
_STAGES = ("read", "fetch", "transform", "collate")


class _Collate:
    """The loader's ``collate_fn``, timed and counted in the process that runs it."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, batch: Any) -> Any:
        p = _probe.ACTIVE
        if p is None:
            return self.fn(batch)
        out = p.timed(_probe.COLLATE, self.fn)(batch)
        p.batch(out)
        return out


class _WorkerInit:
    """The loader's ``worker_init_fn``, after attaching the worker to its row."""

    def __init__(self, fn: Callable[[int], Any] | None, block: str, trace: str | None) -> None:
        self.fn, self.block, self.trace = fn, block, trace

    def __call__(self, worker_id: int) -> None:
        trace = None if self.trace is None else f"{self.trace}.{os.getpid()}"
        try:
            probe = Probe(self.block, _MAIN + 1 + worker_id, trace, f"worker {worker_id}")
        except (OSError, ValueError):  # the monitor is gone (closed): nothing to report to
            probe = None
        _probe.activate(probe)
        if self.fn is not None:
            self.fn(worker_id)


def _rate(n: float, unit: str = "") -> str:
    for div, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{prefix}{unit}"
    return f"{n:.3g}{unit}"


class Monitor(Generic[T]):
    """Iterates ``loader`` and measures it; see :func:`monitor`."""

    def __init__(
        self,
        loader: Iterable[T],
        *,
        trace: str | os.PathLike[str] | None = None,
        trace_steps: int = 100,
        log_every: float | None = None,
        logger: logging.Logger | None = None,
        progress: Any = None,
        stall_threshold: float = 0.1,
    ) -> None:
        if trace_steps < 1:
            raise ValueError(f"trace_steps must be positive, not {trace_steps!r}")
        if not 0 <= stall_threshold <= 1:
            raise ValueError(f"stall_threshold is a share of the time in 0..1, "
                             f"not {stall_threshold!r}")  # fmt: skip
        self.loader = loader
        self.trace = None if trace is None else Path(trace)
        self.trace_steps = trace_steps
        self.log_every = log_every
        self.logger = logger or log
        self.progress = progress
        self.stall_threshold = stall_threshold
        self.workers = int(getattr(loader, "num_workers", 0) or 0)
        self._t0 = time.monotonic()
        self._dir = Path(tempfile.mkdtemp(
            prefix="fastload-monitor-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        ))  # fmt: skip
        self._finalize = weakref.finalize(self, shutil.rmtree, self._dir, True)
        path = self._dir / "block"
        with open(path, "wb") as f:
            f.truncate((_MAIN + 1 + self.workers) * len(FIELDS) * 8)
        self._block_path = str(path)
        self._block = _probe.open_block(self._block_path)
        self._block[0, _probe.T0] = self._t0
        self._block[0, _probe.TRACING] = 1.0 if self.trace is not None else 0.0
        self._tracing = self.trace is not None
        self._trace_base = str(self._dir / "trace")
        self._main: Probe | None = None
        self._cache_base = store.COUNTERS.snapshot()
        self._gpu_base = _gpu.COUNTERS.snapshot()
        self._waits_base = waits.snapshot()
        # the loop's counters
        self.steps = 0
        self.samples = 0
        self.wait_s = 0.0
        self.step_s = 0.0
        self.first_batch_s = 0.0
        self._first_wait = 0.0  # the waits for each epoch's first batch (start-up)
        self._last_log = self._t0
        self._window: dict[str, float] | None = None
        self._staged = False  # the stage read through (if any) has ended
        self._store = self._store_label()
        self._install()

    # --- the loader's hooks ---------------------------------------------------------------

    def _install(self) -> None:
        """Wraps a torch DataLoader's collate_fn and worker_init_fn (once)."""
        loader: Any = self.loader
        if not hasattr(loader, "collate_fn") or not hasattr(loader, "worker_init_fn"):
            return
        fn = loader.collate_fn
        loader.collate_fn = _Collate(fn.fn if isinstance(fn, _Collate) else fn)
        init = loader.worker_init_fn
        loader.worker_init_fn = _WorkerInit(
            init.fn if isinstance(init, _WorkerInit) else init, self._block_path,
            self._trace_base if self._tracing else None,
        )  # fmt: skip

    def _store_label(self) -> str:
        remote = getattr(getattr(self.loader, "dataset", None), "_remote", None)
        urls = getattr(getattr(remote, "shards", None), "urls", None)
        return str(urls[0]).split(":", 1)[0] if urls else "store"

    # --- iterating ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        main = Probe(self._block_path, _MAIN, f"{self._trace_base}.{os.getpid()}"
                     if self._tracing else None, "main process")  # fmt: skip
        self._main = main
        if self.workers == 0:  # the dataset is read here
            _probe.activate(main)
        clock = time.monotonic
        last: float | None = None
        self._block[0, _probe.ON] = 1.0  # the workers record from here
        try:
            it = iter(self.loader)
            while True:
                t0 = clock()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                t1 = clock()
                self.wait_s += t1 - t0
                if last is None:
                    self._first_wait += t1 - t0
                    self.first_batch_s = t1 - t0
                else:
                    self.step_s += t0 - last
                self.steps += 1
                self.samples += _probe.samples_of(batch)
                if self._tracing:
                    self._trace_step(main, t0, t1, last)
                if self.log_every is not None and t1 - self._last_log >= self.log_every:
                    self._last_log = t1
                    self._say(self._window_summary())
                last = clock()  # the step starts: the time until the next next() is its
                yield batch
            if last is not None:
                self.step_s += clock() - last
        finally:
            self._block[0, _probe.ON] = 0.0
            if _probe.ACTIVE is main:
                _probe.activate(None)
            if self._tracing:
                self._write_trace()
            main.stop_tracing()

    def _trace_step(self, main: Probe, t0: float, t1: float, last: float | None) -> None:
        if last is not None:
            main.span("step", last, t0, "loop", {"step": self.steps - 1})
        main.span("wait for batch", t0, t1, "loop", {"step": self.steps})
        main.flush()
        if self.steps >= self.trace_steps:
            self._write_trace()

    def _say(self, line: str) -> None:
        if self.progress is not None and hasattr(self.progress, "set_postfix_str"):
            self.progress.set_postfix_str(line)
        else:
            self.logger.info("%s", line)

    # --- the trace ------------------------------------------------------------------------

    def _write_trace(self) -> None:
        """Stops the workers tracing and writes the trace file (once)."""
        if not self._tracing or self.trace is None:
            return
        self._tracing = False
        self._block[0, _probe.TRACING] = 0.0
        if self._main is not None:
            self._main.flush()
        events: list[Any] = []
        for part in sorted(self._dir.glob("trace.*")):
            with contextlib.suppress(OSError):
                for line in part.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        events.append(json.loads(line))
                part.unlink()
        tmp = self.trace.with_name(f".{self.trace.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        os.replace(tmp, self.trace)

    # --- what was measured ----------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Everything measured since the monitor was made, as a flat dict of numbers
        (for TensorBoard's ``add_scalars``, ``wandb.log``, a logger): ``data/...`` the
        loop's side, ``workers/...`` the workers' (summed), ``worker/<i>/...`` each
        worker's (``worker/main/...``: the main process, where it reads or serves its
        workers' downloads), ``cache/...`` and ``store/...`` the cache's."""
        block = np.array(self._block, copy=True)
        out: dict[str, float] = {}
        busy = self.wait_s + self.step_s
        steady = busy - self._first_wait
        out["data/steps"] = self.steps
        out["data/samples"] = self.samples
        out["data/wait_s"] = self.wait_s
        out["data/step_s"] = self.step_s
        out["data/first_batch_s"] = self.first_batch_s
        out["data/startup_s"] = self._first_wait
        out["data/elapsed_s"] = busy
        out["data/wait_share"] = (self.wait_s - self._first_wait) / steady if steady > 0 else 0.0
        out["data/samples_per_s"] = self.samples / busy if busy > 0 else 0.0
        cache_now = store.COUNTERS.snapshot()
        rows = {"main": block[_MAIN].copy()}
        for name in store.Counters.FIELDS:
            rows["main"][_probe.F[name]] = cache_now[name] - self._cache_base[name]
        waits_now = waits.snapshot()
        for name in _probe.STAGE_WAITS:
            rows["main"][_probe.F[name]] = waits_now[name] - self._waits_base[name]
        for w in range(self.workers):
            rows[str(w)] = block[_MAIN + 1 + w]
        total = sum(rows.values())
        assert isinstance(total, np.ndarray)
        keep = [f for f in FIELDS if f != "pid"]
        for f in keep:
            out[f"workers/{f}"] = float(total[_probe.F[f]])
        for who, row in rows.items():
            for f in keep:
                out[f"worker/{who}/{f}"] = float(row[_probe.F[f]])
        out["data/bytes"] = out["workers/bytes"]
        out["data/bytes_per_s"] = out["workers/bytes"] / busy if busy > 0 else 0.0
        hits, misses = out["workers/hits"], out["workers/misses"]
        out["cache/hits"], out["cache/misses"] = hits, misses
        out["cache/hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
        for f in ("downloads", "download_bytes", "evictions", "evicted_bytes"):
            out[f"cache/{f}"] = out[f"workers/{f}"]
        out["store/gets"] = out["workers/gets"]
        out["store/get_s"] = out["workers/get_seconds"]
        out["store/retries"] = out["workers/retries"]
        out["store/bytes_per_s"] = out["cache/download_bytes"] / busy if busy > 0 else 0.0
        out["store/gets_in_flight"] = out["store/get_s"] / busy if busy > 0 else 0.0
        for name, v in _gpu.COUNTERS.snapshot().items():
            out[f"gpu/{name}"] = v - self._gpu_base.get(name, 0.0)
        out["stage/waits"] = out["workers/stage_waits"]  # reads that waited on the stage
        out["stage/wait_s"] = out["workers/stage_wait_s"]
        return out

    def _stage_progress(self) -> str | None:
        """The stage the dataset reads through, while it runs (stage(wait=False))."""
        handle = getattr(getattr(self.loader, "dataset", None), "staging", None)
        if handle is None or not hasattr(handle, "progress") or self._staged:
            return None
        p = handle.progress()
        if p.state in ("done", "failed"):
            self._staged = True
            return None
        if p.files_total is None:
            return f"staging: {p.files_done} files"
        share = p.bytes_done / p.bytes_total if p.bytes_total else 1.0
        return f"staging {share:.0%} ({p.files_done}/{p.files_total} files)"

    def summary(self) -> str:
        """One line on the whole run so far, the figures of :meth:`stats`: the share of
        the time the loop waited for data (after each epoch's first batch), samples/s,
        bytes/s, the cache's hit rate and the store's throughput where there is a cache,
        and, when the loop waited more than ``stall_threshold`` of the time, why
        (:meth:`stall`). The lines ``log_every`` logs are the same on the time since the
        line before."""
        return self._line(self.stats())

    def _window_summary(self) -> str:
        """:meth:`summary` of the time since the last call (or the start)."""
        now = self.stats()
        prev = self._window or {}
        self._window = now
        return self._line({k: v - prev.get(k, 0.0) for k, v in now.items()})

    def _line(self, d: dict[str, float]) -> str:
        wall = d["data/elapsed_s"]
        steady = wall - d["data/startup_s"]  # after each epoch's first batch
        share = (d["data/wait_s"] - d["data/startup_s"]) / steady if steady > 0 else 0.0
        parts = [f"data wait {share:.0%}"]
        if wall > 0:
            parts.append(f"{_rate(d['data/samples'] / wall)} samples/s")
            if d["data/bytes"]:
                parts.append(f"{_rate(d['data/bytes'] / wall, 'B')}/s")
        pins = d["cache/hits"] + d["cache/misses"]
        if pins:
            parts.append(f"cache {d['cache/hits'] / pins:.0%} hit")
        if d["cache/download_bytes"] and wall > 0:
            parts.append(f"{self._store} {_rate(d['cache/download_bytes'] / wall, 'B')}/s")
        if d["stage/waits"]:
            parts.append(f"{d['stage/waits']:.0f} reads waited on the stage "
                         f"{d['stage/wait_s']:.1f} s")  # fmt: skip
        staging = self._stage_progress()
        if staging is not None:
            parts.append(staging)
        if share > self.stall_threshold:
            parts.append("stall: " + self._explain(d))
        return " | ".join(parts)

    def stall(self) -> str | None:
        """Why the loop waited for data over the whole run, naming the slowest stage;
        None when it waited no more than ``stall_threshold`` of the time."""
        s = self.stats()
        if s["data/wait_share"] <= self.stall_threshold:
            return None
        return self._explain(s)

    def _explain(self, d: dict[str, float]) -> str:
        stages = {name: d[f"workers/{name}_s"] for name in _STAGES}
        busy = sum(stages.values())
        wall = d["data/elapsed_s"]
        readers = max(1, self.workers)
        if busy <= 0 or wall <= 0:
            return ("the loop waits on the loader (no stage times: a fastload dataset in "
                    "a torch DataLoader reports them)")
        # The workers' share of busy time, after their start (each epoch's first batch).
        use = busy / (readers * max(wall - d["data/startup_s"], 1e-9))
        if self.workers and use < 0.3:
            return (f"hand-over between processes: the workers are busy {use:.0%} of the "
                    "time while the loop waits; hand over less (packed batches: "
                    "fastload.collate) or decode after the DataLoader")
        top = max(stages, key=lambda k: stages[k])
        share = stages[top] / busy
        add = (f"add workers (num_workers={self.workers})" if self.workers
               else "read in DataLoader workers (num_workers > 0)")
        if top == "fetch":
            pins = d["cache/hits"] + d["cache/misses"]
            if d["cache/evictions"] > 0 and d["cache/misses"] > 0:
                return (f"cache misses: {d['cache/misses']:.0f} of {pins:.0f} shard reads "
                        f"missed, {d['cache/evictions']:.0f} evictions; workers wait for "
                        f"shards {share:.0%} of their time: raise cache_limit or prefetch")
            in_flight = d["store/get_s"] / wall
            rate = d["cache/download_bytes"] / wall
            return (f"store bound: {in_flight:.1f} GETs in flight, {_rate(rate, 'B')}/s "
                    f"from {self._store}; workers wait for shards {share:.0%} of their "
                    "time: raise prefetch, or stage() the data to local disk first")
        if top == "transform":
            return (f"workers busy in transform ({share:.0%} of their time): {add} or "
                    "make the transform cheaper")
        if top == "collate":
            return (f"workers busy in collate ({share:.0%} of their time): {add}, or use "
                    "packed batches (fastload.collate)")
        return (f"workers busy reading ({share:.0%} of their time): storage bound; stage() "
                "to local disk, or access='read' on network storage, or " + add)

    # --- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Writes the trace if it is not written yet; removes the shared block."""
        self._write_trace()
        self._finalize()

    def __enter__(self) -> Monitor[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def monitor(
    loader: Iterable[T],
    *,
    trace: str | os.PathLike[str] | None = None,
    trace_steps: int = 100,
    log_every: float | None = None,
    logger: logging.Logger | None = None,
    progress: Any = None,
    stall_threshold: float = 0.1,
) -> Monitor[T]:
    """``loader`` (a torch ``DataLoader``, fastload's datasets or any other, or any
    iterable), measured: iterate the monitor instead of the loader.

    ``stats()`` returns a flat dict of numbers: per step, the time the loop waited for
    the next batch (``data/wait_s``) against the time it spent between batches
    (``data/step_s``), their share (``data/wait_share``, after each epoch's first batch,
    whose start-up is ``data/first_batch_s``), samples/s and bytes/s; from a
    ``DataLoader``, per worker (``worker/<i>/...``) and summed (``workers/...``): batches,
    samples, bytes handed over (exact for packed batches and tensors; for lists of
    samples, exact for each worker's first 32 batches and one in 8 after, the others
    at the mean bytes per sample), collate time, and from fastload's datasets the time in
    each stage (``read``, ``fetch`` of remote shards into the cache, ``transform``,
    ``collate``) and the cache's hits, misses, downloads, evictions, GETs and their
    seconds (``cache/...``, ``store/...``), and the object-store requests retried
    (``store/retries``, ``worker/<i>/retries``: 503s, throttling, resets, bodies cut
    short; counted in the process that made the request, the main process for the
    downloads it serves its forked workers). ``gpu/...``: the main process's
    page-locking of worker blocks for CUDA (``registered``, ``register_failed``,
    ``register_ms``, ``registered_behind`` (on the registrar thread),
    ``register_main_ms`` (the main thread's share), ``pending_copies`` (tensors copied
    before their block's registration completed), ``unregistered``,
    ``unregister_failed``, ``unregister_ms``, ``unregister_main_ms``; lease counts held
    back for copies, ``retired``; waits for copies, ``fence_waits``).

    ``log_every=30``: a one-line :meth:`Monitor.summary` every 30 s through ``logger``
    (``logging.getLogger("fastload.monitor")`` by default, at INFO), or as the postfix of
    ``progress`` (a tqdm bar): "data wait 3% | 41k samples/s | 120MB/s | cache 97% hit |
    s3 310MB/s". When the loop waited more than ``stall_threshold`` of the time the line
    ends with the slowest stage and what to do ("stall: workers busy in transform ...:
    add workers", "cache misses ...: raise cache_limit or prefetch", "store bound: N GETs
    in flight").

    ``trace="trace.json"``: the first ``trace_steps`` steps as Chrome trace events (open
    in Perfetto or chrome://tracing): the loop's waits and steps, each worker's stages,
    the cache's downloads and evictions.

    The monitor wraps a ``DataLoader``'s ``collate_fn`` and ``worker_init_fn`` (they
    still run) so that workers started from then on report; make it before iterating
    (persistent workers started earlier report nothing). Off (the loader iterated
    directly), nothing is measured and nothing costs.
    """
    return Monitor(loader, trace=trace, trace_steps=trace_steps, log_every=log_every,
                   logger=logger, progress=progress, stall_threshold=stall_threshold)
