"""The GPU hand-off without a GPU (issue 48). Every CUDA call of data/_gpu.py goes through
``_gpu.CUDA``, replaced here by a recording stand-in (cuda_standin.py: registration that
succeeds or fails on request, a current device, events that complete when the test says
so); torch, the shared-memory blocks, their lease counts, DataLoader workers and fork are
real.
tests/gpu runs the same paths on CUDA.

Covered: a block read by a plain copy (any API) goes back to its worker only once an
event recorded after the copy has completed; a lease dropped in a forked child leaves
the count alone; registration on the target device, its failure remembered, warned
about once, counted; a failed unregistration keeps the mapping; docs/to-device.md's loop over
``to_device`` (packed fields stay on the host, every accessor works, a field on a device
is never read to index it); decode_images' per-image fallback and torchvision gate."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from cuda_standin import StandInCuda, StandInEvent, received, standin_cuda  # noqa: E402, F401
from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload.data import PackedField, _gpu, _shm, device  # noqa: E402
from kit.shards import Sample, make_samples, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native


def test_a_plain_copy_keeps_the_block_until_its_event(cuda: StandInCuda) -> None:
    """The issue's case: ``x = batch["npy"].data.cuda(non_blocking=True)`` from a pinned
    (registered) batch, the batch dropped at the next step while the copy still waits.
    Whatever issued the copy, the block's count stays until an event recorded after
    the batch was dropped has completed; the worker's pool writes elsewhere meanwhile."""
    back, block = received()
    pinned = back.pin_memory()  # what DataLoader(pin_memory=True) calls
    m = _shm.mapped_of(pinned["npy"].data)
    assert m is not None and m.registered and m.view.held
    assert pinned["npy"].data.data_ptr() == back["npy"].data.data_ptr()  # no copy
    assert [c[0] for c in cuda.calls] == ["current_device", "register"]
    x = pinned["npy"].data  # the tensor a plain .cuda(non_blocking=True) reads
    del back, pinned, x  # the loop moves on; nothing tells fastload a copy was made
    gc.collect()
    assert block.users == 1  # retired, not given back
    pool = _shm._worker_pool()
    other = pool.take(100)
    assert other.data_ptr() != block.address  # the worker writes into another block
    del other
    _gpu.poll()  # as when the next batch arrives: an event recorded on the streams in use
    assert len(cuda.events) == 1 and cuda.events[0].streams == [(0, 0, 1)]
    assert block.users == 1 and _gpu.COUNTERS.retired == 1
    _gpu.poll()
    assert block.users == 1  # the copy has not completed
    cuda.events[0].done = True
    _gpu.poll()
    assert block.users == 0
    again = pool.take(100)
    assert again.data_ptr() == block.address  # free, and reused


def test_the_event_covers_every_stream_a_field_was_taken_on(cuda: StandInCuda) -> None:
    """A loop that runs on a stream of its own (``torch.cuda.stream(s)`` around the
    step) takes the field there and copies there; the batch is dropped, and polled,
    outside it: the event is recorded on that stream too, and on to_device's."""
    back, block = received(seed=11)
    assert _shm.registered(back["npy"].data)
    _gpu.use_stream((0, 5, 1))  # as to_device does with its side stream
    cuda.stream = 9
    x = back["npy"].data  # taken (and copied from) on stream 9
    cuda.stream = 0
    del back, x
    gc.collect()
    _gpu.poll()
    assert sorted(cuda.events[-1].streams) == [(0, 0, 1), (0, 5, 1), (0, 9, 1)]
    assert block.users == 1
    cuda.events[-1].done = True
    _gpu.poll()
    assert block.users == 0


