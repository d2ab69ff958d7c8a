"""Registration churn of the GPU hand-off without a GPU (issue 48, item 4): CUDA
registrations and unregistrations per epoch, and the main thread's milliseconds in them,
for persistent workers on and off and pin_memory on and off.

CUDA is a stand-in (``_gpu.CUDA``, the seam every CUDA call of data/_gpu.py goes
through): cudaHostRegister sleeps ``--register-ms`` and cudaHostUnregister
``--unregister-ms`` (a simulated cost: the real one is measured on a GPU by
tests/gpu/test_gpu.py::test_registration_over_epochs and scripts/gpu-check.sh), events
complete at once. Everything else is real: DataLoader with forked workers, their
shared-memory blocks, the main process's mappings and lease counts.

Each step does the main process's side of ``b.to("cuda", non_blocking=True)`` (every
tensor's copy asked for: ``_shm.before_copies``, or on a build without it what its
``copy_to`` did before the copies, then ``_gpu.poll``). pin_memory on: a thread takes
the batches from the loader and pins them (``b.pin_memory()``), as DataLoader's pin
thread does (torch runs none without an accelerator). Main-thread ms: the time the main
thread spent inside ``_gpu.register`` and ``_gpu._unregister`` (wrapped here), whatever
the build. "early": tensors copied before their block's registration completed (read
as pageable memory; a build with the registrar only).

    PYTHONPATH=BUILD/python python benchmarks/gpu_churn.py [--epochs 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import queue
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import fastload
from fastload.data import _gpu, _shm, device


class _Event:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class StandIn(_gpu.Cuda):  # type: ignore[misc, unused-ignore]
    """CUDA with a registration that costs what it is told, events done at once."""

    def __init__(self, register_ms: float, unregister_ms: float) -> None:
        self.register_s, self.unregister_s = register_ms / 1000, unregister_ms / 1000

    def available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device(self, index: int) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def host_register(self, base: int, length: int) -> int:
        time.sleep(self.register_s)
        return 0

    def host_unregister(self, base: int) -> int:
        time.sleep(self.unregister_s)
        return 0

    def clear_error(self) -> int:
        return 0

    def current_stream(self, device: int) -> tuple[int, int, int]:
        return (device, 0, 1)

    def stream_key(self, stream: Any) -> tuple[int, int, int]:
        return tuple(stream)  # type: ignore[return-value]

    def record(self, streams: Any) -> _Event:
        return _Event()


MAIN_MS = [0.0]


def _timed(fn: Any) -> Any:
    def wrapper(*a: Any, **k: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return fn(*a, **k)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            MAIN_MS[0] += (time.perf_counter() - t0) * 1000

    return wrapper


def _shards(root: Path, n: int, size: int) -> Path:
    paths = []
    for s in range(2):
        p = root / f"shard-{s}.tar"
        with tarfile.open(p, "w") as tf:
            for i in range(s * n // 2, (s + 1) * n // 2):
                for ext, data in (("npy", bytes([i % 251]) * size), ("cls", str(i).encode())):
                    info = tarfile.TarInfo(f"s{i:06d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(p)
    fastload.ShardIndex.build(paths, root / "index.fidx")
    return root / "index.fidx"


def _pinned(loader: DataLoader) -> Iterator[Any]:
    """The batches pinned on a thread of their own, as DataLoader's pin thread does."""
    q: queue.Queue[Any] = queue.Queue(maxsize=2)

    def run() -> None:
        for b in loader:
            q.put(b.pin_memory())
        q.put(None)

    threading.Thread(target=run, daemon=True).start()
    while (b := q.get()) is not None:
        yield b


def _host_side(b: Any, dev: torch.device) -> None:
    tensors = list(device.tensors_of(b))
    if hasattr(_shm, "before_copies"):
        _shm.before_copies(tensors, dev)
    elif any([_shm.registered(t, dev) for t in tensors]):  # copy_to before item 4
        _gpu.note_streams()
    _gpu.poll()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=960)
    ap.add_argument("--kb", type=int, default=20)
    ap.add_argument("--register-ms", type=float, default=5.0)
    ap.add_argument("--unregister-ms", type=float, default=1.0)
    args = ap.parse_args()
    _gpu.CUDA = StandIn(args.register_ms, args.unregister_ms)
    _gpu.register = _timed(_gpu.register)
    _gpu._unregister = _timed(_gpu._unregister)
    dev = torch.device("cuda", 0)
    print(f"stand-in CUDA: register {args.register_ms} ms, unregister {args.unregister_ms} "
          f"ms; {args.samples} samples of {args.kb} KB, batch 16, {args.workers} workers")
    with tempfile.TemporaryDirectory() as tmp:
        path = _shards(Path(tmp), args.samples, args.kb << 10)
        for pin in (False, True):
            for persistent in (True, False):
                _gpu.drain()
                _shm.forget_views()
                _gpu.drain()
                loader = DataLoader(
                    fastload.ShardIndexDataset(path, packed=True), batch_size=16,
                    num_workers=args.workers, collate_fn=fastload.collate,
                    persistent_workers=persistent,
                    multiprocessing_context=multiprocessing.get_context("fork"))
                cells = []
                for _ in range(args.epochs):
                    before, ms0 = _gpu.COUNTERS.snapshot(), MAIN_MS[0]
                    for b in (_pinned(loader) if pin else loader):
                        _host_side(b, dev)
                        del b
                    now = _gpu.COUNTERS.snapshot()
                    d = {k: now[k] - before.get(k, 0.0) for k in now}
                    early = d.get("pending_copies")
                    cells.append(f"+{d['registered']:.0f}/-{d['unregistered']:.0f}, "
                                 f"main {MAIN_MS[0] - ms0:.1f} ms"
                                 + ("" if early is None else f", {early:.0f} early"))
                del loader
                print(f"| pin_memory={pin} | persistent_workers={persistent} | "
                      + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
