"""fastload.collate and PackedBatch: packing, views, missing fields, pickling, and the
round trip of every sample through DataLoader workers (fork and spawn) with both
datasets, the packed fast path of ShardIndexDataset and pinning."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kit.tools import require_module

torch = require_module("torch")

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler  # noqa: E402

import fastload  # noqa: E402
from fastload import PackedBatch, ShardIndex  # noqa: E402
from fastload.data import PackedField  # noqa: E402
from fastload.data.collate import fetch_packed  # noqa: E402
from kit.shards import Sample, make_samples, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native

FIELDS = ["jpg", "cls", "seg.png"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    """Three shards of 40 samples (empty payloads among them) and their index."""
    root = tmp_path_factory.mktemp("collate")
    samples: list[Sample] = []
    paths = []
    for s in range(3):
        part = make_samples(40, seed=200 + s, prefix=f"c{s}/")
        samples += part
        paths.append(write_tarfile(root / f"shard-{s}.tar", part, "pax"))
    ShardIndex.build(paths, root / "all.fidx")
    return root / "all.fidx", samples


def check_batch(batch: PackedBatch, expect: list[Sample]) -> None:
    assert isinstance(batch, PackedBatch)
    assert len(batch) == len(expect)
    assert batch.keys == [k for k, _ in expect] == batch["__key__"]
    for name in FIELDS:
        field = batch[name]
        assert isinstance(field, PackedField)
        assert field.tolist() == [f[name] for _, f in expect]
        for i, (_, f) in enumerate(expect):
            view = field[i]
            assert view is not None and view.dtype == torch.uint8
            assert view.numpy().tobytes() == f[name]


def collected(batches: list[PackedBatch]) -> dict[str, dict[str, bytes]]:
    out: dict[str, dict[str, bytes]] = {}
    for b in batches:
        for s in b.to_samples():
            key = s.pop("__key__")
            assert key not in out, f"{key} delivered twice"
            out[key] = s
    return out


# --- packing ---------------------------------------------------------------------------


def test_collate_payloads_and_buffers(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    ds = fastload.ShardIndexDataset(path)
    batch = fastload.collate(ds.__getitems__(list(range(10))))
    check_batch(batch, samples[:10])
    assert batch.fields == FIELDS
    jpg = batch["jpg"]
    assert jpg.data.is_contiguous() and jpg.offsets.dtype == torch.int64
    assert jpg.nbytes == sum(len(f["jpg"]) for _, f in samples[:10])
    assert jpg.sizes().tolist() == [len(f["jpg"]) for _, f in samples[:10]]
    # The view shares the block: no copy per sample.
    view = jpg[3]
    assert view is not None
    assert view.untyped_storage().data_ptr() == jpg.data.untyped_storage().data_ptr()
    mv = jpg.buffer(3)
    assert mv is not None and mv.readonly and mv.tobytes() == samples[3][1]["jpg"]
    assert jpg.to_bytes(-1) == samples[9][1]["jpg"]
    # Any buffer: bytes, bytearray, numpy, memoryview; a PackedBatch passes through.
    mixed = [
        {"__key__": "a", "x": b"abc"},
        {"__key__": "b", "x": bytearray(b"de")},
        {"__key__": "c", "x": np.arange(3, dtype=np.uint8)},
        {"__key__": "d", "x": memoryview(b"fghij")[1:3]},
    ]
    m = fastload.collate(mixed)
    assert m["x"].tolist() == [b"abc", b"de", b"\x00\x01\x02", b"gh"]
    assert fastload.collate(m) is m


def test_empty_payloads_one_sample_and_empty_batch() -> None:
    b = fastload.collate([{"__key__": "k", "a": b"", "b": b"x"}])
    assert len(b) == 1 and b["a"].tolist() == [b""] and b["b"].tolist() == [b"x"]
    view = b["a"][0]
    assert view is not None and view.numel() == 0
    assert b.to_samples() == [{"__key__": "k", "a": b"", "b": b"x"}]
    all_empty = fastload.collate([{"__key__": str(i), "a": b""} for i in range(5)])
    assert all_empty["a"].tolist() == [b""] * 5 and all_empty["a"].stacked().shape == (5, 0)
    none = fastload.collate([], fields=["a"])
    assert len(none) == 0 and none["a"].tolist() == []
    back = pickle.loads(pickle.dumps(fastload.collate([], fields=["a"], ints="a")))
    assert len(back) == 0 and back["a"].tolist() == []


def test_missing_fields() -> None:
    samples = [{"__key__": "s0", "a": b"1", "b": b"x"}, {"__key__": "s1", "a": b"22"}]
    with pytest.raises(KeyError, match=r"sample 's1' has no field 'b'"):
        fastload.collate(samples)
    with pytest.raises(KeyError, match=r"sample 's0' has no field 'c'"):
        fastload.collate(samples, fields=["a", "c"])
    b = fastload.collate(samples, allow_missing=True)
    assert b["b"][1] is None and b["b"].missing(1) and not b["b"].missing(0)
    assert b["b"].tolist() == [b"x", None] and b["b"].buffer(1) is None
    assert b.to_samples() == [
        {"__key__": "s0", "a": b"1", "b": b"x"}, {"__key__": "s1", "a": b"22"}
    ]
    assert b["b"].uniform_size() is None
    with pytest.raises(ValueError, match="ints"):
        b["b"].ints()
    # Unpickled, the missing rows are still missing.
    assert pickle.loads(pickle.dumps(b))["b"].tolist() == [b"x", None]
    with pytest.raises(KeyError, match="no field 'zz' in this batch"):
        b["zz"]


def test_bad_values_name_the_field_and_sample() -> None:
    with pytest.raises(TypeError, match=r"field 'a' of sample 'k1' is a float"):
        fastload.collate([{"__key__": "k0", "a": b"x"}, {"__key__": "k1", "a": 1.5}])
    with pytest.raises(TypeError, match=r"field 'n' of sample 'k1' is a bytes where"):
        fastload.collate([{"__key__": "k0", "n": 3}, {"__key__": "k1", "n": b"4"}])
    with pytest.raises(TypeError, match="list of samples"):
        fastload.collate({"__key__": "k0", "a": b"x"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'b' has payloads of different sizes"):
        fastload.collate([{"__key__": "0", "b": b"x"}, {"__key__": "1", "b": b"yz"}], stack="b")
    with pytest.raises(ValueError, match=r"ints: field 'c': payload 1 \('x1'\)"):
        fastload.collate([{"__key__": "0", "c": b"7"}, {"__key__": "1", "c": b"x1"}], ints="c")


def test_stacked_ints_and_meta() -> None:
    samples = [
        {"__key__": f"k{i}", "__url__": "u", "cls": str(i * 7).encode(), "vec": bytes([i] * 4),
         "label": i}
        for i in range(6)
    ]
    b = fastload.collate(samples, stack=["vec"], ints="cls")
    assert torch.equal(b["cls"], torch.arange(6) * 7) and b["cls"].dtype == torch.int64
    assert b["vec"].shape == (6, 4) and b["vec"][5].tolist() == [5] * 4
    assert torch.equal(b["label"], torch.arange(6))
    assert b["__url__"] == ["u"] * 6 and "__url__" in b and "vec" in b
    s = b.to_samples()[2]
    assert s["cls"] == 14 and s["label"] == 2 and s["vec"].tolist() == [2] * 4
    assert s["__url__"] == "u"
    plain = fastload.collate(samples)
    assert plain["vec"].uniform_size() == 4 and plain["cls"].uniform_size() is None
    assert plain["vec"].stacked().view(torch.int32).shape == (6, 1)
    assert plain["cls"].ints().tolist() == [i * 7 for i in range(6)]


def test_pickle_carries_tensors_not_bytes() -> None:
    payload = b"q" * 100_000
    b = fastload.collate([{"__key__": "a", "x": payload}, {"__key__": "b", "x": payload}])
    data = pickle.dumps(b)
    back = pickle.loads(data)
    assert back["x"].tolist() == [payload, payload] and back.keys == ["a", "b"]
    # The payload travels once, inside the block tensor (which torch's multiprocessing
    # pickler swaps for a shared-memory handle), never also as bytes.
    assert len(data) < len(payload) * 2 + 10_000
    _, (keys, nbytes, meta, bases, spec) = b.__reduce__()
    (block,) = bases  # data and offsets: one storage, carried once
    assert isinstance(block, torch.Tensor) and block.numel() >= 2 * len(payload)
    assert keys == (2, "a\0b")  # the keys as one string: one object to unpickle
    assert nbytes == 2 * len(payload) and meta is None  # nbytes without a tensor built
    assert type(spec) is bytes and len(spec) < 1_000  # the layout: one small object
    odd = fastload.collate([{"__key__": "a\0b", "x": b"1"}, {"__key__": "", "x": b"2"}])
    assert odd.__reduce__()[1][0] == ["a\0b", ""]
    assert pickle.loads(pickle.dumps(odd)).keys == ["a\0b", ""]
    assert pickle.loads(pickle.dumps(fastload.collate([]))).keys == []
    one_empty = fastload.collate([{"__key__": "", "x": b"1"}])
    assert pickle.loads(pickle.dumps(one_empty)).keys == [""]
    # Small private tensors (labels) travel inline.
    small = fastload.collate([{"__key__": "a", "c": b"1"}, {"__key__": "b", "c": b"2"}], ints="c")
    assert all(type(x) is bytes for x in small.__reduce__()[1][3])
    assert torch.equal(pickle.loads(pickle.dumps(small))["c"], torch.tensor([1, 2]))
    # A storage no element of the tensor's dtype divides (12 bytes, an int64 in it).
    odd_storage = torch.zeros(12, dtype=torch.uint8)
    odd_storage[:8] = torch.tensor([7], dtype=torch.int64).view(torch.uint8)
    field = PackedField(torch.zeros(0, dtype=torch.uint8),
                        torch.empty(0, dtype=torch.int64).set_(odd_storage.untyped_storage(),
                                                               0, (1,), (1,)))
    assert pickle.loads(pickle.dumps(field)).offsets.tolist() == [7]


def test_fetch_packed(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    index = ShardIndex.open(path)
    order = [5, 0, 119, 40, 5, 77]
    for access in ("mmap", "read"):
        b = fetch_packed(index, order, None, access)
        check_batch(b, [samples[i] for i in order])
        assert b.fields == FIELDS
        sub = fetch_packed(index, order, ["seg.png", "jpg"], access)
        assert sub.fields == ["seg.png", "jpg"]
        assert sub["jpg"].tolist() == [samples[i][1]["jpg"] for i in order]
    assert len(fetch_packed(index, [], ["jpg"])) == 0
    with pytest.raises(IndexError):
        fetch_packed(index, [len(samples)], None)
    with pytest.raises(ValueError, match="no field 'png'"):
        fetch_packed(index, [0], ["png"])


def test_fetch_packed_missing(tmp_path: Path) -> None:
    samples: list[Sample] = [("a", {"x": b"1", "y": b"2"}), ("b", {"x": b"33"}), ("c", {"y": b""})]
    write_tarfile(tmp_path / "s.tar", samples)
    index = ShardIndex.build([tmp_path / "s.tar"], tmp_path / "s.fidx")
    with pytest.raises(KeyError, match="sample 'c' has no field 'x'"):
        fetch_packed(index, [0, 1, 2], None)
    with pytest.raises(KeyError, match="sample 'b' has no field 'y'"):
        fetch_packed(index, [0, 1], None)
    with pytest.raises(KeyError, match="sample 'c' has no field 'x'"):
        fetch_packed(index, [0, 1, 2], ["x"])
    for access in ("mmap", "read"):
        b = fetch_packed(index, [0, 1, 2], None, access, allow_missing=True)
        assert b["x"].tolist() == [b"1", b"33", None] and b["y"].tolist() == [b"2", None, b""]


# --- through DataLoader workers ----------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "packed", "access"),
    [("fork", False, "mmap"), ("fork", True, "read"), ("spawn", True, "mmap")],
)
def test_map_dataset_round_trip(
    shards: tuple[Path, list[Sample]], start: str, packed: bool, access: str
) -> None:
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, packed=packed, access=access)
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                        collate_fn=fastload.collate,
                        multiprocessing_context=multiprocessing.get_context(start))
    batches = list(loader)
    assert all(isinstance(b, PackedBatch) for b in batches)
    got = collected(batches)
    assert got == {k: f for k, f in samples}
    # In the main process, the blocks are the workers' shared memory.
    assert all("fastload-batch" in mapping_of(b["jpg"].data)[1] for b in batches)


def mapping_of(t: torch.Tensor) -> tuple[int, str]:
    """(inode, name) of the mapping of this process that holds ``t``'s data."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return int(parts[4]), parts[5] if len(parts) > 5 else ""
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_workers_reuse_their_blocks(shards: tuple[Path, list[Sample]], start: str) -> None:
    """A batch is written into a block the main process has let go of: an epoch of 30
    batches through 2 workers uses a handful of blocks, not one per batch."""
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, packed=True)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=fastload.collate,
                        multiprocessing_context=multiprocessing.get_context(start))
    blocks = set()
    count = 0
    for b in loader:
        inode, name = mapping_of(b["jpg"].data)
        assert "fastload-batch" in name
        blocks.add(inode)
        check_batch(b, [(k, dict(samples)[k]) for k in b.keys])
        count += 1
        del b
    assert count == 30
    # per worker: prefetch_factor (2) queued + one being filled + one held here
    assert 2 <= len(blocks) <= 8, blocks


