"""The hand-over of a packed batch to the main process (issue 34): a received batch is
lazy (unpickling adopts its blocks' leases, the tensors are built when a field is first
touched), and the lease rule still holds for it: a batch dropped untouched gives its
block straight back, a view taken from it keeps the block, and through real DataLoader
workers (fork and spawn) epochs that only read ``nbytes`` reuse a bounded set of blocks."""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import pickle
import threading
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload import PackedBatch, ShardIndex  # noqa: E402
from fastload.data import PackedField, _shm  # noqa: E402
from fastload.data.collate import finish  # noqa: E402
from kit.shards import Sample, make_samples, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native


@pytest.fixture
def as_worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[_shm._BlockPool]:
    """collate in this process allocates in a block pool, as in a DataLoader worker (the
    receiving side is this process too: it maps its own blocks by (pid, inode))."""
    monkeypatch.setattr(importlib.import_module("fastload.data.collate"), "_in_worker",
                        lambda: True)
    pool = _shm._worker_pool()
    max_idle = pool.max_idle
    yield pool
    pool.max_idle = max_idle
    _shm.FENCES.drain()
    _shm.forget_views()


def _batch(n: int, size: int, seed: int) -> tuple[PackedBatch, list[bytes]]:
    payloads = [bytes([seed + i]) * (size + i) for i in range(n)]
    samples = [{"__key__": f"k{i}", "x": p, "c": str(seed + i).encode()}
               for i, p in enumerate(payloads)]
    return fastload.collate(samples), payloads


def _block_of(batch: PackedBatch, pool: _shm._BlockPool) -> Any:
    field = batch["x"]
    assert isinstance(field, PackedField)
    block = pool.block_of(field.data.untyped_storage())
    assert block is not None, "collate did not allocate in the pool"
    return block


def test_a_received_batch_is_built_when_touched(as_worker: _shm._BlockPool) -> None:
    sent, payloads = _batch(16, 5_000, 1)
    block = _block_of(sent, as_worker)
    nbytes = sent.nbytes
    data = ForkingPickler.dumps(sent)
    del sent
    gc.collect()
    assert block.users == 1  # the count retained for the receiver
    back = pickle.loads(data)
    assert block.users == 1  # adopted: the sender's count is the receiver's lease now
    assert back._fields_ is None  # nothing built by unpickling
    assert len(back) == 16 and back.nbytes == nbytes == sum(map(len, payloads)) + 9 + 7 * 2
    assert back.keys == [f"k{i}" for i in range(16)] and back._fields_ is None
    # dropped untouched: the block goes straight back to the pool
    del back
    gc.collect()
    assert block.users == 0
    again, _ = _batch(16, 5_000, 2)
    assert _block_of(again, as_worker) is block  # reused


def test_a_view_of_a_received_batch_keeps_its_block(as_worker: _shm._BlockPool) -> None:
    sent, payloads = _batch(8, 3_000, 3)
    block = _block_of(sent, as_worker)
    back = pickle.loads(ForkingPickler.dumps(sent))
    del sent
    gc.collect()
    assert back.fields == ["x", "c"] and back._fields_ is not None
    assert back["x"].tolist() == payloads and back["c"].ints().tolist() == list(range(3, 11))
    view = back["x"][5]
    assert view is not None
    del back
    gc.collect()
    assert block.users == 1  # the view's lease
    assert view.numpy().tobytes() == payloads[5]
    del view
    gc.collect()
    assert block.users == 0


def test_finish_on_a_received_batch_counts_its_bytes_again(as_worker: _shm._BlockPool) -> None:
    sent, payloads = _batch(4, 100, 7)
    back = pickle.loads(ForkingPickler.dumps(sent))
    assert back.nbytes == sum(map(len, payloads)) + 5  # "7".."10": 1+1+1+2 bytes of text
    finish(back, (), "c")
    assert back.nbytes == sum(map(len, payloads)) + 4 * 8  # now an int64 per sample
    assert back["c"].tolist() == [7, 8, 9, 10]
    # moved or pinned batches keep their count; a pickled received batch round-trips
    assert back.to("cpu").nbytes == back.nbytes
    assert pickle.loads(pickle.dumps(back)).to_samples() == back.to_samples()


def test_a_field_alone_from_a_worker(as_worker: _shm._BlockPool) -> None:
    """A PackedField pickled on its own travels by its block too, landed as tensors."""
    sent, payloads = _batch(5, 1_000, 4)
    block = _block_of(sent, as_worker)
    field = pickle.loads(ForkingPickler.dumps(sent["x"]))
    del sent
    gc.collect()
    assert block.users == 1 and field.tolist() == payloads
    del field
    gc.collect()
    assert block.users == 0


