"""What ``fastload.monitor`` costs (issue 36): the same epoch with and without it, side
by side.

Data: the webdataset-style shards of ``test_bench_index.py`` (``data.small_record_shards``,
3 KB records: the most samples per second, so the most per-sample work for the
monitor), read from the page cache. One shuffled epoch of ``ShardIterableDataset``
through ``DataLoader(num_workers=2, batch_size=None)``, batches of 256 made by the
dataset, each sample's payload reaching the main process.

Group ``monitor-3kb``, one case per tool:
  off       the loader iterated directly: no monitor made, the datasets' probes off
  on        ``fastload.monitor(loader)`` iterated: the loop's waits and steps, per-worker
            stage times, samples and bytes handed over
  on-trace  the same with ``trace=`` (the first 100 steps traced)

``test_monitor_cost`` runs ``off`` and ``on`` epochs in turn (A/B/A/B..., so drift of a
shared machine falls on both) and records in ``extra_info``, for each pair, the ratio on /
off of the main process's CPU per step (``getrusage(RUSAGE_SELF)``: the loop, the
monitor's per-step work), of the CPU of the whole epoch (that plus the workers',
``RUSAGE_CHILDREN``: they are joined, hence counted, when the epoch ends) and of the
wall time, and the median of each ratio as an overhead in percent (the issue's budget:
2 %). CPU, not wall time, is what to read on a loaded machine: the wall time of an epoch
is what the other processes left it. A first pair warms up and is left out.

End to end, a 1-2 % cost is within what the load of a shared 2-core machine does to a
single pair (CPU ratios of one pair spread over +-20 % there), so the test also takes
the monitor's own work apart, in this process, on CPU time of this thread
(``time.thread_time``) over ``BOOKKEEPING_STEPS`` steps (best of 3), less the same loop without it:
the main process's per step (the monitor's loop over already made batches) and a
worker's per batch (the timed read, the wrapped collate_fn and its count of the batch,
as a worker with an active probe runs them, on real batches of this data); their sum
over the off epochs' CPU per step (main process and workers) is
``bookkeeping_pct_of_epoch_cpu``. Nothing is asserted about the overhead.

Scale: full = 200,000 records (1,000 per shard); small (CI smoke,
``--benchmark-disable``) = 2,000.
"""

from __future__ import annotations

import multiprocessing
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from _guard import require_module
from _harness import IndexedShards, Scale, describe, import_fastload, indexed_shards, warm

PLANS = {"small": (2_000, 200, 1, 3), "full": (200_000, 1_000, 3, 15)}
#: Steps (batches) of the bookkeeping measure (test_monitor_cost) by scale.
BOOKKEEPING_STEPS = {"small": 2_000, "full": 20_000}
BATCH = 256
WORKERS = 2
TOOLS = ["off", "on", "on-trace"]


def _as_list(batch: Any) -> Any:
    return batch


@pytest.fixture(scope="module")
def shards(scale: Scale, tmp_path_factory: pytest.TempPathFactory) -> IndexedShards:
    n, per, _, _ = PLANS[scale.name]
    s = indexed_shards(tmp_path_factory.mktemp("monitor") / "all.fidx", n, per, 3)
    warm(s.folder)
    return s


def _loader(s: IndexedShards) -> Any:
    data = require_module("torch.utils.data")
    fl = import_fastload(torch=True)
    ds = fl.ShardIterableDataset(s.index, batch_size=BATCH)
    return data.DataLoader(ds, batch_size=None, collate_fn=_as_list, num_workers=WORKERS,
                           multiprocessing_context=multiprocessing.get_context("fork"))


def _epoch(loop: Any) -> tuple[int, int]:
    """Bytes of the samples' payloads, and steps (batches)."""
    n = steps = 0
    for batch in loop:
        steps += 1
        for sample in batch:
            n += len(sample["jpg"])
    return n, steps


def _run(tool: str, s: IndexedShards, trace: Path) -> tuple[int, int]:
    loader = _loader(s)
    if tool == "off":
        return _epoch(loader)
    fl = import_fastload(torch=True)
    m = fl.monitor(loader, trace=trace if tool == "on-trace" else None)
    try:
        got = _epoch(m)
        assert m.stats()["data/samples"] == s.samples
        return got
    finally:
        m.close()


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _per_step(fn: Any, steps: int) -> float:
    """This thread's CPU seconds per step of ``fn(steps)``, the best of 3 (the least
    disturbed by other processes)."""
    fn(min(steps, 1000))  # warm-up
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        fn(steps)
        best = min(best, time.thread_time() - t0)
    return best / steps


def _bookkeeping(s: IndexedShards, steps: int) -> dict[str, float]:
    """The monitor's own CPU per step: in the main process, and in a worker per batch."""
    fl = import_fastload(torch=True)
    from fastload.data import _probe

    batches: list[Any] = []
    for b in fl.ShardIterableDataset(s.index, batch_size=BATCH, shuffle=False):
        batches.append(b)
        if len(batches) == 8:
            break

    def cycle(n: int) -> Any:
        return (batches[i % len(batches)] for i in range(n))

    def plain_loop(n: int) -> None:
        for _ in cycle(n):
            pass

    def monitored_loop(n: int) -> None:
        with fl.monitor(cycle(n)) as m:
            for _ in m:
                pass

    main = _per_step(monitored_loop, steps) - _per_step(plain_loop, steps)
    # A worker: what it runs per batch with and without an active probe (the loader's
    # wrapped worker_init_fn attaches it to its row, as in a DataLoader worker).
    loader = _loader(s)
    m = fl.monitor(loader)
    read, collate = (lambda b: b), loader.collate_fn

    def worker_batches(n: int) -> None:
        timed_read = _probe.timed(_probe.READ, read)
        for b in cycle(n):
            collate(timed_read(b))

    try:
        off = _per_step(worker_batches, steps)
        loader.worker_init_fn(0)
        on = _per_step(worker_batches, steps)
    finally:
        _probe.activate(None)
        m.close()
    return {"main_s": main, "worker_s": on - off}


