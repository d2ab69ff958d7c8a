"""Registration off the loop's path (issue 48, item 4), with the stand-in for CUDA
(cuda_standin.py: a registration holds until the test lets it finish, each call is
recorded with its thread). A copy never waits for a registration: the block is
registered on the registrar thread, and meanwhile its batch is copied as an unregistered
one and its count held as a registered one's; pin() waits for it; a block let go of
while its registration is queued or running is skipped or unregistered after it; over
epochs, with persistent workers and without, the main thread makes no CUDA
registration call, and forked workers of a new epoch claim the blocks of the exited
ones (registered once); spawned workers make their own."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import threading
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from cuda_standin import StandInCuda, received, standin_cuda  # noqa: E402, F401
from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload.data import _gpu, _shm, device  # noqa: E402
from kit.shards import make_samples, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native
CUDA0 = torch.device("cuda", 0)
REGISTRAR = "fastload-cuda-registrar"


def _until(check: object, what: str) -> None:
    """Waits (a minute at most) for ``check()``: a thread's progress, not a timing."""
    deadline = time.monotonic() + 60
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.005)


def test_a_copy_never_waits_for_a_registration(cuda: StandInCuda) -> None:
    """The first copy from a block asks for its registration and goes on while it runs
    (the registrar is held inside cudaHostRegister until the end): the batch is copied
    as an unregistered one; its count, dropped meanwhile, is held as a registered
    block's (a copy may have found the registration complete). Blocks mapped after
    that are registered as they arrive, with no copy asking, on the registrar thread."""
    cuda.gate = threading.Event()
    back, block = received(seed=21)
    ts = [back["npy"].data, back["npy"].offsets]
    _shm.before_copies(ts, CUDA0)  # what copy_to does before issuing the copies
    m = _shm.mapped_of(ts[0])
    assert m is not None and m.pending and not m.registered and m.view.held
    _until(lambda: cuda.threads, "the registrar's call")
    assert cuda.threads == [("register", REGISTRAR)] and not cuda.gate.is_set()
    assert not _shm.registered(ts[0], CUDA0, wait=False)  # still running: not waited for
    assert _gpu.COUNTERS.pending_copies == 3
    del back, ts
    gc.collect()
    assert block.users == 1  # retired, not given back
    cuda.gate.set()
    _gpu.REGISTRAR.wait_idle()
    assert m.registered and not m.pending and m.device == 0
    _gpu.poll()
    cuda.events[-1].done = True
    _gpu.poll()
    assert block.users == 0
    kept, _ = received(seed=22)  # in the first block again
    fresh, _ = received(seed=23)  # a new block: registered as it is mapped
    _gpu.REGISTRAR.wait_idle()
    f = _shm.mapped_of(fresh["npy"].data)
    assert f is not None and f.registered and f is not m
    assert _shm.registered(fresh["npy"].data, CUDA0, wait=False)
    assert cuda.threads == [("register", REGISTRAR)] * 2
    c = _gpu.COUNTERS
    assert (c.registered, c.registered_behind, c.register_main_ms) == (2, 2, 0.0)
    del kept, fresh


def test_pin_waits_for_the_registration_under_way(cuda: StandInCuda) -> None:
    """pin_memory() (DataLoader's pin thread) returns page-locked memory: for a block
    the registrar is registering, it waits for that registration (one call, not two)
    and returns the block itself (without CUDA, a pinned copy would fail)."""
    cuda.gate = threading.Event()
    back, _ = received(seed=24)
    _shm.before_copies([back["npy"].data], CUDA0)
    _until(lambda: cuda.threads, "the registrar's call")
    out = {}

    def pin() -> None:
        out["pinned"] = back.pin_memory()

    asked = len(cuda.named("current_device"))
    t = threading.Thread(target=pin, name="pin")
    t.start()
    # pin() past its look at the block (it asks for the current device next): the
    # registration is still under way, so it must wait for it.
    _until(lambda: len(cuda.named("current_device")) > asked, "pin() under way")
    cuda.gate.set()
    t.join(60)
    pinned = out["pinned"]
    assert pinned["npy"].data.data_ptr() == back["npy"].data.data_ptr()  # no copy
    assert len(cuda.named("register")) == 1 and cuda.threads == [("register", REGISTRAR)]