def test_a_view_kept_past_the_batch_retires_when_it_goes(cuda: StandInCuda) -> None:
    """A view taken from a registered batch keeps the block while it lives, and its
    count, when it goes, waits for an event like the batch's."""
    back, block = received(seed=5)
    assert _shm.registered(back["npy"].data)
    view = back["npy"][3]
    del back
    gc.collect()
    _gpu.poll()
    assert block.users == 1 and not cuda.events  # the view's lease: nothing retired yet
    del view
    gc.collect()
    _gpu.poll()
    assert block.users == 1 and len(cuda.events) == 1
    cuda.events[0].done = True
    _gpu.poll()
    assert block.users == 0


def test_a_lease_dropped_in_a_forked_child(cuda: StandInCuda) -> None:
    """Workers forked while the main process holds batches inherit them; a child that
    drops one (here: all it inherited, and its copy of the hand-off state) gives no
    block back. Registered or not."""
    plain, plain_block = received(seed=2)
    held, held_block = received(seed=3)
    assert _shm.registered(held["npy"].data)
    assert (plain_block.users, held_block.users) == (1, 1)
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            del plain, held
            gc.collect()
            _gpu.poll()
            _gpu.drain()
            code = 0 if (plain_block.users, held_block.users) == (1, 1) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert (plain_block.users, held_block.users) == (1, 1)
    del plain, held
    gc.collect()
    assert plain_block.users == 0
    _gpu.drain()
    assert held_block.users == 0


def test_registration_on_the_target_device(cuda: StandInCuda) -> None:
    """``pin_memory("cuda:3")`` with device 0 current registers under device 3 and
    puts 0 back; nothing is asked of the current device. Unregistration runs on the
    block's device too."""
    back, _ = received(seed=4)
    pinned = back.pin_memory("cuda:3")
    m = _shm.mapped_of(pinned["npy"].data)
    assert m is not None and m.registered and m.device == 3
    assert cuda.named("register") == [("register", m.base, m.length, 3)]
    assert cuda.current == 0 and not cuda.named("current_device")
    assert _gpu.device_index(torch.device("cuda", 2)) == 2 and _gpu.device_index(1) == 1
    del back, pinned
    gc.collect()
    _shm.forget_views()
    _gpu.poll()
    for ev in cuda.events:
        ev.done = True
    _gpu.poll()
    _gpu.REGISTRAR.wait_idle()  # unregistrations run on the registrar thread
    assert cuda.named("unregister") == [("unregister", m.base, 3)] and cuda.current == 0


def test_a_failed_registration_is_remembered_warned_and_counted(cuda: StandInCuda) -> None:
    """``ulimit -l`` reached: the failure is warned about once, counted (also in
    fastload.monitor's stats), the CUDA error cleared, and the block never tried again;
    its leases give their counts straight back (no copy can be reading it in place)."""
    cuda.register_rc = 2
    mon = fastload.monitor([1])
    back, block = received(seed=6)
    with pytest.warns(RuntimeWarning, match=r"cudaErrorStandIn \(2\).*ulimit -l"):
        assert not _shm.registered(back["npy"].data)
    for _ in range(3):  # every tensor of every batch asks: no new attempt, no warning
        assert not _shm.registered(back["npy"].data)
        assert not _shm.registered(back["cls"].offsets)
    other, _ = received(seed=7)  # another block: tried once, not warned again
    assert not _shm.registered(other["npy"].data)
    assert len(cuda.named("register")) == 2 and cuda.cleared == 2
    assert _gpu.COUNTERS.register_failed == 2 and _gpu.COUNTERS.registered == 0
    stats = mon.stats()
    assert stats["gpu/register_failed"] == 2 and stats["gpu/registered"] == 0
    m = _shm.mapped_of(back["npy"].data)
    assert m is not None and m.failed and not m.registered and not m.view.held
    del back
    gc.collect()
    assert block.users == 0


