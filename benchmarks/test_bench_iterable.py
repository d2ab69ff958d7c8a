"""ShardIterableDataset benchmarks: a shuffled streaming epoch, fastload side by side with
webdataset, MosaicML streaming and litdata, and how each partitions an epoch among 2 ranks
x 2 workers.

Data: the webdataset-style shards of ``test_bench_index.py`` (``data.small_record_shards``:
per sample a ``.jpg`` of about 3 KB or 100 KB, a ``.cls`` and a ``.json``), read from the
page cache (each case first reads its shards once, untimed). The peers read the same
samples in their own formats (benchmarks/_peers.py: MDS for MosaicML streaming, litdata's
optimized chunks; written once from the tar shards and cached, untimed), also from the
page cache.

Groups (``size`` is 3kb or 100kb):
  stream-SIZE       one shuffled epoch through DataLoader(num_workers=2, batch_size=256),
                    each sample's payload reaching the main process:
                    fastload            ShardIterableDataset (shard order and 65,536-sample
                                        block shuffle), the DataLoader batching
                    fastload-batched    the same, batches made by the dataset (one native
                                        fetch per batch), DataLoader(batch_size=None,
                                        collate_fn=identity)
                    fastload-packed     batches made by the dataset with
                                        collate_fn=fastload.collate: each read straight
                                        into a shared-memory block (a PackedBatch), whose
                                        every page the main process touches
                    webdataset          WebDataset(shardshuffle=all shards).shuffle(1000):
                                        shard shuffle and a 1,000-sample buffer shuffle
                    mosaicml            StreamingDataset(local=MDS folder, shuffle=True,
                                        batch_size=256) in a DataLoader (py1e shuffle)
                    litdata             StreamingDataset(input_dir=..., shuffle=True) in
                                        litdata.StreamingDataLoader
  first-batch-SIZE  from building the dataset and loader to the first batch in hand
  split-SIZE        an epoch read by a world of 2 ranks x 2 workers each: two processes at
                    once, launched as torchrun launches them (RANK, WORLD_SIZE, LOCAL_RANK,
                    LOCAL_WORLD_SIZE, MASTER_ADDR/PORT) and joined in a gloo process group
                    (benchmarks/_split_rank.py), with the benchmark's data and with 7 uneven
                    shards (6.5 shards' worth of records; the peers write 7 chunks of the
                    same size); ``extra_info`` records samples per rank, duplicates, missing
                    samples and ``correct`` (every sample, equal counts per rank, no
                    duplicate beyond the one padding sample an odd count needs). fastload
                    must be exact; webdataset (split_by_node and split_by_worker over
                    shards), MosaicML streaming and litdata (their defaults; litdata-nodrop:
                    drop_last=False) are reported as they are.

Scale: full = 200,000 x 3 KB and 20,000 x 100 KB (1,000 and 100 per shard); small (CI
smoke, ``--benchmark-disable``) = a few thousand samples.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Union

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
from _peers import PeerData
from _split_rank import run_world


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
STREAM_TOOLS = [
    "fastload",
    "fastload-batched",
    "fastload-packed",
    "webdataset",
    "mosaicml",
    "litdata",
]
SPLIT_TOOLS = ["fastload", "webdataset", "mosaicml", "litdata", "litdata-nodrop"]


def _fastload() -> ModuleType:
    return import_fastload(torch=True)


def _webdataset() -> ModuleType:
    return require_module("webdataset")


Shards = IndexedShards
Data = Union[IndexedShards, PeerData]


def _shards(tmp: pytest.TempPathFactory, n: int, per: int, kb: float, name: str) -> Shards:
    return indexed_shards(tmp.mktemp(name) / "all.fidx", n, per, kb)


@pytest.fixture(scope="session")
def plan(scale: Scale) -> Plan:
    return PLANS[scale.name]


@pytest.fixture(scope="session", params=["3kb", "100kb"])
def shards(
    request: pytest.FixtureRequest, plan: Plan, tmp_path_factory: pytest.TempPathFactory
) -> Shards:
    size: str = request.param
    return _shards(tmp_path_factory, plan.samples[size], plan.per_shard[size], KB[size], size)


def _size_of(s: Shards) -> str:
    return "3kb" if "kb3" in s.folder.name else "100kb"


# --- loaders -------------------------------------------------------------------------------


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


def _payload(sample: dict[str, Any]) -> int:
    return sum(len(v) for k, v in sample.items() if not k.startswith("__"))


def _data(tool: str, s: Shards, *, per_chunk: int | None = None) -> Data:
    """What ``tool`` reads: the tar shards, or a peer's copy of them in its own format."""
    if _peers.is_peer(tool):
        return _peers.peer_data(tool, s, per_chunk=per_chunk)
    return s