def test_block_leases() -> None:
    """The count in a block follows its leases in every process; attaching checks what
    it maps."""
    import os

    from fastload import _core

    block = _core.ShmBlock(100_000)
    assert block.users == 0 and block.capacity >= 100_000
    lease = block.lease()
    t = torch.frombuffer(lease, dtype=torch.uint8)
    t[:5] = torch.tensor(list(b"hello"), dtype=torch.uint8)
    del lease
    assert block.users == 1  # the tensor holds its lease
    block.retain()  # as pickling does, for the receiver
    view = _core.ShmView(os.dup(block.fd), block.length)
    other = torch.frombuffer(view.adopt(), dtype=torch.uint8)
    assert other[:5].numpy().tobytes() == b"hello"
    assert block.users == 2
    del t
    assert block.users == 1
    del other
    gc.collect()
    assert block.users == 0
    # The receiving side keeps its mapping: a batch written there again reads through it.
    lease = block.lease()
    torch.frombuffer(lease, dtype=torch.uint8)[:5] = torch.tensor(list(b"again"),
                                                                  dtype=torch.uint8)
    block.retain()
    del lease
    again = torch.frombuffer(view.adopt(), dtype=torch.uint8)
    assert again[:5].numpy().tobytes() == b"again" and block.users == 1
    del again
    assert block.users == 0

    r, w = os.pipe()
    os.close(w)
    with pytest.raises(OSError, match="fastload batch block"):
        _core.ShmView(r, 1 << 20)
    fd = os.memfd_create("not-a-block")
    os.ftruncate(fd, 1 << 16)
    with pytest.raises(OSError, match="not a fastload batch block"):
        _core.ShmView(fd, 1 << 16)
    with pytest.raises(OSError, match="were announced"):
        _core.ShmView(os.dup(block.fd), block.length * 2)