def test_unregistration_waits_for_copies_and_a_failure_keeps_the_mapping(
    cuda: StandInCuda,
) -> None:
    """A registered mapping let go of is unregistered only once an event recorded when
    it was let go of has completed (polled, not waited for) and no tensor is left over
    it; a failed cudaHostUnregister leaves it registered and mapped, warned about and
    counted, and is not tried again."""
    back, _ = received(seed=8)
    assert _shm.registered(back["npy"].data)
    m = _shm.mapped_of(back["npy"].data)
    assert m is not None
    old = back["npy"][0]  # a tensor of an exited worker's block, kept past its batch
    del back
    gc.collect()
    _shm.forget_views()  # the worker exited (or let the block go)
    assert m.registered and not cuda.named("unregister")
    _gpu.poll()
    assert m.registered and not cuda.named("unregister")  # its event is pending
    for ev in cuda.events:
        ev.done = True
    _gpu.poll()
    assert m.registered and not cuda.named("unregister")  # `old` may still be copied from
    del old
    gc.collect()
    _gpu.poll()  # its count retired behind a new event
    assert m.registered and m.view.users == 1
    cuda.events[-1].done = True
    _gpu.poll()  # due: unregistered on the registrar thread
    _gpu.REGISTRAR.wait_idle()
    assert not m.registered and not m.view.held and len(cuda.named("unregister")) == 1
    assert _gpu.COUNTERS.unregistered == 1 and m.view.users == 0

    cuda.unregister_rc = 1
    stuck_batch, _ = received(seed=9)
    assert _shm.registered(stuck_batch["npy"].data)
    s = _shm.mapped_of(stuck_batch["npy"].data)
    assert s is not None
    del stuck_batch
    gc.collect()
    _shm.forget_views()
    _gpu.poll()
    for ev in cuda.events:
        ev.done = True
    with pytest.warns(RuntimeWarning, match="cudaHostUnregister.*failed"):
        _gpu.poll()
        _gpu.REGISTRAR.wait_idle()
    assert s.registered and s.view.held and s in _gpu.STATE.stuck  # kept: never unmapped
    assert _gpu.COUNTERS.unregister_failed == 1 and cuda.cleared == 1
    _gpu.drain()
    assert len(cuda.named("unregister")) == 2  # not tried again


def test_fences_let_go_of_each_copy_when_it_completes() -> None:
    """One slow copy does not hold back the leases of later ones."""
    f = _gpu.Fences(max_pending=3)
    events = [StandInEvent([]) for _ in range(3)]
    kept = [object() for _ in range(3)]
    for e, k in zip(events, kept, strict=True):
        f.hold(e, k)
    events[1].done = True
    assert f.poll() == 2  # the second let go of, the first still running
    events[0].done = events[2].done = True
    assert f.poll() == 0


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    root = tmp_path_factory.mktemp("handoff")
    samples = make_samples(48, seed=48)
    paths = [write_tarfile(root / f"shard-{s}.tar", samples[s * 24 : (s + 1) * 24])
             for s in range(2)]
    fastload.ShardIndex.build(paths, root / "index.fidx")
    return root / "index.fidx", samples


