"""ShardIterableDataset over real shards: every DataLoader worker of every rank reads the
same number of samples (and batches), together the epoch (padded or with the remainder
dropped) across ranks and workers (fork, spawn, persistent; torch.distributed with gloo,
2 processes x 2 workers), the exact order the pure functions promise, exact lengths,
resume in a new process (same and other worker counts, other world size).

Child processes run this file (``python test_iterable.py MODE JSON``): the gloo ranks,
and the save and resume halves of an interrupted epoch.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import pickle
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kit.tools import missing, require_module

torch = require_module("torch")

from loader_kit import keep_list, keys_of, tag_worker  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload import ShardIndex  # noqa: E402
from fastload.data import partition  # noqa: E402
from fastload.data.shuffle import EpochOrder  # noqa: E402
from kit.procs import rendezvous, run_script  # noqa: E402
from kit.shards import Sample, make_samples, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native

HERE = Path(__file__).resolve()
SIZES = {"4 shards": [31, 40, 25, 37], "7 shards": [9, 23, 17, 30, 5, 26, 11]}
BLOCK = 16  # small blocks, so the tests see several of them


def build(root: Path, sizes: Sequence[int]) -> tuple[Path, list[Sample]]:
    samples: list[Sample] = []
    paths = []
    for s, n in enumerate(sizes):
        part = make_samples(n, seed=10 + s, prefix=f"s{s}/")
        samples += part
        paths.append(write_tarfile(root / f"shard-{s}.tar", part, "pax"))
    ShardIndex.build(paths, root / "all.fidx")
    return root / "all.fidx", samples


@pytest.fixture(scope="module", params=list(SIZES))
def data(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, list[Sample]]:
    return build(tmp_path_factory.mktemp("it"), SIZES[request.param])


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    return build(tmp_path_factory.mktemp("four"), SIZES["4 shards"])




def per_worker(items: Iterable[Any]) -> dict[int, list[int]]:
    """Per worker (from ``tag_worker``), the sizes of the batches (lists) it yielded, or
    1 per single sample."""
    out: dict[int, list[int]] = collections.defaultdict(list)
    for x in items:
        batch = x if isinstance(x, list) else [x]
        workers = {s["__worker__"] for s in batch}
        assert len(workers) == 1
        out[workers.pop()].append(len(batch))
    return dict(out)


def as_bytes(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if k == "__key__" else bytes(v)) for k, v in sample.items()}


def expected(index: Path, *, epoch: int = 0, seed: int = 0, world_size: int = 1, rank: int = 0,
             workers: int = 1, worker: int = 0, drop_last: bool = False, unit: int = 1,
             shuffle: bool = True) -> list[str]:
    """The keys one reader reads, from the pure functions alone."""
    idx = ShardIndex.open(index)
    order = EpochOrder([s.samples for s in idx.shards], seed=seed, epoch=epoch, shuffle=shuffle,
                       block=BLOCK)
    iv = partition.assign(len(idx), world_size=world_size, rank=rank, num_workers=workers,
                          worker_id=worker, drop_last=drop_last, unit=unit)
    keys = idx.keys()
    return [keys[i] for piece in order.take(iv) for i in piece.tolist()]


def round_robin(streams: Sequence[list[str]], batch: int) -> list[str]:
    """What an in-order DataLoader with one worker per stream yields, batching each
    worker's stream by ``batch``."""
    chunks = [[s[i : i + batch] for i in range(0, len(s), batch)] for s in streams]
    out: list[str] = []
    for j in range(max(len(c) for c in chunks)):
        for c in chunks:
            if j < len(c):
                out += c[j]
    return out


def make(index: Path, **kwargs: Any) -> Any:
    kwargs.setdefault("shuffle_block", BLOCK)
    return fastload.ShardIterableDataset(index, **kwargs)


# --- one process ---------------------------------------------------------------------------


