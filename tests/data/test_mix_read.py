"""How a Mix reads its plan: every sample, batch or single, is the one its position of
the plan names (stream and sample, in the plan's order), with ``__stream__`` set, whether
a read holds samples of one stream (fetched as is) or of several (fetched stream by
stream and put back in order). Real shards written by ShardWriter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import fastload

pytestmark = pytest.mark.native

SETS = {"web": 90, "books": 40, "code": 13}  # samples, in shards of 10


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixread")
    out = {}
    for name, total in SETS.items():
        w = fastload.ShardWriter(root / name, max_count=10)
        for i in range(total):
            w.write({"__key__": f"{name}/{i:04d}", "bin": bytes([i % 251]) * (3 + i % 20)})
        index = w.close()
        assert index is not None
        out[name] = Path(index.path)
    return out


def make(sets: dict[str, Path], weights: dict[str, float], **kw: Any) -> Any:
    streams = [fastload.Stream(sets[n], proportion=w, name=n) for n, w in weights.items()]
    return fastload.Mix(streams, samples_per_epoch=120, shuffle_block=8, seed=3, **kw)


def expected(ds: Any) -> list[tuple[str, str]]:
    """(stream, key) at each position of the next epoch (ask before reading it), from
    the plan and the streams' indexes alone."""
    plan = ds.plan()
    keys = {n: ds.stream_index(n).keys() for n in ds.names}
    ids = np.concatenate(list(plan.take([(0, plan.n)], 1 << 12)))
    which = np.searchsorted(plan.offsets, ids, side="right") - 1
    return [(ds.names[s], keys[ds.names[s]][i - plan.offsets[s]])
            for s, i in zip(which.tolist(), ids.tolist(), strict=True)]  # fmt: skip


def got(items: list[Any]) -> list[tuple[str, str]]:
    return [(s["__stream__"], s["__key__"]) for s in items]


def keep(batch: list[Any]) -> list[Any]:
    return batch


@pytest.mark.parametrize("batch_size", [None, 1, 2, 7, 64])
def test_reads_what_the_plan_names(sets: dict[str, Path], batch_size: int | None) -> None:
    ds = make(sets, {"web": 0.6, "books": 0.3, "code": 0.1}, batch_size=batch_size,
              collate_fn=None if batch_size is None else keep)  # fmt: skip
    want = expected(ds)
    assert {s for s, _ in want} == set(SETS)  # every stream is read
    out = list(ds)
    samples = out if batch_size is None else [s for b in out for s in b]
    if batch_size is not None:
        assert [len(b) for b in out[:-1]] == [batch_size] * (len(out) - 1)
    assert got(samples) == want
    for s in samples:
        assert int(s["__key__"].split("/")[1]) < SETS[s["__stream__"]]
        assert bytes(s["bin"])[:1] == bytes([int(s["__key__"].split("/")[1]) % 251])


def test_batches_of_one_stream_and_of_several(sets: dict[str, Path]) -> None:
    """With one stream taking nothing, batches of 2 at 50/50 alternate streams within a
    batch; a single stream makes every batch one stream's."""
    two = make(sets, {"web": 0.5, "books": 0.5}, batch_size=2, collate_fn=keep)
    want = expected(two)
    batches = list(two)
    assert all({s["__stream__"] for s in b} == {"web", "books"} for b in batches)
    assert got([s for b in batches for s in b]) == want
    alone = make(sets, {"code": 1.0}, batch_size=5, collate_fn=keep)
    want = expected(alone)
    batches = list(alone)
    assert len(batches) == 24 and all(s["__stream__"] == "code" for b in batches for s in b)
    assert got([s for b in batches for s in b]) == want
    # 120 samples of a 13-sample stream: its order read again from its start, unchanged.
    keys = [s["__key__"] for b in batches for s in b]
    assert keys[13:26] == keys[:13] and sorted(keys[:13]) == [f"code/{i:04d}" for i in range(13)]


def test_read_of_no_ids_and_of_a_mixed_chunk(sets: dict[str, Path]) -> None:
    ds = make(sets, {"web": 0.7, "books": 0.2, "code": 0.1})
    read = ds._read_fn()
    assert read(np.empty(0, dtype=np.int64)) == []
    offsets = ds.plan().offsets
    # Ids of three streams, out of stream order: each sample comes back at its place.
    ids = np.array([offsets[2] + 4, 5, offsets[1] + 39, 0, offsets[2], offsets[1]])
    assert got(read(ids)) == [("code", "code/0004"), ("web", "web/0005"),
                              ("books", "books/0039"), ("web", "web/0000"),
                              ("code", "code/0000"), ("books", "books/0000")]  # fmt: skip
