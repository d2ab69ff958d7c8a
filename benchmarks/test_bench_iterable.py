"""ShardIterableDataset benchmarks: a shuffled streaming epoch, fastload side by side with
webdataset, and how each partitions an epoch among 2 ranks x 2 workers.

Data: the webdataset-style shards of ``test_bench_index.py`` (``data.small_record_shards``:
per sample a ``.jpg`` of about 3 KB or 100 KB, a ``.cls`` and a ``.json``), read from the
page cache (each case first reads its shards once, untimed).

Groups (``size`` is 3kb or 100kb):
  stream-SIZE       one shuffled epoch through DataLoader(num_workers=2, batch_size=256),
                    each sample's payload reaching the main process:
                    fastload            ShardIterableDataset (shard order and 65,536-sample
                                        block shuffle), the DataLoader batching
                    fastload-batched    the same, batches made by the dataset (one native
                                        fetch per batch), DataLoader(batch_size=None,
                                        collate_fn=identity)
                    webdataset          WebDataset(shardshuffle=all shards).shuffle(1000):
                                        shard shuffle and a 1,000-sample buffer shuffle
  first-batch-SIZE  from building the dataset and loader to the first batch in hand
  split-SIZE        an epoch read by 2 ranks (RANK/WORLD_SIZE, one after the other) x 2
                    workers each, with the benchmark's shards and with 7 uneven shards of
                    the same records; ``extra_info`` records samples per rank, duplicates
                    and missing samples. fastload must be exact; webdataset (split_by_node
                    and split_by_worker over shards) is reported as it is.

MosaicML streaming and litdata are not run: their packages pull their own torch build
(CUDA) and would replace the CPU build this project tests with.

Scale: full = 200,000 x 3 KB and 20,000 x 100 KB (1,000 and 100 per shard); small (CI
smoke, ``--benchmark-disable``) = a few thousand samples.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from _harness import IndexedShards, Scale, Source, describe, import_fastload, indexed_shards, warm


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
STREAM_TOOLS = ["fastload", "fastload-batched", "webdataset"]


def _fastload() -> ModuleType:
    return import_fastload(torch=True)


def _webdataset() -> ModuleType:
    return pytest.importorskip("webdataset")


Shards = IndexedShards


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


def _loader(tool: str, s: Shards, *, nodesplit: bool = False) -> Any:
    """A DataLoader over ``s``: 2 fork workers, batches of 256 lists of samples."""
    data = pytest.importorskip("torch.utils.data")
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
        for sample in batch:
            keys.append(sample["__key__"])
            total += _payload(sample)
    return keys, total


# --- a shuffled epoch ------------------------------------------------------------------------


@pytest.mark.parametrize("tool", STREAM_TOOLS)
def test_stream_epoch(benchmark: Any, tool: str, shards: Shards, plan: Plan, scale: Scale) -> None:
    size = _size_of(shards)
    warm(shards.folder)
    loader = _loader(tool, shards)
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
    assert len(keys) == shards.samples and total > 0
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("tool", STREAM_TOOLS)
def test_first_batch(benchmark: Any, tool: str, shards: Shards, plan: Plan, scale: Scale) -> None:
    size = _size_of(shards)
    warm(shards.folder)
    _loader(tool, shards)  # imports done, index cached: what is timed is start-up

    def first() -> int:
        it: Iterator[Any] = iter(_loader(tool, shards))
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


def _split_check(tool: str, s: Shards) -> dict[str, Any]:
    """One epoch read by rank 0 then rank 1 of a world of 2 (RANK/WORLD_SIZE; the fork
    workers inherit them): samples per rank, duplicates, missing."""
    per_rank: list[int] = []
    seen: collections.Counter[str] = collections.Counter()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    try:
        for rank in range(2):
            os.environ.update(RANK=str(rank), WORLD_SIZE="2")
            keys, _ = _drain(_loader(tool, s, nodesplit=True))
            per_rank.append(len(keys))
            seen.update(keys)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {
        "per_rank": per_rank,
        "duplicates": sum(c - 1 for c in seen.values()),
        "missing": s.samples - len(seen),
    }


@pytest.fixture(scope="session")
def uneven(plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> Shards:
    """7 shards, the last one short: a shard count 4 readers cannot share evenly."""
    per = plan.per_shard["3kb"]
    return _shards(tmp_path_factory, 6 * per + per // 2, per, 3, "uneven")


@pytest.mark.parametrize("tool", ["fastload", "webdataset"])
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
    warm(s.folder)
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
        _split_check, args=(tool, s), rounds=1, iterations=1
    )
    benchmark.extra_info.update(result)
    print(f"\n{name} {tool}: {result}")
    if tool.startswith("fastload"):
        # Padded like DistributedSampler: an odd count repeats one sample.
        assert result["per_rank"] == [-(-s.samples // 2)] * 2
        assert result["missing"] == 0 and result["duplicates"] == s.samples % 2