def test_threads_touching_one_received_batch(as_worker: _shm._BlockPool) -> None:
    """DataLoader's pin thread and the loop may touch a batch at once: each sees the
    whole batch, whichever builds its tensors."""
    sent, payloads = _batch(32, 2_000, 9)
    datas = [ForkingPickler.dumps(sent) for _ in range(50)]
    del sent
    errors: list[BaseException] = []
    for data in datas:
        back = pickle.loads(data)
        go = threading.Barrier(3)

        def read(b: PackedBatch = back, go: threading.Barrier = go) -> None:
            try:
                go.wait()
                assert b["x"].tolist() == payloads
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=read) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[0]


def test_a_pool_keeps_free_blocks_while_they_are_used() -> None:
    """A free block stays in its worker's pool until it has not been written for
    ``idle_takes`` batches (letting go of one the loader needs again costs the main
    process a descriptor and a mapping), or more than ``max_idle`` are free."""
    pool = _shm._BlockPool(max_idle=8, idle_takes=3)
    x, y = pool.take(10_000), pool.take(10_000)  # two batches in flight: two blocks
    spare = pool.block_of(y.untyped_storage())
    assert spare is not None and len(pool.blocks) == 2
    pool.sent.add(spare.inode)  # as if handed over
    del x, y
    gc.collect()
    for take in (3, 4, 5):  # one batch at a time: the other block idle since take 2
        t = pool.take(10_000)
        assert t.data_ptr() != spare.address and len(pool.blocks) == 2, take
        del t
    t = pool.take(10_000)  # idle for 4 takes: let go of, and named to the receiver
    assert len(pool.blocks) == 1 and pool.retired == [spare.inode]
    del t
    held = [pool.take(s) for s in (10_000, 20_000, 3 << 20, 4 << 20)]
    assert len(pool.blocks) == 4
    del held
    gc.collect()
    pool.max_idle = 2
    pool.take(10)  # three free beside the one written: one more than max_idle allows
    sizes = sorted(b.capacity for b in pool.blocks.values())
    assert len(sizes) == 3 and sizes[-1] >= 4 << 20  # the smallest spare went


def test_a_batch_names_the_blocks_its_pool_let_go_of(as_worker: _shm._BlockPool) -> None:
    """The one-bytes form of a batch carries the inodes of blocks the sender's pool let
    go of since its last hand-over; receiving it drops their mappings here."""
    as_worker.max_idle = 0
    small, _ = _batch(4, 1_000, 1)
    first = _block_of(small, as_worker)
    back = pickle.loads(ForkingPickler.dumps(small))
    assert (os.getpid(), first.inode) in _shm._views
    del small, back
    gc.collect()
    big, payloads = _batch(4, 2_000_000, 2)  # does not fit: a new block, the free one let go
    assert _block_of(big, as_worker) is not first and as_worker.retired == [first.inode]
    got = pickle.loads(ForkingPickler.dumps(big))
    assert (os.getpid(), first.inode) not in _shm._views and as_worker.retired == []
    assert got["x"].tolist() == payloads and got.keys == ["k0", "k1", "k2", "k3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    root = tmp_path_factory.mktemp("handover")
    samples = make_samples(96, seed=34)
    paths = [write_tarfile(root / f"shard-{s}.tar", samples[s * 48 : (s + 1) * 48], "pax")
             for s in range(2)]
    ShardIndex.build(paths, root / "all.fidx")
    return root / "all.fidx", samples


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_untouched_batches_give_their_blocks_back(
    shards: tuple[Path, list[Sample]], start: str
) -> None:
    """Epochs through persistent workers reading only ``nbytes`` (no tensor ever built
    here): every byte is counted, and the workers keep writing into a few blocks (a
    batch's lease not given back would make its worker's pool grow by a block a batch:
    48 batches here)."""
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, packed=True)
    loader = DataLoader(ds, batch_size=6, shuffle=True, num_workers=2,
                        collate_fn=fastload.collate, persistent_workers=True,
                        multiprocessing_context=multiprocessing.get_context(start))
    expect = sum(len(p) for _, f in samples for p in f.values())
    _shm.forget_views()
    try:
        for _ in range(3):
            total = batches = 0
            for b in loader:
                total += b.nbytes
                batches += 1
            assert (batches, total) == (16, expect)
        workers = {pid for pid, _ in _shm._views}
        assert len(workers) == 2 and os.getpid() not in workers
        # per worker: prefetch_factor (2) queued + one being filled + one held here
        assert len(_shm._views) <= 8, sorted(_shm._views)
        # and a touched epoch reads every sample
        got = {k: s for b in loader for k, s in zip(b.keys, b.to_samples(), strict=True)}
        assert got.keys() == dict(samples).keys()
        assert all({f: s[f] for f in s if f != "__key__"} == dict(samples)[k]
                   for k, s in got.items())
    finally:
        del loader
        _shm.forget_views()