def test_a_block_descriptor_travels_once() -> None:
    """A pool block is handed over with its descriptor the first time only; after that
    the receiver finds its mapping by (pid, inode), or, having let go of it, opens the
    block again through /proc/PID/fd/N. A descriptor that is no longer that block is an
    OSError naming it."""
    import os
    from multiprocessing.reduction import ForkingPickler

    from fastload.data import _shm

    pool = _shm._BlockPool()
    t = pool.take(10_000)
    t[:4] = torch.tensor(list(b"abcd"), dtype=torch.uint8)
    block = pool.block_of(t.untyped_storage())
    assert block is not None
    first = _shm._BlockHandover(block, pool).__reduce__()[1]
    again = _shm._BlockHandover(block, pool).__reduce__()[1]
    assert first[0] is not None and again[0] is None  # a DupFd, then nothing
    assert first[1:] == again[1:] == (block.fd, block.length, os.getpid(), block.inode, ())
    got = _u8(_shm._attach_block(*first))  # maps the block (the descriptor taken over)
    assert got[:4].numpy().tobytes() == b"abcd"
    assert _u8(_shm._attach_block(*again)).data_ptr() == got.data_ptr()  # the same mapping
    _shm.forget_views()  # the receiver let go of it: reopened through /proc
    reopened = _u8(_shm._attach_block(*_shm._BlockHandover(block, pool).__reduce__()[1]))
    assert reopened[:4].numpy().tobytes() == b"abcd" and reopened.data_ptr() != got.data_ptr()
    assert block.users == 3  # t, got and reopened (the second view was dropped at once)
    del got, reopened
    gc.collect()
    assert block.users == 1
    _shm.forget_views()
    other = _core_block()
    with pytest.raises(OSError, match="no longer the batch block"):
        _shm._attach_block(None, other.fd, block.length, os.getpid(), block.inode)
    with pytest.raises(OSError, match=f"/proc/{os.getpid()}/fd/"):
        _shm._attach_block(None, 10**6, block.length, os.getpid(), block.inode + 1)
    # Through a real pickle, as a worker's batch goes to the main process.
    batch_state = ForkingPickler.dumps(_shm._BlockHandover(block, pool))
    assert _u8(pickle.loads(batch_state))[:4].numpy().tobytes() == b"abcd"
    _shm.forget_views()