def _loader(tool: str, s: Data, *, nodesplit: bool = False, cache: Path | None = None) -> Any:
    """A DataLoader over ``s``: 2 fork workers, batches of 256 lists of samples."""
    if isinstance(s, PeerData):
        cache = cache or Path(tempfile.gettempdir()) / "fastload-bench-peer-cache"
        return _peers.loader(tool, s, cache, batch=BATCH, workers=WORKERS)
    data = require_module("torch.utils.data")
    common: dict[str, Any] = {
        "num_workers": WORKERS,
        "multiprocessing_context": multiprocessing.get_context("fork"),
    }
    if tool == "webdataset":
        wds = _webdataset()
        extra = {"nodesplitter": wds.split_by_node} if nodesplit else {}
        ds = wds.WebDataset(
            s.paths, shardshuffle=len(s.paths), empty_check=False, seed=0, **extra
        ).shuffle(1000)
        return data.DataLoader(ds, batch_size=BATCH, collate_fn=_as_list, **common)
    fl = _fastload()
    if tool == "fastload-packed":
        ds = fl.ShardIterableDataset(s.index, batch_size=BATCH, collate_fn=fl.collate)
        return data.DataLoader(ds, batch_size=None, collate_fn=fl.collate, **common)
    if tool == "fastload-batched":
        ds = fl.ShardIterableDataset(s.index, batch_size=BATCH)
        # collate_fn: without one, batch_size=None runs default_convert over every sample.
        return data.DataLoader(ds, batch_size=None, collate_fn=_as_list, **common)
    ds = fl.ShardIterableDataset(s.index)
    return data.DataLoader(ds, batch_size=BATCH, collate_fn=_as_list, **common)


def _drain(loader: Any) -> tuple[list[str], int]:
    keys: list[str] = []
    total = 0
    for batch in loader:
        if isinstance(batch, list):
            for sample in batch:
                keys.append(sample["__key__"])
                total += _payload(sample)
            continue
        keys += batch.keys  # a fastload PackedBatch
        total += touch_packed(batch)
    return keys, total


# --- a shuffled epoch ------------------------------------------------------------------------


@pytest.mark.parametrize("tool", STREAM_TOOLS)
def test_stream_epoch(
    benchmark: Any, tool: str, shards: Shards, plan: Plan, scale: Scale, tmp_path: Path
) -> None:
    size = _size_of(shards)
    d = _data(tool, shards)
    warm(d.path if isinstance(d, PeerData) else shards.folder)
    loader = _loader(tool, d, cache=tmp_path / "cache")
    describe(
        benchmark,
        group=f"stream-{size}",
        tool=tool,
        src=shards.source(),
        cache="warm",
        scale=scale,
        workers=WORKERS,
        batch=BATCH,
    )
    keys, total = benchmark.pedantic(lambda: _drain(loader), rounds=plan.rounds, iterations=1)
    benchmark.extra_info.update(delivered=len(keys), unique=len(set(keys)))
    assert len(keys) == shards.samples and total > 0
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("tool", STREAM_TOOLS)
def test_first_batch(
    benchmark: Any, tool: str, shards: Shards, plan: Plan, scale: Scale, tmp_path: Path
) -> None:
    size = _size_of(shards)
    d = _data(tool, shards)  # a peer's format written (once, cached) before anything is timed
    warm(d.path if isinstance(d, PeerData) else shards.folder)
    cache = tmp_path / "cache"
    _loader(tool, d, cache=cache)  # imports done, index cached: what is timed is start-up

    def first() -> int:
        it: Iterator[Any] = iter(_loader(tool, d, cache=cache))
        n = len(next(it))
        del it  # shuts the workers down
        return n

    describe(
        benchmark,
        group=f"first-batch-{size}",
        tool=tool,
        src=Source(shards.folder, 1, 0),
        cache="warm",
        scale=scale,
        workers=WORKERS,
        batch=BATCH,
    )
    assert benchmark.pedantic(first, rounds=max(plan.rounds, 3), iterations=1) > 0