def test_the_readme_loop_over_to_device(shards: tuple[Path, list[Sample]]) -> None:
    """docs/to-device.md's loop, with "meta" for "cuda" (a device whose tensors cannot be read
    back: any accessor that reached for one would fail): the packed fields stay on the
    host, every accessor works, and decode_images is handed the payloads' bytes."""
    path, samples = shards
    expect = dict(samples)
    loader = DataLoader(fastload.ShardIndexDataset(path, packed=True), batch_size=8,
                        num_workers=2, collate_fn=fastload.collate,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    seen = 0
    for batch in fastload.to_device(loader, "meta", prefetch=2):
        jpg = batch["jpg"]
        want = [expect[k]["jpg"] for k in batch.keys]
        assert jpg.data.device.type == "cpu"
        labels = batch["cls"].ints()
        assert labels.tolist() == [int(expect[k]["cls"]) for k in batch.keys]
        assert [p.numpy().tobytes() for p in device._payloads(jpg)] == want
        assert jpg.tolist() == want and jpg.to_bytes(1) == want[1]
        view = jpg.buffer(0)
        assert view is not None and bytes(view) == want[0]
        assert [(t.numpy().tobytes() if t is not None else None) for t in jpg] == want
        seen += len(batch)
    assert seen == len(samples)
    dicts = fastload.ShardIndexDataset(path).__getitems__([0, 1, 2])
    moved = device._move(fastload.collate(dicts, ints="cls"), torch.device("meta"), True)
    assert moved["cls"].device.type == "meta"  # a tensor field moves
    assert moved["jpg"].data.device.type == "cpu" and moved["jpg"].tolist() == [
        dict(samples)[d["__key__"]]["jpg"] for d in dicts]


def test_a_field_on_a_device_is_indexed_from_the_host() -> None:
    """``field.to(device)``: ``field[i]``, ``len``, ``nbytes`` and ``uniform_size`` come
    from bounds kept on the host (never a read of the device: "meta" has nothing to
    read), ``present`` stays on the host; ``buffer`` says what it needs."""
    samples = [{"__key__": str(i), "x": b"a" * (i + 1)} for i in range(5)]
    samples[2] = {"__key__": "2"}
    b = fastload.collate(samples, allow_missing=True)
    for f in (b["x"].to("meta"), b.to("meta")["x"]):
        assert isinstance(f, PackedField)
        assert f.data.device.type == "meta" and f.present is not None
        assert f.present.device.type == "cpu"
        assert len(f) == 5 and f.nbytes == 1 + 2 + 4 + 5
        t = f[3]
        assert t is not None and t.device.type == "meta" and t.shape == (4,)
        assert f[2] is None and f.missing(2) and f.uniform_size() is None
        with pytest.raises(ValueError, match=r"host memory, and this field is on meta"):
            f.buffer(0)
    same = fastload.collate([{"__key__": str(i), "x": b"abcd"} for i in range(3)])
    assert same["x"].to("meta").uniform_size() == 4


def test_decode_each_falls_back_per_image() -> None:
    """A batched decode that fails on one image: each image alone, the bad one on the
    fallback (the CPU), and one nothing decodes named."""
    good = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([7], dtype=torch.uint8),
            torch.tensor([3], dtype=torch.uint8)]
    calls: list[str] = []

    def batched(ps: list[Any]) -> list[Any]:
        calls.append("batched")
        if any(int(p[0]) == 7 for p in ps):
            raise RuntimeError("nvjpeg: unsupported JPEG")
        return [p * 2 for p in ps]

    def one(p: Any) -> Any:
        calls.append("one")
        if int(p[0]) == 7:
            raise RuntimeError("nvjpeg: unsupported JPEG")
        return p * 2

    def cpu(p: Any) -> Any:
        calls.append("cpu")
        if int(p[0]) == 9:
            raise ValueError("not an image")
        return p * 2

    out = device.decode_each(good, batched, one, cpu)
    assert [o.tolist() for o in out] == [[2, 4], [14], [6]]
    assert calls == ["batched", "one", "one", "cpu", "one"]
    assert [o.tolist() for o in device.decode_each(good[:1], batched, one, cpu)] == [[2, 4]]
    bad = [good[0], torch.tensor([9], dtype=torch.uint8)]
    with pytest.raises(ValueError, match=r"payload 1 \(1 bytes\).*not an image"):
        device.decode_each(bad, None, lambda p: one(torch.tensor([7])), cpu)


@pytest.mark.parametrize(("version", "lists"), [("0.18.1+cu121", False), ("0.19.0", True),
                                                ("0.21.0a0+git1", True), ("1.0", True)])
def test_batched_gpu_decode_needs_torchvision_0_19(
    monkeypatch: pytest.MonkeyPatch, version: str, lists: bool
) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(__version__=version))
    assert device._lists_on_cuda() is lists
