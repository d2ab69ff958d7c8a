"""A recording stand-in for CUDA (``_gpu.CUDA``) and the fixture that puts it there:
registration that succeeds, fails or waits on request, a current device per thread,
events that complete when the test says so. Used by test_gpu_handoff.py and
test_gpu_registrar.py; torch, the blocks, workers and fork stay real."""

from __future__ import annotations

import contextlib
import gc
import importlib
import pickle
import threading
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest

import fastload
from fastload import PackedBatch
from fastload.data import _gpu, _shm


class StandInEvent:
    """An event recorded on ``streams``: done when the test says so (or waited for)."""

    def __init__(self, streams: list[Any]) -> None:
        self.streams = streams
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class StandInCuda:
    """``_gpu.Cuda``'s calls, recorded with the device current at each (per thread, as
    CUDA's), and in ``threads`` with the thread that made each. ``gate``: registrations
    wait until it is set (a registration that takes as long as the test says)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.calls: list[tuple[Any, ...]] = []
        self.threads: list[tuple[str, str]] = []  # (call, thread name)
        self.gate: threading.Event | None = None
        self.events: list[StandInEvent] = []
        self.register_rc = 0
        self.unregister_rc = 0
        self.cleared = 0

    def available(self) -> bool:
        return True

    @property
    def current(self) -> int:
        return int(getattr(self._local, "current", 0))

    @current.setter
    def current(self, index: int) -> None:
        self._local.current = index

    def current_device(self) -> int:
        self.calls.append(("current_device",))
        return self.current

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        before, self.current = self.current, index
        try:
            yield
        finally:
            self.current = before

    def host_register(self, base: int, length: int) -> int:
        self.calls.append(("register", base, length, self.current))
        self.threads.append(("register", threading.current_thread().name))
        if self.gate is not None and not self.gate.wait(60):
            raise AssertionError("the test never let the registration finish")
        return self.register_rc

    def host_unregister(self, base: int) -> int:
        self.calls.append(("unregister", base, self.current))
        self.threads.append(("unregister", threading.current_thread().name))
        return self.unregister_rc

    def clear_error(self) -> int:
        self.cleared += 1
        return 0

    def error_name(self, rc: int) -> str:
        return f"cudaErrorStandIn ({rc})"

    stream = 0  # the id of this thread's current stream, as the test sets it

    def current_stream(self, device: int) -> tuple[int, int, int]:
        return (device, self.stream, 1)

    def stream_key(self, stream: Any) -> tuple[int, int, int]:
        return tuple(stream)

    def record(self, streams: Any) -> StandInEvent:
        ev = StandInEvent(list(streams))
        self.events.append(ev)
        return ev

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == name]


@pytest.fixture(name="cuda")
def standin_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInCuda]:
    """The stand-in in ``_gpu.CUDA``, this process's hand-off state fresh, and collate
    allocating in a block pool as in a DataLoader worker (this process receives its own
    batches, mapping its blocks by (pid, inode))."""
    stand = StandInCuda()
    monkeypatch.setattr(_gpu, "CUDA", stand)
    monkeypatch.setattr(_gpu, "COUNTERS", _gpu.Counters())
    monkeypatch.setattr(importlib.import_module("fastload.data.collate"), "_in_worker",
                        lambda: True)
    _gpu.STATE.__init__()  # type: ignore[misc]
    _shm.forget_views()
    yield stand
    if stand.gate is not None:
        stand.gate.set()
    for ev in stand.events:
        ev.done = True
    _shm.forget_views()
    _gpu.drain()
    _gpu.STATE.__init__()  # type: ignore[misc]


def received(n: int = 8, size: int = 20_000, seed: int = 1) -> tuple[PackedBatch, Any]:
    """A batch sent and received through the pickler DataLoader uses, and its block."""
    samples = [{"__key__": f"k{i}", "npy": bytes([seed + i]) * size, "cls": str(i).encode()}
               for i in range(n)]
    sent = fastload.collate(samples)
    block = _shm._worker_pool().block_of(sent["npy"].data.untyped_storage())
    assert block is not None
    back = pickle.loads(ForkingPickler.dumps(sent))
    del sent
    gc.collect()
    return back, block