def test_a_block_let_go_of_while_its_registration_is_queued(cuda: StandInCuda) -> None:
    """Both blocks let go of (their worker exited) while the registrar is inside the
    first one's registration, the second queued behind: the second is never registered,
    the first is unregistered after its registration, once its copies are done, and only
    then unmapped; both blocks' counts go back."""
    cuda.gate = threading.Event()
    a, block_a = received(seed=25)
    _shm.before_copies([a["npy"].data], CUDA0)
    _until(lambda: cuda.threads, "the registrar's call")
    b, block_b = received(seed=26)  # a new block (a holds the first), queued
    ma, mb = _shm.mapped_of(a["npy"].data), _shm.mapped_of(b["npy"].data)
    assert ma is not None and mb is not None and ma.pending and mb.pending
    del a, b
    gc.collect()
    _shm.forget_views()
    assert ma.dropped and mb.dropped
    cuda.gate.set()
    _gpu.REGISTRAR.wait_idle()
    assert ma.registered and not mb.registered and not mb.pending
    assert cuda.named("register") == [("register", ma.base, ma.length, 0)]
    _gpu.poll()  # the retired counts behind an event
    for ev in cuda.events:
        ev.done = True
    _gpu.poll()  # given back; ma due: unregistered on the registrar
    _gpu.REGISTRAR.wait_idle()
    assert [c[0] for c in cuda.calls if c[0] != "current_device"] == ["register", "unregister"]
    assert cuda.named("unregister") == [("unregister", ma.base, 0)]
    assert cuda.threads == [("register", REGISTRAR), ("unregister", REGISTRAR)]
    assert not ma.registered and not mb.view.held
    assert (block_a.users, block_b.users) == (0, 0)


def test_a_drop_waits_for_nothing_and_lookups_take_no_lock(cuda: StandInCuda) -> None:
    """Letting go of a registered mapping while copies from it are pending waits for
    none of them (an event is recorded, none synchronized), and mapped_of answers while
    another thread holds the mappings' lock."""
    back, _ = received(seed=31)
    assert _shm.registered(back["npy"].data)
    x = back["npy"].data
    m = _shm.mapped_of(x)
    del back
    gc.collect()
    _gpu.poll()  # the batch's retired count behind a pending event
    locked, done = threading.Event(), threading.Event()

    def hold() -> None:
        with _shm._lock:
            locked.set()
            done.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    assert locked.wait(60)
    assert _shm.mapped_of(x) is m
    done.set()
    t.join(60)
    _shm.forget_views()
    assert cuda.events and not any(ev.done for ev in cuda.events)  # nothing waited for
    assert m.registered and m.dropped and not cuda.named("unregister")
    del x


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("registrar")
    samples = make_samples(96, seed=96)
    paths = [write_tarfile(root / f"shard-{s}.tar", samples[s * 48 : (s + 1) * 48])
             for s in range(2)]
    fastload.ShardIndex.build(paths, root / "index.fidx")
    return root / "index.fidx", {k: v["jpg"] for k, v in samples}


def _loader(path: Path, persistent: bool, method: str = "fork", workers: int = 2) -> DataLoader:
    return DataLoader(fastload.ShardIndexDataset(path, packed=True), batch_size=8,
                      num_workers=workers, collate_fn=fastload.collate,
                      persistent_workers=persistent,
                      multiprocessing_context=multiprocessing.get_context(method))


def _epochs(cuda: StandInCuda, loader: DataLoader, expect: dict[str, bytes], count: int = 3,
            held: list[Any] | None = None) -> list[dict[str, float]]:
    """``count`` epochs of ``b.to("cuda")``'s host side (each batch's copies asked for,
    polled; the stand-in's copies complete at once), every batch's bytes checked; the
    first batch kept in ``held``. The counters' change per epoch."""
    per_epoch = []
    for _ in range(count):
        before = _gpu.COUNTERS.snapshot()
        n = 0
        for b in loader:
            _shm.before_copies(list(device.tensors_of(b)), CUDA0)
            assert b["jpg"].tolist() == [expect[k] for k in b.keys]
            n += len(b)
            if held is not None and not held:
                held.append((b, b["jpg"].tolist()))
            del b
            _gpu.poll()
            for ev in cuda.events:
                ev.done = True
        assert n == len(expect)
        _gpu.REGISTRAR.wait_idle()
        now = _gpu.COUNTERS.snapshot()
        per_epoch.append({k: now[k] - before[k] for k in now})
    return per_epoch


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "new-workers"])
def test_no_registration_on_the_main_thread_over_epochs(
    cuda: StandInCuda, shards: tuple[Path, dict[str, bytes]], persistent: bool
) -> None:
    """Three epochs, 2 forked workers, the first epoch's first batch held to the end.
    Every cudaHostRegister and cudaHostUnregister runs on the registrar thread, none on
    the main thread. Blocks outlive their workers: with new workers each epoch as with
    persistent ones, the blocks are registered in the first epoch only and none is
    unregistered (the new workers claim the blocks the exited ones wrote); every batch
    holds its own bytes, the held one too (its block is not written while it is held)."""
    path, expect = shards
    held: list[Any] = []
    per_epoch = _epochs(cuda, _loader(path, persistent), expect, held=held)
    (first, was), = held
    assert first["jpg"].tolist() == was
    m = _shm.mapped_of(first["jpg"].data)
    assert m is not None and m.registered
    assert cuda.threads and all(t == REGISTRAR for _, t in cuda.threads)
    assert all(e["register_main_ms"] == 0 and e["unregister_main_ms"] == 0 for e in per_epoch)
    assert all(e["registered"] == e["registered_behind"] for e in per_epoch)
    assert per_epoch[0]["registered"] > 0
    assert per_epoch[1]["registered"] + per_epoch[2]["registered"] < \
        per_epoch[0]["registered"]
    assert all(e["unregistered"] == 0 for e in per_epoch)