def test_a_pool_names_the_blocks_it_let_go_of() -> None:
    """A block the worker's pool drops (a spare beyond max_idle) is named in its next
    hand-over, and the receiver drops its mapping of it then."""
    import os

    from fastload.data import _shm

    pool = _shm._BlockPool(max_idle=0)
    small = pool.take(10_000)
    a = pool.block_of(small.untyped_storage())
    assert a is not None
    got = _shm._attach_block(*_shm._BlockHandover(a, pool).__reduce__()[1])
    assert (os.getpid(), a.inode) in _shm._views
    del small, got
    gc.collect()
    big = pool.take(5 << 20)  # a does not fit: a new block, and the free a is let go of
    b = pool.block_of(big.untyped_storage())
    assert b is not None and b.inode != a.inode and pool.retired == [a.inode]
    args = _shm._BlockHandover(b, pool).__reduce__()[1]
    assert args[-1] == (a.inode,) and pool.retired == []
    landed = _shm._attach_block(*args)
    assert (os.getpid(), a.inode) not in _shm._views and (os.getpid(), b.inode) in _shm._views
    del landed, big
    _shm.forget_views()


def _u8(lease: Any) -> torch.Tensor:
    """A landed block (its lease) as the uint8 tensor a batch's tensors are views of."""
    return torch.frombuffer(lease, dtype=torch.uint8)


