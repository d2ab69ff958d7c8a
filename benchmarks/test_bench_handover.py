"""The main process's CPU time per batch received from DataLoader workers (issue 34): what
bounds batches per second however many workers there are.

Data: ``data.small_record_shards`` of 60 KB samples (a ``.jpg``, a ``.cls``, a ``.json``),
read from the page cache. ``DataLoader(batch_size=256, shuffle=True, num_workers=2|4)``,
the main loop touching only ``b.nbytes``.

Group ``main-cpu-W`` (W workers), one tool per case:
  fastload-packed  ShardIndexDataset(packed=True), collate_fn=fastload.collate: one
                   shared-memory block per field, its descriptor passed once per block
  torch-tensor     the peer: ShardIndexDataset, a collate_fn making plain tensors (the
                   payloads concatenated into one uint8 tensor, and the offsets): torch's
                   own path, a fresh shared-memory segment and a descriptor per batch
  null             the floor: the worker returns the batch's length (DataLoader's own
                   machinery: sampler, index queue, result queue)

``extra_info``: ``cpu_us_per_batch_loop``, ``time.process_time()`` of the main process
across the whole loop divided by the batches (on a machine with fewer cores than
processes this also counts the main process running slower beside busy workers), and
``cpu_us_per_batch_quiet``: the same for batches taken after every worker has finished
(all batches asked for up front, ``prefetch_factor`` large enough), the hand-over alone.
Workers are persistent and one epoch runs first, untimed: the steady state is measured,
not the workers' start or the first mapping of each block.

Scale: full = 6,000 samples (1,000 per shard), 3 rounds; small (CI smoke,
``--benchmark-disable``) = 1,024 samples.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from _harness import IndexedShards, Scale, describe, import_fastload, indexed_shards, warm


@dataclasses.dataclass(frozen=True)
class Plan:
    samples: int
    per_shard: int
    rounds: int


PLANS = {"small": Plan(1_024, 256, 1), "full": Plan(6_000, 1_000, 3)}
BATCH = 256
KB = 60
TOOLS = ["fastload-packed", "torch-tensor", "null"]
AHEAD = 2  # DataLoader's prefetch_factor (its default)
QUIET_EPOCHS = 5


@pytest.fixture(scope="session")
def plan(scale: Scale) -> Plan:
    return PLANS[scale.name]


@pytest.fixture(scope="session")
def shards(plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> IndexedShards:
    index = tmp_path_factory.mktemp("handover") / "60kb.fidx"
    return indexed_shards(index, plan.samples, plan.per_shard, KB)


class _Counted:
    """A dataset counting the batches its workers have made (a shared counter), so the
    main process can wait until every worker is done."""

    def __init__(self, inner: Any, counter: Any) -> None:
        self.inner = inner
        self.counter = counter

    def __len__(self) -> int:
        return len(self.inner)

    def __getitems__(self, indices: list[int]) -> Any:
        out = self.inner.__getitems__(indices)
        with self.counter.get_lock():
            self.counter.value += 1
        return out


class _Null:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices: list[int]) -> int:
        return len(indices)


def _plain_tensors(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's plain path: the payloads as one uint8 tensor and their offsets."""
    import torch

    jpg = [torch.frombuffer(s["jpg"], dtype=torch.uint8) for s in samples]
    sizes = torch.tensor([0] + [t.numel() for t in jpg], dtype=torch.int64)
    return {"jpg": torch.cat(jpg), "offsets": sizes.cumsum(0)}


def _identity(b: Any) -> Any:
    return b


def _nbytes(b: Any) -> int:
    if isinstance(b, int):
        return 0
    if isinstance(b, dict):
        return int(b["jpg"].numel())
    return int(b.nbytes)


def _dataset(tool: str, s: IndexedShards) -> tuple[Any, Any]:
    fl = import_fastload(torch=True)
    if tool == "fastload-packed":
        return fl.ShardIndexDataset(s.index, packed=True), fl.collate
    if tool == "torch-tensor":
        return fl.ShardIndexDataset(s.index, fields=["jpg"]), _plain_tensors
    return _Null(s.samples), _identity


def _loader(tool: str, s: IndexedShards, workers: int, counter: Any = None,
            samples: int | None = None) -> Any:
    """The DataLoader; with ``samples``, each epoch is that many random samples."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    ds, collate_fn = _dataset(tool, s)
    if counter is not None:
        ds = _Counted(ds, counter)
    gen = torch.Generator().manual_seed(0)
    return DataLoader(
        ds, batch_size=BATCH, sampler=RandomSampler(ds, num_samples=samples, generator=gen),
        num_workers=workers, collate_fn=collate_fn, prefetch_factor=AHEAD,
        persistent_workers=True, multiprocessing_context=multiprocessing.get_context("fork"),
    )


def _loop(loader: Any) -> tuple[int, int, float]:
    """(batches, payload bytes, main-process CPU seconds) of one epoch."""
    n = total = 0
    t0 = time.process_time()
    for b in loader:
        total += _nbytes(b)
        n += 1
    return n, total, time.process_time() - t0


def _quiet(tool: str, s: IndexedShards, workers: int) -> float:
    """Main-process CPU seconds per batch for batches taken once every worker is done:
    epochs of exactly the batches DataLoader asks for up front (``AHEAD`` per worker),
    each drained after the workers have made all of them; the first epoch (every block
    mapped for the first time) is not counted."""
    batches = AHEAD * workers
    counter = multiprocessing.get_context("fork").Value("i", 0)
    loader = _loader(tool, s, workers, counter, samples=batches * BATCH)
    cpu = []
    for epoch in range(QUIET_EPOCHS + 1):
        it = iter(loader)
        deadline = time.monotonic() + 300  # a hang guard only
        while counter.value < batches * (epoch + 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the last batches pickled and written by the workers' feeders
        t0 = time.process_time()
        n = sum(1 for b in it if _nbytes(b) >= 0)
        cpu.append((time.process_time() - t0) / n)
        assert n == batches
    return sorted(cpu[1:])[len(cpu) // 2 - 1]  # the median


@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("tool", TOOLS)
def test_main_cpu_per_batch(
    benchmark: Any, tool: str, workers: int, shards: IndexedShards, plan: Plan, scale: Scale,
    tmp_path: Path,
) -> None:
    warm(shards.folder)
    loader = _loader(tool, shards, workers)
    _loop(loader)  # workers started, blocks mapped: the rounds time the steady state
    describe(benchmark, group=f"main-cpu-{workers}", tool=tool, src=shards.source(),
             cache="warm", scale=scale, workers=workers, batch=BATCH)
    cpu: list[float] = []

    def epoch() -> int:
        n, total, seconds = _loop(loader)
        cpu.append(seconds / n)
        assert total > 0 or tool == "null"
        return n

    n = benchmark.pedantic(epoch, rounds=plan.rounds, iterations=1)
    assert n == -(-shards.samples // BATCH)
    quiet = _quiet(tool, shards, workers)
    benchmark.extra_info.update(
        cpu_us_per_batch_loop=round(min(cpu) * 1e6),
        cpu_us_per_batch_quiet=round(quiet * 1e6),
    )
    print(f"\nmain-cpu-{workers} {tool}: loop {min(cpu) * 1e6:.0f} us/batch, "
          f"quiet {quiet * 1e6:.0f} us/batch")
