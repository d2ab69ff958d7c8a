"""Packed batches across the DataLoader worker boundary: a shuffled epoch through
``DataLoader(num_workers=2, batch_size=256)``, every payload reaching the main process.

Data: the webdataset-style shards of ``test_bench_index.py`` (``data.small_record_shards``:
per sample a ``.jpg`` of about 3 KB or 100 KB, a ``.cls`` and a ``.json``), read from the
page cache (each case first reads its shards once, untimed).

Groups ``handover-SIZE`` (``size`` is 3kb or 100kb), one tool per case:
  fastload-packed   ShardIndexDataset(packed=True): each batch read from the index
                    straight into one shared-memory block per field (one copy per
                    payload), collate_fn=fastload.collate
  fastload-collate  ShardIndexDataset (zero-copy Payloads) + collate_fn=fastload.collate:
                    the generic packing path, also one copy per payload
  fastload-bytes    ShardIndexDataset, collate_fn returning the list: payloads pickled as
                    bytes through the workers' pipes (what every peer does)
  webdataset        WebDataset(shardshuffle=all shards).shuffle(1000), lists of samples
  wids              ShardListDataset (shards opened in place), DataLoader shuffle
  mosaicml          MosaicML streaming: StreamingDataset(local=MDS folder, shuffle=True,
                    batch_size=256) in a DataLoader, lists of samples
  litdata           litdata StreamingDataset(input_dir=..., shuffle=True) in its
                    StreamingDataLoader, lists of samples
  hf-datasets       Hugging Face datasets: load_from_disk (memory-mapped Arrow),
                    DataLoader shuffle, lists of samples (Dataset.__getitems__ per batch)
The three peers read the same samples in their own formats, written once from the tar
shards and cached (benchmarks/_peers.py; untimed), read in place from the page cache;
scripts/bench-peers.sh sets up a venv with them (skipped where not installed).

The main process touches every page of a packed block (one read per 4 KiB) so the
shared-memory faults it costs are timed, as unpickling costs the peers their copy.
``extra_info`` holds samples/s and GB/s of payload. Where a GPU is present,
``test_host_to_device`` times pinned packed batches to the device (GB/s).

Scale: full = 200,000 x 3 KB and 20,000 x 100 KB (1,000 and 100 per shard); small (CI
smoke, ``--benchmark-disable``) = a few hundred to a few thousand samples.
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import _peers
from _guard import require_module
from _harness import (
    IndexedShards,
    Scale,
    describe,
    import_fastload,
    indexed_shards,
    touch_packed,
    warm,
)


@dataclasses.dataclass(frozen=True)
class Plan:
    samples: dict[str, int]
    per_shard: dict[str, int]
    rounds: int


PLANS = {
    "small": Plan({"3kb": 2_000, "100kb": 300}, {"3kb": 200, "100kb": 30}, 1),
    "full": Plan({"3kb": 200_000, "100kb": 20_000}, {"3kb": 1_000, "100kb": 100}, 2),
}
KB = {"3kb": 3, "100kb": 100}
BATCH = 256
WORKERS = 2
TOOLS = [
    "fastload-packed",
    "fastload-collate",
    "fastload-bytes",
    "webdataset",
    "wids",
    "mosaicml",
    "litdata",
    "hf-datasets",
]


def _fastload() -> ModuleType:
    return import_fastload(torch=True)


Shards = IndexedShards


@pytest.fixture(scope="session")
def plan(scale: Scale) -> Plan:
    return PLANS[scale.name]


@pytest.fixture(scope="session", params=["3kb", "100kb"])
def shards(
    request: pytest.FixtureRequest, plan: Plan, tmp_path_factory: pytest.TempPathFactory
) -> Shards:
    size: str = request.param
    index = tmp_path_factory.mktemp("collate") / f"{size}.fidx"
    return indexed_shards(index, plan.samples[size], plan.per_shard[size], KB[size])


def _size_of(s: Shards) -> str:
    return "3kb" if "kb3" in s.folder.name else "100kb"


# --- loaders and what the main process does with a batch -------------------------------


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def _identity(url: str) -> str:
    return url


def _nbytes(v: Any) -> int:
    if isinstance(v, io.BytesIO):
        return v.getbuffer().nbytes
    if isinstance(v, (str, int)) or v is None:
        return 0
    return len(v)


def _loader(tool: str, s: Shards, cache: Path) -> Any:
    if _peers.is_peer(tool):
        d = _peers.peer_data(tool, s)
        warm(d.path)
        return _peers.loader(tool, d, cache, batch=BATCH, workers=WORKERS, collate_fn=_as_list)
    torch = require_module("torch")
    data = require_module("torch.utils.data")
    common: dict[str, Any] = {
        "batch_size": BATCH,
        "num_workers": WORKERS,
        "multiprocessing_context": multiprocessing.get_context("fork"),
    }
    shuffled: dict[str, Any] = {"shuffle": True, "generator": torch.Generator().manual_seed(0)}
    if tool == "webdataset":
        wds = require_module("webdataset")
        ds = wds.WebDataset(s.paths, shardshuffle=len(s.paths), empty_check=False, seed=0)
        return data.DataLoader(ds.shuffle(1000), collate_fn=_as_list, **common)
    if tool == "wids":
        wids = require_module("wids")
        desc = [{"url": p, "nsamples": c} for p, c in zip(s.paths, s.counts, strict=True)]
        ds = wids.ShardListDataset(
            desc, localname=_identity, lru_size=min(len(desc), 200), transformations=[]
        )
        return data.DataLoader(ds, collate_fn=_as_list, **shuffled, **common)
    fl = _fastload()
    if tool == "fastload-bytes":
        ds = fl.ShardIndexDataset(s.index)
        return data.DataLoader(ds, collate_fn=_as_list, **shuffled, **common)
    ds = fl.ShardIndexDataset(s.index, packed=tool == "fastload-packed")
    return data.DataLoader(ds, collate_fn=fl.collate, **shuffled, **common)


def _consume(batch: Any) -> tuple[int, int]:
    """(samples, payload bytes) of a batch, every payload page touched in this process."""
    if isinstance(batch, list):  # unpickled bytes: already copied into this process
        return len(batch), sum(
            _nbytes(v) for s in batch for k, v in s.items() if not k.startswith("__")
        )
    return len(batch), touch_packed(batch)


def _epoch(loader: Any) -> tuple[int, int]:
    n = total = 0
    for batch in loader:
        k, b = _consume(batch)
        n += k
        total += b
    return n, total


@pytest.mark.parametrize("tool", TOOLS)
def test_handover_epoch(
    benchmark: Any, tool: str, shards: Shards, plan: Plan, scale: Scale, tmp_path: Path
) -> None:
    size = _size_of(shards)
    warm(shards.folder)
    loader = _loader(tool, shards, tmp_path / "cache")
    describe(
        benchmark,
        group=f"handover-{size}",
        tool=tool,
        src=shards.source(),
        cache="warm",
        scale=scale,
        workers=WORKERS,
        batch=BATCH,
    )
    times: list[float] = []

    def timed() -> tuple[int, int]:
        t0 = time.perf_counter()
        out = _epoch(loader)
        times.append(time.perf_counter() - t0)
        return out

    n, total = benchmark.pedantic(timed, rounds=plan.rounds, iterations=1)
    assert n == shards.samples and total > 0
    best = min(times)
    benchmark.extra_info.update(
        samples_per_s=round(n / best),
        payload_gb_per_s=round(total / best / 1e9, 3),
        payload_bytes=total,
    )
    print(f"\nhandover-{size} {tool}: {n / best:,.0f} samples/s, {total / best / 1e9:.2f} GB/s")


def test_host_to_device(benchmark: Any, shards: Shards, plan: Plan, scale: Scale) -> None:
    """Pinned packed batches to the GPU: one transfer per field block."""
    torch = require_module("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU: host-to-device is measured where one is present")
    fl = _fastload()
    size = _size_of(shards)
    warm(shards.folder)
    ds = fl.ShardIndexDataset(shards.index, packed=True)
    batches = [
        ds.__getitems__(list(range(i, min(i + BATCH, len(ds))))) for i in range(0, len(ds), BATCH)
    ]
    pinned = [b.pin_memory() for b in batches]
    nbytes = sum(b.nbytes for b in pinned)

    def copy() -> int:
        for b in pinned:
            b.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        return nbytes

    describe(
        benchmark,
        group=f"h2d-{size}",
        tool="fastload-packed",
        src=shards.source(),
        cache="warm",
        scale=scale,
        batch=BATCH,
    )
    t0 = time.perf_counter()
    assert benchmark.pedantic(copy, rounds=max(plan.rounds, 3), iterations=1) == nbytes
    benchmark.extra_info["gb_per_s_first_rounds"] = round(
        nbytes * max(plan.rounds, 3) / (time.perf_counter() - t0) / 1e9, 3
    )
