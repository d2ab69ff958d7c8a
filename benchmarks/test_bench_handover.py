"""The main process's CPU time per batch received from DataLoader workers (issue 34): what
bounds batches per second however many workers there are.

Data: ``data.small_record_shards`` of 60 KB samples (a ``.jpg``, a ``.cls``, a ``.json``),
read from the page cache. ``DataLoader(batch_size=256, shuffle=True, num_workers=2|4)``,
the main loop touching only ``b.nbytes``.

Group ``main-cpu-W`` (W workers), one tool per case:
  fastload-packed  ShardIndexDataset(packed=True), collate_fn=fastload.collate: one
                   shared-memory block per batch, its descriptor passed once per block;
                   the loop reads ``b.nbytes`` only (no tensor is built here)
  fastload-touched the same, the loop touching every field (each PackedField's ``data``
                   and ``offsets``: the batch's tensors built)
  torch-tensor     the peer: ShardIndexDataset, a collate_fn making plain tensors (the
                   payloads concatenated into one uint8 tensor, and the offsets): torch's
                   own path, a fresh shared-memory segment and a descriptor per batch
  null             the floor: the worker returns the batch's length (DataLoader's own
                   machinery: sampler, index queue, result queue)
  null-busy        the floor under the same load: the worker reads and packs the batch as
                   fastload-packed does, and returns its length (on a machine with fewer
                   cores than processes the main process runs slower beside busy workers,
                   and waits for batches more often; null's workers are idle)

``extra_info``: ``cpu_us_per_batch_loop``, ``time.process_time()`` of the main process
across the whole loop divided by the batches (on a machine with fewer cores than
processes this also counts the main process running slower beside busy workers), and
``cpu_us_per_batch_quiet``: the same for batches taken after every worker has finished
(all batches asked for up front: ``prefetch_factor`` ``QUIET_AHEAD``), the hand-over
alone.
Workers are persistent and one epoch runs first, untimed: the steady state is measured,
not the workers' start or the first mapping of each block.

Group ``unpickle-batch``: the hand-over alone, without DataLoader's queues: a batch
pickled as a worker pickles it, unpickled here, ``nbytes`` read, dropped
(``cpu_us_per_batch``), fastload-packed (``nbytes`` only) and fastload-touched (every
field) against torch-tensor.

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
TOOLS = ["fastload-packed", "fastload-touched", "torch-tensor", "null", "null-busy"]
AHEAD = 2  # DataLoader's prefetch_factor (its default)
QUIET_AHEAD = 4  # the quiet epochs' prefetch_factor: batches per worker taken once done
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
    import numpy as np
    import torch

    jpg = [np.frombuffer(s["jpg"], np.uint8) for s in samples]
    sizes = torch.tensor([0] + [len(a) for a in jpg], dtype=torch.int64)
    return {"jpg": torch.from_numpy(np.concatenate(jpg)), "offsets": sizes.cumsum(0)}


def _identity(b: Any) -> Any:
    return b


def _packed_length(b: Any) -> int:
    """null-busy's collate_fn: the batch packed as fastload-packed packs it, then dropped."""
    return len(import_fastload(torch=True).collate(b))


def _nbytes(b: Any) -> int:
    if isinstance(b, int):
        return 0
    if isinstance(b, dict):
        return int(b["jpg"].numel())
    return int(b.nbytes)


def _touched(b: Any) -> int:
    """What a loop touching every field of a PackedBatch reads: each field's tensors."""
    total = 0
    for name in b.fields:
        f = b[name]
        total += f.numel() if hasattr(f, "numel") else f.data.numel() + f.offsets.numel()
    return total


def _reader(tool: str) -> Any:
    return _touched if tool == "fastload-touched" else _nbytes


def _dataset(tool: str, s: IndexedShards) -> tuple[Any, Any]:
    fl = import_fastload(torch=True)
    if tool in ("fastload-packed", "fastload-touched"):
        return fl.ShardIndexDataset(s.index, packed=True), fl.collate
    if tool == "torch-tensor":
        return fl.ShardIndexDataset(s.index, fields=["jpg"]), _plain_tensors
    if tool == "null-busy":
        return fl.ShardIndexDataset(s.index, packed=True), _packed_length
    return _Null(s.samples), _identity