@pytest.mark.parametrize("tool", TOOLS)
def test_epoch(benchmark: Any, tool: str, shards: IndexedShards, scale: Scale,
               tmp_path: Path) -> None:  # fmt: skip
    _, _, rounds, _ = PLANS[scale.name]
    describe(benchmark, group="monitor-3kb", tool=tool, src=shards.source(), cache="warm",
             scale=scale, workers=WORKERS, batch=BATCH)  # fmt: skip
    got = benchmark.pedantic(lambda: _run(tool, shards, tmp_path / "trace.json"),
                             rounds=rounds, iterations=1)  # fmt: skip
    assert got[0] > 0


def test_monitor_cost(benchmark: Any, shards: IndexedShards, scale: Scale,
                      tmp_path: Path) -> None:  # fmt: skip
    """``off`` and ``on`` epochs in turn; the overhead of ``on`` in ``extra_info``: the
    median over the pairs of on / off, of the main process's CPU per step, of the
    epoch's CPU (main process and workers) and of its wall time."""
    _, _, _, pairs = PLANS[scale.name]
    ratios: dict[str, list[float]] = {"main_cpu_per_step": [], "total_cpu": [], "wall": []}
    seen: dict[str, list[dict[str, float]]] = {"off": [], "on": []}

    def one(tool: str) -> dict[str, float]:
        main0, kids0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        _, steps = _run(tool, shards, tmp_path / "trace.json")
        wall = time.perf_counter() - t0
        main = _cpu(resource.RUSAGE_SELF) - main0
        kids = _cpu(resource.RUSAGE_CHILDREN) - kids0
        assert steps > 0 and kids > 0, "the workers are joined (counted) by the epoch's end"
        out = {"wall": wall, "main_cpu": main, "workers_cpu": kids, "steps": steps,
               "main_cpu_per_step": main / steps, "total_cpu": main + kids}  # fmt: skip
        seen[tool].append(out)
        return out

    def measure() -> None:
        one("off"), one("on")  # warm-up: left out
        seen["off"].clear()
        seen["on"].clear()
        for _ in range(pairs):
            off, on = one("off"), one("on")
            for k in ratios:
                ratios[k].append(on[k] / off[k])

    describe(benchmark, group="monitor-cost-3kb", tool="off-on-pairs", src=shards.source(),
             cache="warm", scale=scale, workers=WORKERS, batch=BATCH, pairs=pairs)  # fmt: skip
    benchmark.pedantic(measure, rounds=1, iterations=1)
    info: dict[str, Any] = {}
    for k, r in ratios.items():
        info[f"overhead_pct_{k}"] = 100 * (statistics.median(r) - 1)
        info[f"ratios_{k}"] = [round(x, 4) for x in r]
    for k, r in ratios.items():
        q = statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3
        info[f"overhead_pct_{k}_iqr"] = [100 * (q[0] - 1), 100 * (q[2] - 1)]
    for tool, rounds in seen.items():
        for k in ("wall", "main_cpu", "workers_cpu", "main_cpu_per_step"):
            info[f"{tool}_{k}_median"] = statistics.median(x[k] for x in rounds)
    own = _bookkeeping(shards, BOOKKEEPING_STEPS[scale.name])
    off_step = statistics.median(x["total_cpu"] / x["steps"] for x in seen["off"])
    info.update(bookkeeping_main_us_per_step=own["main_s"] * 1e6,
                bookkeeping_worker_us_per_batch=own["worker_s"] * 1e6,
                off_cpu_us_per_step=off_step * 1e6,
                bookkeeping_pct_of_epoch_cpu=100 * (own["main_s"] + own["worker_s"]) / off_step)
    benchmark.extra_info.update(info)
    print(f"\nmonitor cost over {pairs} off/on pairs (median of on/off): main CPU per step "
          f"{info['overhead_pct_main_cpu_per_step']:+.2f}%, epoch CPU "
          f"{info['overhead_pct_total_cpu']:+.2f}%, wall {info['overhead_pct_wall']:+.2f}%; "
          f"off: {info['off_main_cpu_median']:.2f} s main + "
          f"{info['off_workers_cpu_median']:.2f} s workers CPU, "
          f"{info['off_wall_median']:.2f} s wall; the monitor's own work: "
          f"{info['bookkeeping_main_us_per_step']:.1f} us per step in the main process, "
          f"{info['bookkeeping_worker_us_per_batch']:.1f} us per batch in a worker, "
          f"{info['bookkeeping_pct_of_epoch_cpu']:.2f}% of the epoch's CPU per step "
          f"({info['off_cpu_us_per_step']:.0f} us)")  # fmt: skip