def _core_block() -> Any:
    from fastload import _core

    return _core.ShmBlock(1000)


def test_views_outlive_the_loader(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, packed=True)
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=fastload.collate,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    views = []
    for b in loader:
        views += [(b.keys[i], b["jpg"][i], b["cls"].buffer(i)) for i in range(len(b))]
        del b
    del loader
    gc.collect()
    expect = dict(samples)
    assert len(views) == len(samples)
    for key, jpg, cls in views:
        assert jpg is not None and jpg.numpy().tobytes() == expect[key]["jpg"]
        assert cls is not None and cls.tobytes() == expect[key]["cls"]


def test_distributed_sampler_batches(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, packed=True, fields=["cls"])
    seen: list[str] = []
    fork = multiprocessing.get_context("fork")
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, seed=1)
        # Both spellings reach __getitems__: a batch size, or a batch sampler.
        loader = (
            DataLoader(ds, sampler=sampler, batch_size=32, collate_fn=fastload.collate,
                       num_workers=1, multiprocessing_context=fork)
            if rank == 0 else
            DataLoader(ds, batch_sampler=BatchSampler(sampler, batch_size=32, drop_last=False),
                       collate_fn=fastload.collate, num_workers=1, multiprocessing_context=fork)
        )
        for b in loader:
            assert b.fields == ["cls"]
            seen += b.keys
    assert sorted(seen) == sorted(k for k, _ in samples)


