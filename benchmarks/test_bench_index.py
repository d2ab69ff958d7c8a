"""Shard index and ShardIndexDataset benchmarks, fastload side by side with the peers.

Data: webdataset-style shards (per sample a ``.jpg`` of about 3 KB or 100 KB, a ``.cls``
and a ``.json``) from ``data.small_record_shards``, read from the page cache (each case
first reads its shards once, untimed, so no tool pays for a cold cache).
Peers run in the same parametrisation, each reading the same samples in its preferred
format: wids (``ShardListDataset``, opening the tar shards in place), for the streaming
epoch webdataset (the tar shards), and MosaicML streaming (MDS), litdata (its optimized
chunks) and Hugging Face ``datasets`` (Arrow), each written once from the tar shards and
cached (benchmarks/_peers.py; untimed), read in place from the page cache. A peer that is
not installed is skipped (scripts/bench-peers.sh sets up a venv with all of them).

Groups (``size`` is 3kb or 100kb):
  random-SIZE       N random indices, one process: fastload ``ds[i]`` (mmap, mmap+copy,
                    read) and ``__getitems__`` in batches of 256, wids ``ds[i]``,
                    MosaicML ``StreamingDataset(local=...)[i]`` (mosaicml) and
                    ``LocalDataset[i]`` (mosaicml-local), litdata ``StreamingDataset[i]``,
                    HF ``load_from_disk(...)[i]`` (hf-datasets) and ``__getitems__`` in
                    batches of 256 (hf-datasets-batched)
  epoch-SIZE        a shuffled epoch through DataLoader(num_workers=2, batch_size=256):
                    fastload (map-style, batched fetch, samples as dicts pickled through
                    the workers' pipes like every peer's; fastload-packed: packed=True +
                    fastload.collate, each batch in a shared-memory block, every page of it
                    touched in the main process), wids (map-style), webdataset
                    (iterable: shard shuffle plus a 1,000-sample shuffle buffer), MosaicML
                    streaming (iterable, its py1e shuffle), litdata (iterable, in its
                    StreamingDataLoader), HF datasets (map-style, batched fetch)
  build-SIZE        index build from scratch: fastload (C++, headers only, threads) and
                    wids (its per-shard Python index, the work it does on first access)
  first-sample      constructing the dataset and reading its first sample, 1,000 shards
                    (fastload from its index file; wids from its shard list)

Scale: full = 200,000 x 3 KB and 20,000 x 100 KB, 50,000 random indices, 1,000 shards for
first-sample; small (CI smoke, ``--benchmark-disable``) = a few thousand samples.
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing
import random
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

import _peers
from _guard import require_module
from _harness import (
    IndexedShards,
    Scale,
    Source,
    describe,
    import_fastload,
    indexed_shards,
    touch_packed,
    warm,
)


@dataclasses.dataclass(frozen=True)
class Plan:
    samples: dict[str, int]  # per size: samples
    per_shard: dict[str, int]  # per size: samples per shard
    random_reads: int
    first_shards: int
    first_per_shard: int
    rounds: int


PLANS = {
    "small": Plan({"3kb": 2_000, "100kb": 300}, {"3kb": 200, "100kb": 30}, 2_000, 100, 5, 1),
    "full": Plan(
        {"3kb": 200_000, "100kb": 20_000}, {"3kb": 1_000, "100kb": 100}, 50_000, 1_000, 20, 2
    ),
}
KB = {"3kb": 3, "100kb": 100}
BATCH = 256
WORKERS = 2


def _fastload() -> ModuleType:
    return import_fastload(torch=False)


def _torch_data() -> ModuleType:
    return require_module("torch.utils.data")


def _wids() -> ModuleType:
    return require_module("wids")


Shards = IndexedShards


def _make_shards(
    tmp: pytest.TempPathFactory, size: str, n: int, per: int, kb: float, name: str
) -> Shards:
    return indexed_shards(tmp.mktemp(name) / f"{size}.fidx", n, per, kb)


@pytest.fixture(scope="session")
def plan(scale: Scale) -> Plan:
    return PLANS[scale.name]


@pytest.fixture(scope="session", params=["3kb", "100kb"])
def shards(
    request: pytest.FixtureRequest, plan: Plan, tmp_path_factory: pytest.TempPathFactory
) -> Shards:
    size: str = request.param
    return _make_shards(
        tmp_path_factory, size, plan.samples[size], plan.per_shard[size], KB[size], "idx"
    )


@pytest.fixture(scope="session")
def many_shards(plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> Shards:
    n = plan.first_shards * plan.first_per_shard
    return _make_shards(tmp_path_factory, "many", n, plan.first_per_shard, 3, "many")


def _size_of(s: Shards) -> str:
    return "3kb" if "kb3" in s.folder.name else "100kb"


# --- consumers --------------------------------------------------------------------------


def _nbytes(v: Any) -> int:
    if isinstance(v, io.BytesIO):
        return v.getbuffer().nbytes
    if isinstance(v, (str, int)) or v is None:
        return 0
    return len(v)


def _sample_bytes(sample: dict[str, Any]) -> int:
    return sum(_nbytes(v) for k, v in sample.items() if not k.startswith("__"))


def _as_list(batch: list[Any]) -> list[Any]:
    """collate_fn: keep the batch (payloads need no tensor conversion to be counted)."""
    return batch


def _wids_dataset(s: Shards) -> Any:
    wids = _wids()
    desc = [{"url": p, "nsamples": c} for p, c in zip(s.paths, s.counts, strict=True)]
    # Shards opened in place (no copy into wids' cache folder), and an LRU holding every
    # shard (wids' default of 10 re-indexes shards over and over under random access).
    return wids.ShardListDataset(
        desc, localname=_identity, lru_size=min(len(desc), 200), transformations=[]
    )


def _identity(url: str) -> str:
    return url


# --- random access ----------------------------------------------------------------------

RANDOM_TOOLS = [
    "fastload-mmap",
    "fastload-mmap-copy",
    "fastload-read",
    "fastload-batched",
    "wids",
    "mosaicml",
    "mosaicml-local",
    "litdata",
    "hf-datasets",
    "hf-datasets-batched",
]


def _random_reader(tool: str, s: Shards, cache: Path) -> Callable[[list[int]], int]:
    if _peers.is_peer(tool):
        d = _peers.peer_data(tool, s)
        warm(d.path)
        return _reader(_peers.random_dataset(tool, d, cache), tool == "hf-datasets-batched")
    if tool == "wids":
        return _reader(_wids_dataset(s), batched=False)
    fl = _fastload()
    _torch_data()
    copy = tool == "fastload-mmap-copy"
    access = "read" if tool == "fastload-read" else "mmap"
    ds = fl.ShardIndexDataset(s.index, copy=copy, access=access)
    return _reader(ds, tool == "fastload-batched")


def _reader(ds: Any, batched: bool) -> Callable[[list[int]], int]:
    """Reads the samples at ``indices`` from ``ds`` (``__getitems__`` in batches of BATCH
    when ``batched``, else ``ds[i]`` one by one) and returns their total size."""
    if batched:

        def run_batched(indices: list[int]) -> int:
            total = 0
            for at in range(0, len(indices), BATCH):
                for sample in ds.__getitems__(indices[at : at + BATCH]):
                    total += _sample_bytes(sample)
            return total

        return run_batched

    def run(indices: list[int]) -> int:
        return sum(_sample_bytes(ds[i]) for i in indices)

    return run


@pytest.mark.parametrize("tool", RANDOM_TOOLS)
def test_random_access(
    benchmark: Any, tool: str, shards: Shards, plan: Plan, scale: Scale, tmp_path: Path
) -> None:
    size = _size_of(shards)
    n = min(plan.random_reads, shards.samples * 10)
    indices = [random.Random(42).randrange(shards.samples) for _ in range(n)]
    warm(shards.folder)  # every tool reads from the page cache, the first one included
    read = _random_reader(tool, shards, tmp_path / "cache")
    read(indices[:10])  # open what the tool opens lazily; steady state is what we time
    src = Source(shards.folder, n, 0)
    describe(
        benchmark, group=f"random-{size}", tool=tool, src=src, cache="warm", scale=scale, samples=n
    )
    total = benchmark.pedantic(read, args=(indices,), rounds=plan.rounds, iterations=1)
    assert total > 0
    benchmark.extra_info["bytes"] = total


# --- a shuffled epoch through a DataLoader ------------------------------------------------

EPOCH_TOOLS = [
    "fastload",
    "fastload-read",
    "fastload-packed",
    "wids",
    "webdataset",
    "mosaicml",
    "litdata",
    "hf-datasets",
]


def _epoch_loader(tool: str, s: Shards, cache: Path) -> Any:
    if _peers.is_peer(tool):
        d = _peers.peer_data(tool, s)
        warm(d.path)
        return _peers.loader(tool, d, cache, batch=BATCH, workers=WORKERS)
    data = _torch_data()
    torch = require_module("torch")
    ctx = multiprocessing.get_context("fork")
    common: dict[str, Any] = {
        "batch_size": BATCH,
        "num_workers": WORKERS,
        "collate_fn": _as_list,
        "multiprocessing_context": ctx,
    }
    if tool == "webdataset":
        wds = require_module("webdataset")
        ds = wds.WebDataset(s.paths, shardshuffle=len(s.paths), empty_check=False).shuffle(1000)
        return data.DataLoader(ds, **common)
    if tool == "wids":
        ds = _wids_dataset(s)
    else:
        fl = _fastload()
        if tool == "fastload-packed":  # batches read into shared memory, see issue 8
            ds = fl.ShardIndexDataset(s.index, packed=True)
            common["collate_fn"] = fl.collate
        else:
            access = "read" if tool == "fastload-read" else "mmap"
            ds = fl.ShardIndexDataset(s.index, access=access)
    return data.DataLoader(ds, shuffle=True, generator=torch.Generator().manual_seed(0), **common)


@pytest.mark.parametrize("tool", EPOCH_TOOLS)
def test_epoch(
    benchmark: Any, tool: str, shards: Shards, plan: Plan, scale: Scale, tmp_path: Path
) -> None:
    size = _size_of(shards)
    warm(shards.folder)
    loader = _epoch_loader(tool, shards, tmp_path / "cache")

    def epoch() -> tuple[int, int]:
        n = total = 0
        for batch in loader:
            n += len(batch)
            if isinstance(batch, list):
                total += sum(_sample_bytes(s) for s in batch)
                continue
            total += touch_packed(batch)
        return n, total

    describe(
        benchmark,
        group=f"epoch-{size}",
        tool=tool,
        src=shards.source(),
        cache="warm",
        scale=scale,
        workers=WORKERS,
        batch=BATCH,
    )
    n, total = benchmark.pedantic(epoch, rounds=1, iterations=1)
    assert n == shards.samples and total > 0


# --- index build ---------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["fastload", "fastload-1thread", "wids"])
def test_index_build(
    benchmark: Any, tool: str, shards: Shards, plan: Plan, scale: Scale, tmp_path: Path
) -> None:
    size = _size_of(shards)
    warm(shards.folder)
    if tool == "wids":
        wids = _wids()

        def build() -> int:
            n = 0
            for p in shards.paths:
                t = wids.wids.IndexedTarSamples(path=p)
                n += len(t)
                t.close()
            return n
    else:
        fl = _fastload()
        threads = 1 if tool == "fastload-1thread" else None

        def build() -> int:
            return len(fl.ShardIndex.build(shards.paths, tmp_path / "b.fidx", threads=threads))

    describe(
        benchmark,
        group=f"build-{size}",
        tool=tool,
        src=shards.source(),
        cache="warm",
        scale=scale,
        shards=len(shards.paths),
    )
    assert benchmark.pedantic(build, rounds=plan.rounds, iterations=1) == shards.samples


# --- first sample with many shards ------------------------------------------------------------


@pytest.mark.parametrize("tool", ["fastload", "fastload-read", "wids"])
def test_first_sample(
    benchmark: Any, tool: str, many_shards: Shards, plan: Plan, scale: Scale
) -> None:
    s = many_shards
    warm(s.folder)
    if tool == "wids":
        _wids()

        def first() -> int:
            return _sample_bytes(_wids_dataset(s)[0])
    else:
        fl = _fastload()
        _torch_data()
        access = "read" if tool == "fastload-read" else "mmap"

        def first() -> int:
            return _sample_bytes(fl.ShardIndexDataset(s.index, access=access)[0])

    describe(
        benchmark,
        group="first-sample",
        tool=tool,
        src=Source(s.folder, 1, 0),
        cache="warm",
        scale=scale,
        shards=len(s.paths),
    )
    assert benchmark.pedantic(first, rounds=max(plan.rounds, 5), iterations=1) > 0