def test_workers_started_by_spawn_make_their_own_blocks(
    cuda: StandInCuda, shards: tuple[Path, dict[str, bytes]]
) -> None:
    """A spawned worker inherits no descriptor: each epoch's worker makes its blocks,
    registered anew, and the earlier worker's blocks, kept for a claim that does not
    come, stay registered until let go of; every batch holds its own bytes."""
    path, expect = shards
    per_epoch = _epochs(cuda, _loader(path, False, "spawn", workers=1), expect, count=2)
    assert per_epoch[0]["registered"] > 0 and per_epoch[1]["registered"] > 0
    spares = [m for m in _shm._spare.values() if m.registered]
    assert spares and all(m.view.owner == 0 for m in spares)
    _shm.forget_views()
    _gpu.drain()
    assert not any(m.registered for m in spares)


def _worker(claim: bool, seed: int, send: bool = True) -> tuple[int, Any]:
    """A DataLoader worker's part, in a process forked from here: it packs a batch
    (claiming a spare block first where ``claim``, else making its own, as a spawned
    worker does), hands it over unless ``send`` is False, and exits. (its pid, the
    batch received here or None)"""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()

    def run() -> None:
        if not claim:
            _shm._inherited.clear()
        samples = [{"__key__": f"k{i}", "npy": bytes([seed]) * 30_000} for i in range(8)]
        sent = fastload.collate(samples)
        if send:
            theirs.send_bytes(bytes(ForkingPickler.dumps(sent)))
            theirs.recv()  # alive until the block's descriptor has been taken
        else:
            theirs.send_bytes(b"")

    p = ctx.Process(target=run)
    p.start()
    data = ours.recv_bytes()
    batch = pickle.loads(data) if data else None
    ours.send(None)
    p.join(60)
    assert p.exitcode == 0
    assert p.pid is not None
    return p.pid, batch


def _copies_done(cuda: StandInCuda) -> None:
    """Retired counts behind an event, the stand-in's copies complete, counts back."""
    _gpu.poll()
    for ev in cuda.events:
        ev.done = True
    _gpu.poll()


def test_spares_over_generations_of_workers(cuda: StandInCuda) -> None:
    """A block of an exited worker is kept registered, freed, and claimed by a worker
    forked later: its batch arrives under the new worker's name, in the same mapping (no
    new registration). A spare no worker claims through two generations of workers is
    let go of (unregistered once its copies are done); one claimed by a worker that died
    before handing it over is freed again."""
    _, first = _worker(claim=True, seed=1)
    assert _shm.registered(first["npy"].data)  # this process registers blocks from now on
    x = _shm.mapped_of(first["npy"].data)
    assert x is not None and x.fd >= 0
    del first
    gc.collect()
    _copies_done(cuda)  # the block's count back: free to write
    _shm._before_fork()  # the worker has exited: its block kept, freed
    assert _shm._spare == {x.key[1]: x} and x.view.owner == 0 and x.registered
    _, second = _worker(claim=True, seed=2)  # claims it
    assert second["npy"].tolist() == [bytes([2]) * 30_000] * 8
    assert _shm.mapped_of(second["npy"].data) is x and x.key[0] != os.getpid()
    assert not _shm._spare and len(cuda.named("register")) == 1
    del second
    gc.collect()
    _copies_done(cuda)
    _shm._before_fork()
    assert list(_shm._spare.values()) == [x]
    _worker(claim=True, seed=3, send=False)  # claims x, dies with it
    assert x.view.owner not in (0, os.getpid())
    for seed in (4, 5, 6):  # generations that make their own blocks (spawned workers)
        _, own = _worker(claim=False, seed=seed)
        assert _shm.mapped_of(own["npy"].data) is not x
        del own
        gc.collect()
        _shm._before_fork()
        if seed < 6:  # freed again when the worker that claimed it is seen dead
            assert x in _shm._spare.values() and x.view.owner == 0 and not x.dropped
    assert x not in _shm._spare.values() and x.dropped  # unclaimed for two generations
    _copies_done(cuda)
    _gpu.REGISTRAR.wait_idle()
    assert not x.registered and ("unregister", x.base, 0) in cuda.calls
    assert len(_shm._spare) == 2  # the last two generations' blocks
