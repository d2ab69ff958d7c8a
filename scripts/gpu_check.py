"""The measurements of scripts/gpu-check.sh (issues 34, 48): packed JPEG batches through
DataLoader workers to the host and to the GPU, the machine's ceilings, and decode. Each
loader cell first runs an untimed epoch that checks the bytes (on the GPU: each copy
queued behind work and its batch dropped at once, compared after a synchronize) and
says whether the batches came in registered blocks; a wrong byte fails the run. Then
registrations per epoch and the main thread's milliseconds in them, persistent workers
on and off, pin_memory on and off."""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import tarfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import fastload

BATCH = 256
GB = 1e9


def jpegs(count: int, target: int) -> list[bytes]:
    """``count`` distinct JPEGs of about ``target`` bytes (noise, which compresses
    little): torchvision's encoder, else Pillow's, else random bytes (not decodable)."""
    g = torch.Generator().manual_seed(0)
    try:
        import torchvision.io as tvio

        def enc(img: torch.Tensor) -> bytes:
            return bytes(tvio.encode_jpeg(img, quality=90).numpy())
    except ImportError:
        try:
            from PIL import Image

            def enc(img: torch.Tensor) -> bytes:
                buf = io.BytesIO()
                Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, "JPEG", quality=90)
                return buf.getvalue()
        except ImportError:
            return [torch.randint(0, 256, (target,), generator=g, dtype=torch.uint8)
                    .numpy().tobytes() for _ in range(count)]
    side = 128
    for _ in range(6):  # size the image so its JPEG is about target bytes
        n = len(enc(torch.randint(0, 256, (3, side, side), generator=g, dtype=torch.uint8)))
        side = max(16, int(side * (target / n) ** 0.5))
    return [enc(torch.randint(0, 256, (3, side, side), generator=g, dtype=torch.uint8))
            for _ in range(count)]