def test_one_epoch(data: tuple[Path, list[Sample]]) -> None:
    index, samples = data
    ds = make(index, transform=as_bytes, seed=5)
    got = list(ds)
    assert len(ds) == len(samples) == len(got)
    assert sorted(keys_of(got)) == sorted(k for k, _ in samples)
    assert keys_of(got) == expected(index, seed=5)
    assert {s["__key__"]: s for s in got} == {k: {"__key__": k, **f} for k, f in samples}
    # The next iteration is the next epoch; set_epoch goes back; same seed, same order.
    assert ds.epoch == 1
    assert keys_of(ds) == expected(index, seed=5, epoch=1) != keys_of(got)
    ds.set_epoch(0)
    assert keys_of(ds) == keys_of(got) == keys_of(make(index, seed=5))
    assert keys_of(make(index, shuffle=False)) == [k for k, _ in samples]


def test_fields_access_and_repr(four: tuple[Path, list[Sample]]) -> None:
    index, samples = four
    byk = dict(samples)
    for access in ("mmap", "read"):
        ds = make(index, fields=["cls"], access=access, copy=True)
        for s in ds:
            assert set(s) == {"__key__", "cls"} and s["cls"] == byk[s["__key__"]]["cls"]
    assert "133 samples" in repr(ds)
    assert fastload.ShardIterableDataset is fastload.data.ShardIterableDataset
    with pytest.raises(ValueError, match="no field 'png'"):
        make(index, fields=["png"])
    for bad, message in [
        ({"seed": -1}, "seed"), ({"shuffle_block": 0}, "shuffle_block"),
        ({"batch_size": 0}, "batch_size"), ({"batch_by": "bytes"}, "needs batch_size"),
        ({"batch_size": 4, "batch_by": "tokens"}, "batch_by"),
        ({"collate_fn": keep_list}, "collate_fn needs batch_size"), ({"access": "x"}, "access"),
    ]:
        with pytest.raises(ValueError, match=message):
            make(index, **bad)


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_from_the_environment(
    data: tuple[Path, list[Sample]], drop_last: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    index, samples = data
    n, size = len(samples), 3
    got = []
    for rank in range(size):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(size))
        ds = make(index, drop_last=drop_last, seed=1)
        keys = keys_of(ds)
        assert len(keys) == len(ds) == partition.share(n, size, drop_last)
        assert keys == expected(index, seed=1, world_size=size, rank=rank, drop_last=drop_last)
        got += keys
    count = collections.Counter(got)
    if drop_last:
        assert max(count.values()) == 1 and len(count) == n - n % size
    else:
        assert set(count) == {k for k, _ in samples} and len(got) - n == (-n) % size


