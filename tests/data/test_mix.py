"""fastload.Mix over real shards written by fastload's ShardWriter: the proportions in
every batch, ``__stream__``, the exact split across 2 ranks x 3 DataLoader workers (with
padding, drop_last, batches, batch_by), exact ``len()``, per-stream batches, packed
batches, per-stream counts (``stats()``), a changed mix at resume.

Resume after a kill, and remote streams, are in test_mix_resume.py.
"""

from __future__ import annotations

import collections
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

from loader_kit import keep_list, keys_of, tag_worker  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload.data import partition  # noqa: E402
from fastload.data.mix import interleave  # noqa: E402

pytestmark = pytest.mark.native

BLOCK = 16
SETS = {"web": [40, 35, 30], "books": [25, 20], "code": [18]}  # samples per shard


def write_set(root: Path, name: str, sizes: list[int]) -> Path:
    """``sum(sizes)`` samples in shards of ``sizes[0]`` (the last may be shorter),
    written by ShardWriter; the index file."""
    total = sum(sizes)
    w = fastload.ShardWriter(root / name, max_count=sizes[0])
    for i in range(total):
        w.write({"__key__": f"{name}/{i:05d}", "bin": bytes([i % 251]) * (7 + i % 50),
                 "cls": i})  # fmt: skip
    index = w.close()
    assert index is not None
    return Path(index.path)


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    return {name: write_set(root, name, sizes) for name, sizes in SETS.items()}


def mix(sets: dict[str, Path], weights: dict[str, float] | None = None, **kw: Any) -> Any:
    weights = weights or {"web": 0.7, "books": 0.2, "code": 0.1}
    streams = [fastload.Stream(sets[n], proportion=w, name=n) for n, w in weights.items()]
    kw.setdefault("shuffle_block", BLOCK)
    kw.setdefault("seed", 4)
    kw.setdefault("samples_per_epoch", 200)
    return fastload.Mix(streams, **kw)




def test_one_epoch_proportions_and_stream_field(sets: dict[str, Path]) -> None:
    ds = mix(sets)
    assert ds.takes == {"web": 140, "books": 40, "code": 20} and len(ds) == 200
    got = list(ds)
    assert len(got) == 200
    for s in got:
        assert s["__key__"].split("/")[0] == s["__stream__"]
    streams = [s["__stream__"] for s in got]
    assert collections.Counter(streams) == {"web": 140, "books": 40, "code": 20}
    # web has 105 samples and takes 140: each read once, 35 of them twice; books takes
    # 40 of 45 and code 20 of 18 (two twice).
    web = collections.Counter(s["__key__"] for s in got if s["__stream__"] == "web")
    assert len(web) == 105 and sorted(set(web.values())) == [1, 2]
    books = [s["__key__"] for s in got if s["__stream__"] == "books"]
    assert len(set(books)) == 40
    # every window of the epoch within 1 of weight x length
    weights = {"web": 0.7, "books": 0.2, "code": 0.1}
    for size in (1, 3, 10, 17, 64):
        for lo in range(0, 200 - size + 1):
            count = collections.Counter(streams[lo : lo + size])
            for name, w in weights.items():
                assert abs(count[name] - w * size) <= 1 + 1e-9, (size, lo, name)
    # the same epoch again (new dataset, same seed); another epoch or seed differs
    assert keys_of(mix(sets)) == keys_of(got)
    assert ds.epoch == 1 and keys_of(ds) != keys_of(got)
    assert keys_of(mix(sets, seed=5)) != keys_of(got)
    # the samples are those of the stream's shards
    idx = fastload.ShardIndex.open(sets["code"])
    assert {s["__key__"] for s in got if s["__stream__"] == "code"} == set(idx.keys())


def test_equal_thirds_in_every_batch(sets: dict[str, Path]) -> None:
    ds = mix(sets, {"web": 1, "books": 1, "code": 1}, samples_per_epoch=99, batch_size=9)
    batches = list(ds)
    assert len(batches) == len(ds) == 11
    for b in batches:
        assert collections.Counter(s["__stream__"] for s in b) == {"web": 3, "books": 3,
                                                                   "code": 3}  # fmt: skip


def test_choose_and_repeat(sets: dict[str, Path]) -> None:
    ds = fastload.Mix([fastload.Stream(sets["web"], repeat=0.5, name="web"),
                       fastload.Stream(sets["code"], choose=30, name="code"),
                       fastload.Stream(sets["books"], name="books")])  # fmt: skip
    assert ds.takes == {"web": 52, "code": 30, "books": 45}
    got = collections.Counter(s["__stream__"] for s in ds)
    assert got == {"web": 52, "code": 30, "books": 45}
    with pytest.raises(ValueError, match="proportion is given for some streams only"):
        fastload.Mix([fastload.Stream(sets["web"], proportion=1),
                      fastload.Stream(sets["code"], choose=3)])  # fmt: skip
    with pytest.raises(ValueError, match="one of proportion, choose, repeat"):
        fastload.Stream(sets["web"], proportion=1, repeat=2)
    with pytest.raises(ValueError, match="stream names must differ"):
        fastload.Mix([fastload.Stream(sets["web"]), fastload.Stream(sets["web"])])
    with pytest.raises(ValueError, match="batching='per_stream' needs batch_size"):
        mix(sets, batching="per_stream")
    with pytest.raises(ValueError, match="no field 'nope'"):
        mix(sets, fields=["nope"])