def write_shards(root: Path, shards: int, per: int, kb: int) -> tuple[Path, list[bytes]]:
    """The index, and the images: sample i of shard s (key "ssss_iiiiii") holds
    ``images[(s * per + i) % len(images)]``."""
    root.mkdir(parents=True, exist_ok=True)
    images = jpegs(64, kb * 1000)
    paths = []
    for s in range(shards):
        p = root / f"shard-{s:06d}.tar"
        with tarfile.open(p, "w", format=tarfile.GNU_FORMAT) as tf:
            for i in range(per):
                for ext, data in (("jpg", images[(s * per + i) % len(images)]),
                                  ("cls", str(i % 1000).encode())):
                    ti = tarfile.TarInfo(f"{s:04d}_{i:06d}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        paths.append(str(p))
    index = root / "index.fidx"
    fastload.ShardIndex.build(paths, index)
    size = sum(len(x) for x in images) / len(images)
    print(f"shards: {shards} x {per} samples, JPEGs of {size / 1000:.0f} KB on average")
    return index, images


def loader(index: Path, workers: int, pin: bool, persistent: bool = True) -> DataLoader[Any]:
    ds = fastload.ShardIndexDataset(index, packed=True)
    return DataLoader(ds, batch_size=BATCH, shuffle=True, collate_fn=fastload.collate,
                      num_workers=workers, pin_memory=pin, persistent_workers=persistent,
                      multiprocessing_context=multiprocessing.get_context("fork"))


class Expect:
    """The JPEG bytes each key of the shards holds."""

    def __init__(self, images: list[bytes], per: int) -> None:
        self.images, self.per = images, per

    def __call__(self, keys: list[str]) -> bytes:
        out = []
        for k in keys:
            s, i = (int(x) for x in k.split("_"))
            out.append(self.images[(s * self.per + i) % len(self.images)])
        return b"".join(out)


def _copy(b: Any, mode: str) -> Any:
    """What a cell copies to the GPU: the whole batch (``b.to``), or, after to_device
    (packed fields stay on the host), a plain copy of the JPEG block, which fastload
    does not see."""
    if mode == "to":
        return b.to("cuda", non_blocking=True)["jpg"].data
    return b["jpg"].data.cuda(non_blocking=True)


def check(dl: Any, mode: str, expect: Expect) -> tuple[str, bool]:
    """One untimed epoch (workers started, blocks mapped and registered) checking every
    byte: on the host as received; on the GPU each copy queued behind work with its
    batch dropped at once (a block given back too early is rewritten under the copy),
    compared after a synchronize. (the cell's note, whether every byte was right)"""
    from fastload.data import _gpu, _shm

    bad = batches = 0
    copies = []
    failed = _gpu.COUNTERS.register_failed
    it = fastload.to_device(dl, "cuda") if mode == "to_device" else dl
    for b in it:
        want = expect(b.keys)
        batches += 1
        if mode == "host":
            bad += b["jpg"].data.numpy().tobytes() != want
        else:
            torch.cuda._sleep(2_000_000)
            copies.append((want, _copy(b, mode)))
        del b
    if copies:
        torch.cuda.synchronize()
        bad += sum(g.cpu().numpy().tobytes() != want for want, g in copies)
        del copies
    note = "bytes ok" if not bad else f"WRONG BYTES in {bad} of {batches} batches"
    if mode != "host":
        pids = {w.pid for w in getattr(dl._iterator, "_workers", [])}
        mine = [m for (pid, _), m in list(_shm._views.items()) if pid in pids]
        reg = sum(m.registered for m in mine)
        note += f", registered blocks {reg}/{len(mine)}"
        if _gpu.COUNTERS.register_failed > failed:
            note += f" ({_gpu.COUNTERS.register_failed - failed} registrations FAILED)"
    return note, not bad


def epochs(dl: Any, mode: str, count: int, expect: Expect) -> tuple[float, float, float, str,
                                                                     bool]:
    """(samples/s, GB/s, main-process CPU us per batch) over ``count`` epochs, after the
    untimed epoch of :func:`check` (its note and verdict follow)."""
    cuda = mode != "host"

    def one() -> tuple[int, int, int]:
        host = [0]  # bytes counted on the host side (nbytes of a GPU batch would sync)

        def counted() -> Any:
            for b in dl:
                host[0] += b.nbytes
                yield b

        n = batches = 0
        it = fastload.to_device(counted(), "cuda") if mode == "to_device" else counted()
        for b in it:
            if cuda:
                _copy(b, mode)
            n += len(b)
            batches += 1
        if cuda:
            torch.cuda.synchronize()
        return n, host[0], batches

    note, ok = check(dl, mode, expect)
    t0, c0 = time.perf_counter(), time.process_time()
    n = nbytes = batches = 0
    for _ in range(count):
        a, b, c = one()
        n, nbytes, batches = n + a, nbytes + b, batches + c
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return n / wall, nbytes / wall / GB, cpu / batches * 1e6, note, ok


def table(index: Path, workers: list[int], count: int, cuda: bool, expect: Expect) -> bool:
    """The table; False if a cell copied a wrong byte."""
    modes = ["host"] + (["to", "to_device"] if cuda else [])
    heads = {"host": "pin_memory=False",
             "to": 'pin_memory=True, b.to("cuda", non_blocking=True)',
             "to_device": "pin_memory=True, fastload.to_device(loader, 'cuda'), "
                          "b['jpg'].data.cuda(non_blocking=True)"}
    good = True
    print("\n| workers | " + " | ".join(heads[m] for m in modes) + " |")
    print("|---|" + "---|" * len(modes))
    for w in workers:
        cells = []
        for m in modes:
            dl = loader(index, w, pin=m != "host")
            rate, gbs, cpu, note, ok = epochs(dl, m, count, expect)
            good = good and ok
            cells.append(f"{rate / 1000:.0f}k/s ({gbs:.2f} GB/s), main {cpu:.0f} us/batch; "
                         + note)
            del dl
        print(f"| {w} | " + " | ".join(cells) + " |", flush=True)
    return good


def churn(index: Path, workers: int, count: int) -> None:
    """Registrations per epoch, with persistent workers and without, pin_memory on and
    off, each batch moved by ``b.to("cuda", non_blocking=True)`` (to_device leaves the
    packed JPEG field on the host: nothing there would ask for a registration): blocks
    registered (of them on the registrar thread) and unregistered, the milliseconds in
    cudaHostRegister (any thread), the main thread's milliseconds registering,
    unregistering or waiting for either, and tensors copied before their block's
    registration completed (copied from pageable memory)."""
    from fastload.data import _gpu, _shm

    print(f"\nregistration per epoch ({workers} workers, {count} epochs; +registered "
          "(on the registrar) / -unregistered, ms in cudaHostRegister, main-thread ms, "
          "copies before registration):")
    print("\n| pin_memory | persistent_workers | " + " | ".join(
        f"epoch {e}" for e in range(count)) + " |")
    print("|---|---|" + "---|" * count)
    for pin in (False, True):
        for persistent in (True, False):
            _gpu.drain()
            _shm.forget_views()
            _gpu.drain()
            dl = loader(index, workers, pin, persistent)
            cells = []
            for _ in range(count):
                before = _gpu.COUNTERS.snapshot()
                for b in dl:
                    b.to("cuda", non_blocking=True)
                    del b
                torch.cuda.synchronize()
                _gpu.drain()
                now = _gpu.COUNTERS.snapshot()
                d = {k: now[k] - before[k] for k in now}
                main_ms = d["register_main_ms"] + d["unregister_main_ms"]
                cells.append(f"+{d['registered']:.0f} ({d['registered_behind']:.0f}) / "
                             f"-{d['unregistered']:.0f}, {d['register_ms']:.1f} ms, main "
                             f"{main_ms:.1f} ms, {d['pending_copies']:.0f} early")
            del dl
            print(f"| {pin} | {persistent} | " + " | ".join(cells) + " |", flush=True)


def h2d_ceiling() -> None:
    size = 256 << 20
    src = torch.empty(size, dtype=torch.uint8).pin_memory()
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rate = 10 * size / (time.perf_counter() - t0) / GB
    print(f"pinned host-to-GPU copy (256 MiB): {rate:.1f} GB/s")
    from fastload import _core
    from fastload.data import _gpu, _shm

    block = _core.ShmBlock(size)
    m = _shm._Mapped(_core.ShmView(os.dup(block.fd), block.length), 0)
    t = torch.frombuffer(m.view.adopt(), dtype=torch.uint8)
    m.base = t.data_ptr() - 64
    t0 = time.perf_counter()
    ok = _shm.register_host(m)
    reg = time.perf_counter() - t0
    dst.copy_(t[:size], non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(t[:size], non_blocking=True)
    torch.cuda.synchronize()
    print(f"registered shared-memory block (256 MiB, registered={ok} in {reg * 1000:.1f} ms, "
          f"is_pinned={t.is_pinned()}): {10 * size / (time.perf_counter() - t0) / GB:.1f} GB/s")
    _shm.release_host(m)
    _gpu.drain()


class Tensors(torch.utils.data.Dataset[Any]):
    """torch's own path: each batch a fresh uint8 tensor of ``nbytes`` per 256 samples."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n, self.nbytes = n, nbytes

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, ix: list[int]) -> torch.Tensor:
        return torch.ones(self.nbytes * len(ix) // BATCH, dtype=torch.uint8)


def _first(b: Any) -> Any:
    return b


def torch_epochs(dl: Any, count: int) -> tuple[float, float]:
    """(GB/s into the GPU, main-process CPU us per batch) of torch's own pin path."""
    for _ in dl:  # workers started
        pass
    t0, c0 = time.perf_counter(), time.process_time()
    nbytes = batches = 0
    for _ in range(count):
        for b in dl:
            b.to("cuda", non_blocking=True)
            nbytes += b.numel()
            batches += 1
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return nbytes / wall / GB, cpu / batches * 1e6


def torch_path(samples: int, workers: list[int], count: int) -> None:
    for w in workers:
        dl = DataLoader(Tensors(samples, 16 << 20), batch_size=BATCH, num_workers=w,
                        collate_fn=_first, pin_memory=True, persistent_workers=True,
                        multiprocessing_context=multiprocessing.get_context("fork"))
        gbs, cpu = torch_epochs(dl, count)
        print(f"torch's own pin path, 16 MiB uint8 batches, {w} workers: {gbs:.2f} GB/s "
              f"into the GPU, main {cpu:.0f} us/batch")


def decode(index: Path) -> None:
    ds = fastload.ShardIndexDataset(index, packed=True)
    b = ds.__getitems__(list(range(BATCH)))
    try:
        import torchvision.io as tvio
    except ImportError:
        print("decode: torchvision not installed (nvJPEG not measured)")
        return
    fastload.decode_images(b["jpg"], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fastload.decode_images(b["jpg"], device="cuda")
    torch.cuda.synchronize()
    gpu = 5 * BATCH / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(64):
        tvio.decode_image(b["jpg"][i], mode=tvio.ImageReadMode.RGB)
    cpu = 64 / (time.perf_counter() - t0)
    print(f"decode of {BATCH} JPEGs: nvJPEG batched {gpu:,.0f} images/s; "
          f"torchvision CPU, one core {cpu:,.0f} images/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", type=Path, required=True, help="a scratch folder")
    ap.add_argument("--samples", type=int, default=6000, help="samples in all (6 shards)")
    ap.add_argument("--kb", type=int, default=63, help="JPEG size")
    ap.add_argument("--workers", default="2,4,8,14")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per cell")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    print(f"fastload {fastload.__version__}, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, {torch.cuda.get_device_name() if cuda else 'no CUDA'}")
    index, images = write_shards(a.work / "shards", 6, a.samples // 6, a.kb)
    workers = [int(w) for w in a.workers.split(",")]
    good = table(index, workers, a.epochs, cuda, Expect(images, a.samples // 6))
    if cuda:
        from fastload.data import _gpu

        c = _gpu.COUNTERS
        print(f"\nregistration: {c.registered} blocks in {c.register_ms:.0f} ms "
              f"({c.register_failed} failed), {c.unregistered} unregistered in "
              f"{c.unregister_ms:.0f} ms ({c.unregister_failed} failed); {c.retired} lease "
              f"counts held back for copies, {c.fence_waits} waits; the main thread "
              f"{c.register_main_ms + c.unregister_main_ms:.1f} ms in them")
        churn(index, workers[0], 3)
        print()
        h2d_ceiling()
        torch_path(a.samples, [w for w in workers if w in (4, 8)] or workers[:1], a.epochs)
        decode(index)
    print(f"\ngpu-check: done in {time.perf_counter() - t0:.0f} s")
    if not good:
        raise SystemExit("gpu-check: FAILED: a loader cell delivered wrong bytes (above)")


if __name__ == "__main__":
    main()