def _loader(tool: str, s: IndexedShards, workers: int, counter: Any = None,
            samples: int | None = None, ahead: int = AHEAD) -> Any:
    """The DataLoader; with ``samples``, each epoch is that many random samples."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    ds, collate_fn = _dataset(tool, s)
    if counter is not None:
        ds = _Counted(ds, counter)
    gen = torch.Generator().manual_seed(0)
    return DataLoader(
        ds, batch_size=BATCH, sampler=RandomSampler(ds, num_samples=samples, generator=gen),
        num_workers=workers, collate_fn=collate_fn, prefetch_factor=ahead,
        persistent_workers=True, multiprocessing_context=multiprocessing.get_context("fork"),
    )


def _loop(loader: Any, read: Any = _nbytes) -> tuple[int, int, float]:
    """(batches, what ``read`` counted, main-process CPU seconds) of one epoch."""
    n = total = 0
    t0 = time.process_time()
    for b in loader:
        total += read(b)
        n += 1
    return n, total, time.process_time() - t0


def _quiet(tool: str, s: IndexedShards, workers: int) -> float:
    """Main-process CPU seconds per batch for batches taken once every worker is done:
    epochs of exactly the batches DataLoader asks for up front (``QUIET_AHEAD`` per
    worker), each drained after the workers have made all of them; the first epoch (every
    block mapped for the first time) is not counted."""
    batches = QUIET_AHEAD * workers
    counter = multiprocessing.get_context("fork").Value("i", 0)
    loader = _loader(tool, s, workers, counter, samples=batches * BATCH, ahead=QUIET_AHEAD)
    read = _reader(tool)
    cpu = []
    for epoch in range(QUIET_EPOCHS + 1):
        it = iter(loader)
        deadline = time.monotonic() + 300  # a hang guard only
        while counter.value < batches * (epoch + 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the last batches pickled and written by the workers' feeders
        t0 = time.process_time()
        n = sum(1 for b in it if read(b) >= 0)
        cpu.append((time.process_time() - t0) / n)
        assert n == batches
    return sorted(cpu[1:])[len(cpu) // 2 - 1]  # the median


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 on 2 cores
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("tool", TOOLS)
def test_main_cpu_per_batch(
    benchmark: Any, tool: str, workers: int, shards: IndexedShards, plan: Plan, scale: Scale,
    tmp_path: Path,
) -> None:
    warm(shards.folder)
    loader = _loader(tool, shards, workers)
    read = _reader(tool)
    _loop(loader, read)  # workers started, blocks mapped: the rounds time the steady state
    describe(benchmark, group=f"main-cpu-{workers}", tool=tool, src=shards.source(),
             cache="warm", scale=scale, workers=workers, batch=BATCH)
    cpu: list[float] = []

    def epoch() -> int:
        n, total, seconds = _loop(loader, read)
        cpu.append(seconds / n)
        assert total > 0 or tool.startswith("null")
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


# --- the hand-over alone: one batch unpickled in the receiving process ---------------------

UNPICKLE_TOOLS = ["fastload-packed", "fastload-touched", "torch-tensor"]
UNPICKLES = 200


def _pickled_batches(tool: str, s: IndexedShards, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A function making ``UNPICKLES`` batches pickled as a worker pickles them for the
    main process (torch's ForkingPickler), in this process: for fastload the batch is
    read into this process's block pool, as in a worker (``_in_worker`` answers yes)."""
    import importlib
    from multiprocessing.reduction import ForkingPickler

    fl = import_fastload(torch=True)
    collate_module = importlib.import_module("fastload.data.collate")
    monkeypatch.setattr(collate_module, "_in_worker", lambda: True)
    ds, collate_fn = _dataset(tool, s)
    batches = [collate_fn(ds.__getitems__(list(range(i * BATCH, (i + 1) * BATCH))))
               for i in range(2)]
    assert fl is not None

    def make() -> tuple[tuple[list[bytes]], dict[str, Any]]:
        return ([bytes(ForkingPickler.dumps(batches[i % 2])) for i in range(UNPICKLES)],), {}

    return make


@pytest.mark.parametrize("tool", UNPICKLE_TOOLS)
def test_unpickle_per_batch(
    benchmark: Any, tool: str, shards: IndexedShards, scale: Scale,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Main-process CPU to receive one 256-sample batch of 60 KB samples (unpickle, read
    ``nbytes``, drop), without DataLoader's queues: fastload's block reference against
    torch's descriptor per storage."""
    import pickle

    make = _pickled_batches(tool, shards, monkeypatch)
    make()  # the first hand-over of each block (its descriptor, the mapping) untimed
    read = _reader(tool)
    for data in make()[0][0][:4]:
        read(pickle.loads(data))
    describe(benchmark, group="unpickle-batch", tool=tool, src=shards.source(), cache="warm",
             scale=scale, batch=BATCH)
    cpu: list[float] = []

    def receive(datas: list[bytes]) -> int:
        t0 = time.process_time()
        total = sum(read(pickle.loads(d)) for d in datas)
        cpu.append((time.process_time() - t0) / len(datas))
        return total

    assert benchmark.pedantic(receive, setup=make, rounds=3, iterations=1) > 0
    benchmark.extra_info["cpu_us_per_batch"] = round(min(cpu) * 1e6, 1)
    print(f"\nunpickle-batch {tool}: {min(cpu) * 1e6:.1f} us/batch")