def reference(sets: dict[str, Path], **kw: Any) -> list[str]:
    """The whole epoch as one reader reads it."""
    return keys_of(mix(sets, **kw))


def read_rank(ds: Any, workers: int, batched: bool) -> list[Any]:
    loader = DataLoader(ds, num_workers=workers, batch_size=None,
                        multiprocessing_context=multiprocessing.get_context("fork"),
                        collate_fn=keep_list if batched else None)  # fmt: skip
    got = list(loader)
    if ds.num_workers is not None:
        assert len(got) == len(ds) == len(loader)
    return got


# torch warns when workers outnumber the cores (CI machines have 2)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_split_two_ranks_three_workers(
    sets: dict[str, Path], monkeypatch: pytest.MonkeyPatch, drop_last: bool,
    batch_size: int | None,
) -> None:
    kw: dict[str, Any] = {"drop_last": drop_last, "batch_size": batch_size}
    whole = reference(sets, **{**kw, "batch_size": None})
    unit = batch_size or 1
    share = partition.share(200, 6, drop_last, unit)
    padded = (whole * 2)[: 6 * share]
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ds = mix(sets, transform=tag_worker, num_workers=3, **kw)
        got = read_rank(ds, 3, batch_size is not None)
        by_worker: dict[int, list[str]] = collections.defaultdict(list)
        for x in got:
            batch = x if isinstance(x, list) else [x]
            assert len({s["__worker__"] for s in batch}) == 1
            by_worker[batch[0]["__worker__"]] += [s["__key__"] for s in batch]
        for w in range(3):
            c = rank * 3 + w
            assert by_worker[w] == padded[c * share : (c + 1) * share], (rank, w)
    if drop_last:
        assert 6 * share <= 200 and (batch_size is None or share % batch_size == 0)
    else:
        assert 6 * share >= 200