def test_batches(data: tuple[Path, list[Sample]]) -> None:
    index, samples = data
    ds = make(index, batch_size=16, seed=2)
    batches = list(ds)
    assert len(batches) == len(ds) == -(-len(samples) // 16)
    assert [len(b) for b in batches[:-1]] == [16] * (len(batches) - 1)
    assert keys_of(batches) == expected(index, seed=2)
    counted = make(index, batch_size=16, seed=2, collate_fn=len)
    assert list(counted) == [len(b) for b in batches]
    # Through two workers: each reads ceil(n / 2) samples in batches of 16, the last
    # short by as much in both; told the worker count, the loader's length is exact.
    two = make(index, batch_size=16, seed=2, num_workers=2)
    loader = DataLoader(two, batch_size=None, num_workers=2,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    through = list(loader)
    each = -(-len(samples) // 2)
    assert len(through) == len(loader) == len(two) == 2 * -(-each // 16)
    assert len(keys_of(through)) == 2 * each
    assert set(keys_of(through)) == {k for k, _ in samples}
    streams = [expected(index, seed=2, workers=2, worker=w, unit=16) for w in range(2)]
    assert len(streams[0]) == len(streams[1]) == each
    assert keys_of(through) == round_robin(streams, 16)


def test_batch_by_size(four: tuple[Path, list[Sample]]) -> None:
    index, samples = four
    size = {k: sum(len(v) for v in f.values()) for k, f in samples}
    stream = expected(index, seed=4)
    limit = 6000
    batches = list(make(index, seed=4, batch_size=limit, batch_by="bytes"))
    assert keys_of(batches) == stream
    for b in batches:
        total = sum(size[s["__key__"]] for s in b)
        assert total <= limit or len(b) == 1
    # A full batch could not take its next sample.
    flat = keys_of(batches)
    at = 0
    for b in batches[:-1]:
        at += len(b)
        assert sum(size[s["__key__"]] for s in b) + size[flat[at]] > limit
    ds = make(index, seed=4, batch_size=3000, batch_by=lambda s: len(s["jpg"]),
              transform=as_bytes, collate_fn=tuple)
    tokens = list(ds)
    assert all(isinstance(b, tuple) for b in tokens)
    assert all(sum(len(s["jpg"]) for s in b) <= 3000 or len(b) == 1 for b in tokens)
    assert [s["__key__"] for b in tokens for s in b] == stream
    with pytest.raises(TypeError, match="batch_by"):
        len(ds)


def test_dataloader_workers(data: tuple[Path, list[Sample]]) -> None:
    check_workers(*data, "fork")


def test_dataloader_workers_spawn(four: tuple[Path, list[Sample]]) -> None:
    check_workers(*four, "spawn")  # spawned workers are slow to start: one data set


def check_workers(index: Path, samples: list[Sample], start: str) -> None:
    ds = make(index, seed=7, fields=["cls"])
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=keep_list,
                        multiprocessing_context=multiprocessing.get_context(start))
    got = keys_of(loader)
    n = len(samples)
    assert len(got) == 2 * -(-n // 2)  # 2 workers, equal: padded to even
    assert set(got) == {k for k, _ in samples} and len(got) - len(set(got)) == n % 2
    streams = [expected(index, seed=7, workers=2, worker=w) for w in range(2)]
    assert got == round_robin(streams, 8)


# More workers than this machine's cores is fine for a test.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [None, 8])
def test_workers_read_equal_shares(
    data: tuple[Path, list[Sample]], drop_last: bool, batch_size: int | None
) -> None:
    """3 workers: the same number of samples each, and of batches; all batches full
    with drop_last; len(ds) and len(loader) are exactly what comes out."""
    index, samples = data
    n, workers = len(samples), 3
    ds = make(index, seed=11, fields=["cls"], transform=tag_worker, drop_last=drop_last,
              batch_size=batch_size, num_workers=workers)
    loader = DataLoader(ds, batch_size=None, num_workers=workers, collate_fn=keep_list,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    got = list(loader)
    sizes = per_worker(got)
    assert sorted(sizes) == list(range(workers))
    unit = batch_size or 1
    each = partition.share(n, workers, drop_last, unit)
    assert [sum(s) for s in sizes.values()] == [each] * workers
    assert len({tuple(s) for s in sizes.values()}) == 1  # the same batches, short one too
    if drop_last:
        assert all(b == unit for s in sizes.values() for b in s)
        assert 0 <= n - workers * each < workers * unit
    assert len(got) == len(loader) == len(ds) == workers * -(-each // unit)
    keys = collections.Counter(keys_of(got))
    if drop_last:
        assert max(keys.values()) == 1
    else:
        assert set(keys) == {k for k, _ in samples}
        assert sum(keys.values()) - n == (-n) % workers


# More workers than this machine's cores is fine for a test.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_worker_count_is_checked(four: tuple[Path, list[Sample]]) -> None:
    """A dataset told the DataLoader's worker count refuses another one, rather than
    yield an epoch of another length than len(ds) said."""
    index, samples = four
    ds = make(index, num_workers=2)
    assert len(ds) == 2 * partition.share(len(samples), 2, False)
    assert len(make(index, num_workers=0)) == len(make(index)) == len(samples)
    assert len(make(index, num_workers=3, drop_last=True, batch_size=10)) == 3 * 4
    with pytest.raises(ValueError, match=r"num_workers=2.*in the main process"):
        list(ds)
    loader = DataLoader(ds, batch_size=None, num_workers=3,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    with pytest.raises(ValueError, match=r"num_workers=2.*by 3 DataLoader workers"):
        list(loader)
    assert keys_of(make(index, num_workers=0)) == expected(index)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_workers"):
            make(index, num_workers=bad)


def test_persistent_workers_count_epochs(four: tuple[Path, list[Sample]]) -> None:
    index, _ = four
    ds = make(index, seed=3)
    loader = DataLoader(ds, batch_size=10, num_workers=2, collate_fn=keep_list,
                        persistent_workers=True,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    for epoch in range(3):
        streams = [expected(index, seed=3, epoch=epoch, workers=2, worker=w) for w in range(2)]
        assert keys_of(loader) == round_robin(streams, 10)


# --- torch.distributed ---------------------------------------------------------------------


def run_children(mode: str, args: Sequence[dict[str, Any]], timeout: float = 180,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
    run_script(HERE, mode, args, timeout, env)


def gloo_rank(args: dict[str, Any]) -> None:
    """One rank: a gloo process group, then an epoch of each data set through a
    DataLoader with 2 fork workers."""
    import faulthandler

    import torch.distributed as dist

    # Where a rank stands if it hangs: its threads' stacks, printed before the test's
    # timeout kills it.
    faulthandler.dump_traceback_later(150, exit=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}",
                            rank=args["rank"], world_size=2)
    try:
        out = {}
        for name, index in args["indexes"].items():
            for drop_last in (False, True):
                ds = fastload.ShardIterableDataset(index, drop_last=drop_last, fields=["cls"],
                                                   transform=tag_worker, num_workers=2)
                assert ds._reader().source == "dist"
                loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=keep_list,
                                    multiprocessing_context=multiprocessing.get_context("fork"))
                got = list(loader)
                keys = keys_of(got)
                workers = {w: sum(s) for w, s in per_worker(got).items()}
                lengths: list[Any] = [None, None]
                dist.all_gather_object(lengths, len(keys))
                out[f"{name} {drop_last}"] = {"keys": keys, "len": len(ds), "all": lengths,
                                              "workers": [workers[0], workers[1]]}
        Path(args["out"]).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_gloo(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    require_module("torch.distributed")
    if not torch.distributed.is_available():
        missing("torch.distributed is not available")
    sets = {name: build(tmp_path_factory.mktemp("gloo"), sizes) for name, sizes in SIZES.items()}
    indexes = {name: str(index) for name, (index, _) in sets.items()}
    store, where = rendezvous(2)  # served here: the ranks connect, none binds a port
    port = int(where["MASTER_PORT"])
    run_children("gloo", [
        {"rank": r, "port": port, "indexes": indexes, "out": str(tmp_path / f"{r}.json")}
        for r in range(2)
    ], env=where)
    del store
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for name, (_, samples) in sets.items():
        n = len(samples)
        for drop_last in (False, True):
            got = [ranks[r][f"{name} {drop_last}"] for r in range(2)]
            # 2 ranks x 2 workers: 4 readers, each exactly the same share.
            each = partition.share(n, 4, drop_last)
            for g in got:
                assert g["workers"] == [each, each]
                assert len(g["keys"]) == g["len"] == 2 * each
                assert g["all"] == [2 * each, 2 * each]
            union = collections.Counter(got[0]["keys"] + got[1]["keys"])
            if drop_last:
                assert max(union.values()) == 1 and len(union) == n - n % 4
            else:  # padded like DistributedSampler: (-n) % 4 samples read twice
                assert set(union) == {k for k, _ in samples}
                assert sum(union.values()) - n == (-n) % 4


# --- resuming in a new process -------------------------------------------------------------

STOP = 5  # batches read before the state is saved
CONFIGS = {
    # loader-level batches of single samples, and the dataset's own batches
    "samples": {"ds": {}, "loader": {"batch_size": 6, "collate_fn": "keep_list"}},
    "batches": {"ds": {"batch_size": 6}, "loader": {"batch_size": None}},
}


def stateful_loader(ds: Any, workers: int, loader_kwargs: dict[str, Any]) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    kw = dict(loader_kwargs)
    if kw.get("collate_fn") == "keep_list":
        kw["collate_fn"] = keep_list
    if workers:
        kw["multiprocessing_context"] = multiprocessing.get_context("fork")
    return StatefulDataLoader(ds, num_workers=workers, **kw)


def resume_save(args: dict[str, Any]) -> None:
    """Reads STOP batches in each configuration and rank, saves the loaders' states."""
    out: dict[str, Any] = {}
    for name, cfg in CONFIGS.items():
        for size in (1, 2):
            for rank in range(size):
                if size > 1:
                    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size))
                ds = fastload.ShardIterableDataset(args["index"], seed=9, shuffle_block=BLOCK,
                                                   **cfg["ds"])
                loader = stateful_loader(ds, 2, cfg["loader"])
                it = iter(loader)
                keys = keys_of(next(it) for _ in range(STOP))
                out[f"{name} {size} {rank}"] = {"state": loader.state_dict(), "keys": keys}
                del it, loader
                os.environ.pop("RANK", None)
                os.environ.pop("WORLD_SIZE", None)
    Path(args["out"]).write_bytes(pickle.dumps(out))


def resume_load(args: dict[str, Any]) -> None:
    """Resumes every saved state in every way: the loader's own restore with the same
    worker count, the dataset's with 3 workers and with none; the two ranks' states in a
    world of 3."""
    saved = pickle.loads(Path(args["saved"]).read_bytes())
    out: dict[str, Any] = {}

    def dataset(cfg: dict[str, Any]) -> Any:
        return fastload.ShardIterableDataset(args["index"], seed=9, shuffle_block=BLOCK,
                                             **cfg["ds"])

    for name, cfg in CONFIGS.items():
        state = saved[f"{name} 1 0"]["state"]
        loader = stateful_loader(dataset(cfg), 2, cfg["loader"])
        loader.load_state_dict(state)
        out[f"{name} same"] = keys_of(loader)
        for workers in (3, 0):
            ds = dataset({**cfg, "ds": {**cfg["ds"], "transform": tag_worker}})
            ds.load_state_dict(state)
            got = list(stateful_loader(ds, workers, cfg["loader"]))
            out[f"{name} {workers}"] = keys_of(got)
            out[f"{name} {workers} sizes"] = {w: sum(b) for w, b in per_worker(got).items()}
        both = [saved[f"{name} 2 {r}"]["state"] for r in range(2)]
        out[f"{name} world3"] = []
        for rank in range(3):
            os.environ.update(RANK=str(rank), WORLD_SIZE="3")
            ds = dataset(cfg)
            ds.load_state_dict(both)
            out[f"{name} world3"].append(keys_of(stateful_loader(ds, 1, cfg["loader"])))
        os.environ.pop("RANK")
        os.environ.pop("WORLD_SIZE")
    Path(args["out"]).write_bytes(pickle.dumps(out))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
# torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_resume_in_new_process(
    name: str, four: tuple[Path, list[Sample]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    require_module("torchdata.stateful_dataloader")
    index, samples = four
    work = tmp_path_factory.getbasetemp() / "resume"
    if not (work / "loaded.pkl").exists():  # both configurations come from the same children
        work.mkdir(exist_ok=True)
        run_children("save", [{"index": str(index), "out": str(work / "saved.pkl")}])
        run_children("load", [{"index": str(index), "saved": str(work / "saved.pkl"),
                               "out": str(work / "loaded.pkl")}])
    saved = pickle.loads((work / "saved.pkl").read_bytes())
    loaded = pickle.loads((work / "loaded.pkl").read_bytes())
    cfg = CONFIGS[name]
    # One uninterrupted epoch, as the same loader reads it.
    ds = fastload.ShardIterableDataset(index, seed=9, shuffle_block=BLOCK, **cfg["ds"])
    whole = keys_of(stateful_loader(ds, 2, cfg["loader"]))
    # 133 samples, 2 workers: 67 each, the first sample of the order read twice.
    assert len(whole) == 2 * partition.share(len(samples), 2, False) == len(samples) + 1
    assert set(whole) == {k for k, _ in samples}
    first = saved[f"{name} 1 0"]["keys"]
    assert len(first) == STOP * 6 and first == whole[: len(first)]
    # The loader's own restore, same workers: the rest of the epoch, in the same order.
    assert first + loaded[f"{name} same"] == whole
    # The dataset's restore with 3 workers or none: the rest, nothing lost or repeated.
    # The new workers' shares of the rest differ by at most one unit (a sample, or one of
    # the dataset's batches of 6).
    for workers in (3, 0):
        assert sorted(first + loaded[f"{name} {workers}"]) == sorted(whole), workers
        sizes = loaded[f"{name} {workers} sizes"]
        assert sorted(sizes) == (list(range(workers)) if workers else [-1])
        assert sum(sizes.values()) == len(whole) - len(first)
        assert max(sizes.values()) - min(sizes.values()) <= (6 if name == "batches" else 1)
    # Two ranks stopped after STOP batches each; a world of 3 reads the rest, ranks equal.
    read = saved[f"{name} 2 0"]["keys"] + saved[f"{name} 2 1"]["keys"]
    assert len(set(read)) == len(read) == 2 * STOP * 6
    again = loaded[f"{name} world3"]
    # 133 samples among 2 ranks x 2 workers: 34 each, padded to 136.
    padded = 4 * partition.share(len(samples), 4, False)
    left = padded - len(read)
    assert [len(a) for a in again] == [-(-left // 3)] * 3
    everything = collections.Counter(read + [k for a in again for k in a])
    assert set(everything) == {k for k, _ in samples}
    assert sum(everything.values()) - len(samples) == padded - len(samples) + (-left) % 3


def test_state_protocol(four: tuple[Path, list[Sample]], monkeypatch: pytest.MonkeyPatch) -> None:
    index, samples = four
    ds = make(index, seed=1)
    fresh = ds.state_dict()
    assert fresh["epoch"] == 0 and fresh["remaining"] == [[0, len(samples)]]
    it = iter(ds)
    first = [next(it)["__key__"] for _ in range(10)]
    state = ds.state_dict()
    assert state["remaining"] == [[10, len(samples)]]
    assert json.loads(json.dumps(state)) == state  # plain ints and lists
    again = make(index, seed=1)
    again.load_state_dict(state)
    assert first + keys_of(again) == expected(index, seed=1)
    assert again.epoch == 1  # the resumed epoch counts as read; the next is 1
    # A finished epoch: the next one starts.
    rest = list(it)
    assert len(rest) == len(samples) - 10 and ds.state_dict()["remaining"] == []
    done = make(index, seed=1)
    done.load_state_dict(ds.state_dict())
    assert done.epoch == 1 and keys_of(done) == expected(index, seed=1, epoch=1)
    # set_epoch drops a state of another epoch.
    other = make(index, seed=1)
    other.load_state_dict(state)
    other.set_epoch(4)
    assert keys_of(other) == expected(index, seed=1, epoch=4)
    # Errors name what is wrong.
    with pytest.raises(ValueError, match="seed=1 but this dataset has seed=2"):
        make(index, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="no ShardIterableDataset state"):
        ds.load_state_dict({"a": [1, 2]})
    with pytest.raises(ValueError, match="version"):
        ds.load_state_dict({**state, "version": 99})
    worker = {**state, "num_workers": 2, "worker_id": 1}
    with pytest.raises(ValueError, match="incomplete"):
        ds.load_state_dict([worker, {**state, "num_workers": 3, "worker_id": 0}])
    lone = make(index, seed=1)
    lone.load_state_dict(worker)  # one worker's own state: only that worker may resume it
    with pytest.raises(ValueError, match="one DataLoader worker"):
        iter(lone)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    r1 = make(index, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"ranks \[0\] of 3 are missing"):
        make(index, seed=1).load_state_dict([r1, {**r1, "rank": 2}])
    with pytest.raises(ValueError, match="disagree on world_size"):
        make(index, seed=1).load_state_dict([r1, {**r1, "rank": 0, "world_size": 2}])
    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = make(index, seed=1)
    alone.load_state_dict(r1)
    with pytest.raises(ValueError, match="holds rank 1 of 3 only"):
        iter(alone)


# --- child processes -----------------------------------------------------------------------


def _main(argv: Sequence[str]) -> None:
    mode, args = argv[0], json.loads(argv[1])
    {"gloo": gloo_rank, "save": resume_save, "load": resume_load}[mode](args)


if __name__ == "__main__":
    _main(sys.argv[1:])