def test_iterable_dataset_batches(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    collate = functools.partial(fastload.collate, ints="cls")
    ds = fastload.ShardIterableDataset(path, batch_size=16, collate_fn=collate)
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=fastload.collate,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    batches = list(loader)
    assert all(isinstance(b, PackedBatch) and len(b) <= 16 for b in batches)
    got = collected(batches)
    expect = {k: {**f, "cls": int(f["cls"])} for k, f in samples}
    assert got == expect


def test_iterable_packed_fast_path(shards: tuple[Path, list[Sample]]) -> None:
    """With fastload.collate (or a partial of it) and no transform, the iterable dataset
    reads each batch straight into its packed block: the same batches as collating the
    sample dicts."""
    path, _ = shards
    for collate in (fastload.collate, functools.partial(fastload.collate, ints="cls")):
        fast = list(fastload.ShardIterableDataset(path, batch_size=16, collate_fn=collate))
        slow = list(fastload.ShardIterableDataset(
            path, batch_size=16, collate_fn=lambda b, c=collate: c(b)))  # type: ignore[misc]
        assert len(fast) == len(slow) == 8
        for f, s in zip(fast, slow, strict=True):
            assert isinstance(f, PackedBatch) and f.keys == s.keys
            assert f.to_samples() == s.to_samples()


def test_packed_option_errors(shards: tuple[Path, list[Sample]]) -> None:
    path, _ = shards
    with pytest.raises(ValueError, match="packed=True"):
        fastload.ShardIndexDataset(path, packed=True, transform=lambda s: s)
    ds = fastload.ShardIndexDataset(path, packed=True)
    assert isinstance(ds[0], dict)  # one sample is still a dict
    assert pickle.loads(pickle.dumps(ds)).packed


# --- pinning -----------------------------------------------------------------------------


def _can_pin() -> bool:
    try:
        torch.empty(1).pin_memory()
    except RuntimeError:
        return False
    return True


def test_pin_memory(shards: tuple[Path, list[Sample]]) -> None:
    if not _can_pin():
        pytest.skip("pinned memory needs an accelerator this torch build can reach")
    path, samples = shards
    b = fastload.collate(fastload.ShardIndexDataset(path).__getitems__([0, 1, 2]), ints="cls")
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = pin_memory(b)  # what the DataLoader's pinning thread calls
    assert isinstance(pinned, PackedBatch)
    assert pinned["jpg"].data.is_pinned() and pinned["cls"].is_pinned()
    check_batch_fields: Any = pinned["jpg"].tolist()
    assert check_batch_fields == [samples[i][1]["jpg"] for i in range(3)]


def test_pin_memory_pins_one_block_per_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an accelerator: the tensors pin_memory() pins, counted."""
    pinned: list[int] = []

    def fake_pin(self: Any, device: Any = None) -> Any:
        pinned.append(self.numel())
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    samples = [{"__key__": str(i), "a": b"x" * i, "b": b"yy", "c": b"7"} for i in range(50)]
    b = fastload.collate(samples, ints="c")
    p = b.pin_memory()
    # a: block + offsets, b: block + offsets, c: one int64 tensor.
    assert sorted(pinned) == sorted([sum(range(50)), 51, 100, 51, 50])
    assert p.to_samples() == b.to_samples()