def test_batch_by_bytes(sets: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    whole = reference(sets)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = mix(sets, batch_size=300, batch_by="bytes")
    batches = list(ds)
    flat = [s["__key__"] for b in batches for s in b]
    assert flat == whole[100:200]
    for b in batches:
        size = sum(len(v) for s in b for k, v in s.items() if not k.startswith("__"))
        assert size <= 300 or len(b) == 1
    with pytest.raises(TypeError, match="depends on the data"):
        len(ds)


def test_per_stream_batches(sets: dict[str, Path]) -> None:
    ds = mix(sets, batching="per_stream", batch_size=8, samples_per_epoch=400)
    # takes 280/80/40 -> 35, 10 and 5 whole batches, interleaved by the round-robin
    assert ds.takes == {"web": 280, "books": 80, "code": 40} and len(ds) == 50
    batches = list(ds)
    names = ["web", "books", "code"]
    order = [names[s] for s in interleave([35, 10, 5]).tolist()]
    assert [b[0]["__stream__"] for b in batches] == order
    for b in batches:
        assert len(b) == 8 and len({s["__stream__"] for s in b}) == 1
    # packed: one PackedBatch per batch, read straight from the stream's index
    packed = mix(sets, batching="per_stream", batch_size=8, samples_per_epoch=400,
                 collate_fn=fastload.collate)  # fmt: skip
    got = list(packed)
    assert [p.meta["__stream__"][0] for p in got] == order
    assert [k for p in got for k in p.keys] == keys_of(batches)
    first = batches[0]
    assert bytes(got[0]["bin"][3].numpy()) == bytes(first[3]["bin"])
    # with 2 readers every batch still comes whole from one stream
    two = mix(sets, batching="per_stream", batch_size=8, samples_per_epoch=400, num_workers=2)
    two_got = read_rank(two, 2, True)
    assert sorted(keys_of(two_got)) == sorted(keys_of(batches))
    assert all(len({s["__stream__"] for s in b}) == 1 for b in two_got)


def test_packed_batches_of_a_mix(sets: dict[str, Path]) -> None:
    ds = mix(sets, batch_size=10, collate_fn=fastload.collate)
    got = list(DataLoader(ds, batch_size=None, num_workers=2,
                          multiprocessing_context=multiprocessing.get_context("fork")))  # fmt: skip
    assert len(got) == 20
    for p in got:
        assert collections.Counter(p.meta["__stream__"]) == {"web": 7, "books": 2, "code": 1}
    assert sorted(k for p in got for k in p.keys) == sorted(reference(sets))


def test_stats_and_state(sets: dict[str, Path]) -> None:
    ds = mix(sets)
    it = iter(ds)
    first = [next(it) for _ in range(37)]
    want = collections.Counter(s["__stream__"] for s in first)
    assert ds.stats() == {"epoch": 0, "streams": dict(want)}
    state = ds.state_dict()
    assert state["stream_counts"] == dict(want)
    assert state["mix"] == [["web", 105, 140], ["books", 45, 40], ["code", 18, 20]]
    assert ds.stats(state)["ranks"] == {0: dict(want)}
    again = mix(sets)
    again.load_state_dict(state)
    rest = list(again)
    assert keys_of(first) + keys_of(rest) == reference(sets)
    assert again.stats()["streams"] == {"web": 140, "books": 40, "code": 20}


def test_changed_mix_at_resume(sets: dict[str, Path]) -> None:
    ds = mix(sets)
    it = iter(ds)
    first = keys_of(next(it) for _ in range(50))
    state = ds.state_dict()
    # other weights: the interrupted epoch ends on its saved plan, the new one is next
    other = {"web": 0.5, "books": 0.3, "code": 0.2}
    changed = mix(sets, other)
    changed.load_state_dict(state)
    assert first + keys_of(changed) == reference(sets)
    assert keys_of(changed) == keys_of(_at_epoch(mix(sets, other), 1))
    # interrupted again on the saved plan: its state still names that plan
    part = mix(sets, other)
    part.load_state_dict(state)
    it2 = iter(part)
    mid = keys_of(next(it2) for _ in range(30))
    rest = mix(sets, other)
    rest.load_state_dict(part.state_dict())
    assert first + mid + keys_of(rest) == reference(sets)
    # a stream added: the same
    root = sets["web"].parent.parent
    extra = write_set(root, "extra", [12])
    added = fastload.Mix([fastload.Stream(sets[n], proportion=w, name=n)
                          for n, w in {"web": 0.7, "books": 0.2, "code": 0.1}.items()]
                         + [fastload.Stream(extra, proportion=0.1, name="extra")],
                         samples_per_epoch=200, seed=4, shuffle_block=BLOCK)  # fmt: skip
    added.load_state_dict(state)
    assert first + keys_of(added) == reference(sets)
    nxt = list(added)
    assert "extra" in {s["__stream__"] for s in nxt} and len(nxt) == 200
    # a stream of the state missing: refused, saying so
    gone = mix(sets, {"web": 0.8, "books": 0.2})
    with pytest.raises(ValueError, match="stream 'code' of 18 samples is not in this mix"):
        gone.load_state_dict(state)
    with pytest.raises(ValueError, match="saved with batching"):
        mix(sets, batching="per_stream", batch_size=4).load_state_dict(state)
    with pytest.raises(ValueError, match="not of a Mix"):
        plain = fastload.ShardIterableDataset(sets["web"])
        mix(sets).load_state_dict(plain.state_dict())


def _at_epoch(ds: Any, epoch: int) -> Any:
    ds.set_epoch(epoch)
    return ds


def test_spawned_workers_read_what_forked_ones_do(sets: dict[str, Path]) -> None:
    got = {}
    for method in ("fork", "spawn"):
        ds = mix(sets, batch_size=8, num_workers=2)
        ctx = multiprocessing.get_context(method)
        loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=keep_list,
                            multiprocessing_context=ctx)  # fmt: skip
        got[method] = keys_of(loader)
    assert got["spawn"] == got["fork"] and len(got["fork"]) == 200


# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_stats_of_a_loader_state(sets: dict[str, Path]) -> None:
    sdl = require_module("torchdata.stateful_dataloader")
    ds = mix(sets, batch_size=8)
    ctx = multiprocessing.get_context("fork")
    loader = sdl.StatefulDataLoader(ds, batch_size=None, num_workers=2, collate_fn=keep_list,
                                    multiprocessing_context=ctx)  # fmt: skip
    it = iter(loader)
    read = [next(it) for _ in range(7)]
    want = collections.Counter(s["__stream__"] for b in read for s in b)
    stats = ds.stats(loader.state_dict())
    assert stats["streams"] == dict(want) and stats["ranks"] == {0: dict(want)}
    saved = loader.state_dict()
    del it
    # restored in the loader (each worker its own state): the epoch's counts in the end
    again = sdl.StatefulDataLoader(mix(sets, batch_size=8), batch_size=None, num_workers=2,
                                   collate_fn=keep_list, multiprocessing_context=ctx)  # fmt: skip
    again.load_state_dict(saved)
    rest = list(again)
    assert sum(len(b) for b in read + rest) == 200
    assert ds.stats(again.state_dict())["streams"] == ds.takes