# --- partitioning among 2 ranks x 2 workers ---------------------------------------------------


def split_keys(tool: str, s: Data) -> list[str]:
    """The keys this rank reads of one epoch (run in each rank process by _split_rank)."""
    with tempfile.TemporaryDirectory(prefix="peer-cache-") as cache:
        keys, _ = _drain(_loader(tool, s, nodesplit=True, cache=Path(cache)))
    return keys


def _split_check(tool: str, s: Data, samples: int, world: int = 2) -> dict[str, Any]:
    """One epoch read by the ranks of a world of ``world`` (two processes at once, each
    with 2 fork workers): samples per rank, duplicates, missing, and whether that is the
    right split."""
    ranks = run_world("test_bench_iterable", "split_keys", (tool, s), world=world)
    per_rank = [len(k) for k in ranks]
    seen: collections.Counter[str] = collections.Counter(k for keys in ranks for k in keys)
    duplicates = sum(c - 1 for c in seen.values())
    missing = samples - len(seen)
    return {
        "per_rank": per_rank,
        "duplicates": duplicates,
        "missing": missing,
        "correct": missing == 0 and len(set(per_rank)) == 1 and duplicates == -samples % world,
    }


@pytest.fixture(scope="session")
def uneven(plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> Shards:
    """7 shards, the last one short: a shard count 4 readers cannot share evenly."""
    per = plan.per_shard["3kb"]
    return _shards(tmp_path_factory, 6 * per + per // 2, per, 3, "uneven")


@pytest.mark.parametrize("tool", SPLIT_TOOLS)
@pytest.mark.parametrize("which", ["benchmark", "7-shards"])
def test_split(
    benchmark: Any,
    tool: str,
    which: str,
    shards: Shards,
    uneven: Shards,
    plan: Plan,
    scale: Scale,
) -> None:
    s = shards if which == "benchmark" else uneven
    if which == "7-shards" and _size_of(shards) != "3kb":
        pytest.skip("the 7-shard case runs once")
    if scale.name == "small" and tool != "fastload" and (which, _size_of(s)) != ("benchmark",
                                                                                 "3kb"):
        # Each peer's split is the same code on every shape: at CI's smoke size it runs
        # once (fastload, whose split is checked, runs them all).
        pytest.skip("at the small size a peer runs the 3 KB case only")
    d = _data(tool, s, per_chunk=None if which == "benchmark" else plan.per_shard["3kb"])
    warm(d.path if isinstance(d, PeerData) else s.folder)
    name = f"split-{_size_of(s) if which == 'benchmark' else '7-shards'}"
    describe(
        benchmark,
        group=name,
        tool=tool,
        src=s.source(),
        cache="warm",
        scale=scale,
        world=2,
        workers=WORKERS,
    )
    result: dict[str, Any] = benchmark.pedantic(
        _split_check, args=(tool, d, s.samples), rounds=1, iterations=1
    )
    if isinstance(d, PeerData):
        result["chunks"] = d.chunks
    benchmark.extra_info.update(result)
    print(f"\n{name} {tool}: {result}")
    if tool.startswith("fastload"):
        # Padded like DistributedSampler: an odd count repeats one sample.
        assert result["per_rank"] == [-(-s.samples // 2)] * 2
        assert result["missing"] == 0 and result["duplicates"] == s.samples % 2
