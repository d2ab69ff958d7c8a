"""Packed batches to a CUDA device (issues 34 and 48): worker blocks registered in place,
so pin_memory() copies nothing; a block goes back to its worker only once every copy
issued from it has completed, whatever issued it (the race probe); to_device's
side-stream prefetch, packed fields left on the host; docs/to-device.md's loop verbatim;
registration counted over epochs (persistent workers and pin_memory on and off: none on
the main thread, blocks kept for the next workers); decode_images with nvJPEG from a worker's block.
Every test here needs CUDA and is skipped, saying so, where torch has none (the CPU side,
with a stand-in for CUDA, is tests/data/test_device.py and test_gpu_handoff.py)."""

from __future__ import annotations

import functools
import gc
import importlib.util
import io
import multiprocessing
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

if not torch.cuda.is_available():
    pytest.skip(
        f"no CUDA device (torch {torch.__version__}): the GPU hand-off runs where one is "
        "present; tests/data/test_device.py and test_gpu_handoff.py cover the CPU side",
        allow_module_level=True,
    )

from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload.data import _gpu, _shm  # noqa: E402
from kit.shards import Sample, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native
NPY = 64 << 10  # bytes of each sample's "npy" payload: 1 MiB a batch of 16


def _jpeg_encoder() -> Callable[[torch.Tensor], bytes] | None:
    """An encoder of (3, H, W) uint8 images: torchvision's, else Pillow's, else None."""
    if importlib.util.find_spec("torchvision") is not None:
        import torchvision.io as tvio

        return lambda img: bytes(tvio.encode_jpeg(img, quality=95).numpy())
    if importlib.util.find_spec("PIL") is not None:
        from PIL import Image

        def enc(img: torch.Tensor) -> bytes:
            buf = io.BytesIO()
            Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, "JPEG", quality=95)
            return buf.getvalue()

        return enc
    return None


def _samples(n: int) -> list[Sample]:
    """Per sample a JPEG (a flat colour, where an encoder is installed; else bytes), a
    class label and an "npy" payload of NPY bytes no other sample has."""
    enc = _jpeg_encoder()
    out = []
    for i in range(n):
        img = torch.full((3, 24 + i % 5, 32), (i * 37) % 256, dtype=torch.uint8)
        jpg = enc(img) if enc is not None else bytes([i % 256]) * 500
        npy = (i.to_bytes(4, "little") * (NPY // 4))
        out.append((f"s{i:05d}", {"jpg": jpg, "cls": str(i % 10).encode(), "npy": npy}))
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    root = tmp_path_factory.mktemp("gpu")
    samples = _samples(160)
    paths = [write_tarfile(root / f"shard-{s}.tar", samples[s * 40 : (s + 1) * 40])
             for s in range(4)]
    fastload.ShardIndex.build(paths, root / "index.fidx")
    return root / "index.fidx", samples


def _loader(path: Path, pin: bool, workers: int = 2, persistent: bool = False,
            collate: Any = fastload.collate, packed: bool = True) -> DataLoader:
    return DataLoader(fastload.ShardIndexDataset(path, packed=packed), batch_size=16,
                      num_workers=workers, collate_fn=collate, pin_memory=pin,
                      persistent_workers=persistent,
                      multiprocessing_context=multiprocessing.get_context("fork"))


def test_pin_memory_registers_blocks_in_place(shards: tuple[Path, list[Sample]]) -> None:
    """DataLoader(pin_memory=True) hands over the worker's block itself, page-locked:
    the same address as the block's mapping here, is_pinned(), no copy."""
    path, samples = shards
    expect = {k: v["jpg"] for k, v in samples}
    n = 0
    for b in _loader(path, pin=True):
        data = b["jpg"].data
        m = _shm.mapped_of(data)
        assert m is not None and m.registered, "the batch is not in a registered worker block"
        assert m.view.held and data.is_pinned() and b["jpg"].offsets.is_pinned()
        assert dict(zip(b.keys, b["jpg"].tolist(), strict=True)) == {k: expect[k] for k in b.keys}
        n += len(b)
    assert n == len(samples)


def test_race_probe_plain_copies(shards: tuple[Path, list[Sample]]) -> None:
    """The issue's race: each step the GPU is kept busy, then a plain
    ``b["npy"].data.cuda(non_blocking=True)`` (nothing of fastload's) is queued behind
    that work and the batch dropped at once; the workers write their next batches
    meanwhile. Every copy, compared after a synchronize, holds its own batch's bytes."""
    path, samples = shards
    expect = dict(samples)
    _gpu.drain()
    retired = _gpu.COUNTERS.retired
    copies = []
    for _ in range(2):
        for b in _loader(path, pin=True):
            torch.cuda._sleep(20_000_000)  # the copy waits behind this on the stream
            g = b["npy"].data.cuda(non_blocking=True)
            copies.append((list(b.keys), g))
            del b  # dropped while its copy has not run
    torch.cuda.synchronize()
    bad = [keys[0] for keys, g in copies
           if g.cpu().numpy().tobytes() != b"".join(expect[k]["npy"] for k in keys)]
    assert not bad, f"{len(bad)} of {len(copies)} batches copied another batch's bytes"
    assert _gpu.COUNTERS.retired > retired  # the blocks' counts were held back


def test_non_blocking_copy_from_the_block(shards: tuple[Path, list[Sample]]) -> None:
    """b.to("cuda", non_blocking=True) from a registered block: the right bytes on the
    device, and the block's count held (a fence) until the copy has completed."""
    path, samples = shards
    expect = {k: v["jpg"] for k, v in samples}
    got = {}
    for b in _loader(path, pin=True):
        assert _shm.mapped_of(b["jpg"].data) is not None
        torch.cuda._sleep(50_000_000)  # the copy queued behind work: still running below
        g = b.to("cuda", non_blocking=True)
        assert g["jpg"].data.is_cuda
        del b
        gc.collect()
        _gpu.poll()
        assert len(_gpu.FENCES) >= 1  # the count held
        torch.cuda.synchronize()
        _gpu.poll()
        assert len(_gpu.FENCES) == 0  # the copy is done: given back
        for i, k in enumerate(g.keys):
            t = g["jpg"][i]
            got[k] = b"" if t is None else t.cpu().numpy().tobytes()
    assert got == expect


def test_fields_on_the_gpu_never_sync_to_index(shards: tuple[Path, list[Sample]]) -> None:
    """A batch moved whole to CUDA: ``field[i]``, ``len``, ``nbytes`` read host bounds
    (torch's sync debug mode raises on any synchronizing call); ``ints``, ``tolist`` and
    ``to_bytes`` copy back and are right; ``buffer`` says what it needs."""
    path, samples = shards
    expect = dict(samples)
    b = next(iter(_loader(path, pin=True)))
    g = b.to("cuda", non_blocking=True)
    jpg = g["jpg"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        views = [jpg[i] for i in range(len(jpg))]
        assert jpg.nbytes == sum(len(expect[k]["jpg"]) for k in g.keys)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(v is not None and v.is_cuda for v in views)
    assert jpg.tolist() == [expect[k]["jpg"] for k in g.keys]
    assert jpg.to_bytes(2) == expect[g.keys[2]]["jpg"]
    labels = g["cls"].ints()
    assert labels.is_cuda and labels.tolist() == [int(expect[k]["cls"]) for k in g.keys]
    with pytest.raises(ValueError, match="host memory"):
        jpg.buffer(0)


def test_to_device_prefetches_on_a_side_stream(shards: tuple[Path, list[Sample]]) -> None:
    """Tensor fields are copied on the side stream and read right on the user's; packed
    fields stay on the host, pinned in their block."""
    path, samples = shards
    expect = dict(samples)
    user = torch.cuda.current_stream()
    seen = 0
    loader = _loader(path, pin=True, workers=4, packed=False,
                     collate=functools.partial(fastload.collate, ints="cls"))
    for b in fastload.to_device(loader, "cuda", prefetch=3):
        assert b["cls"].is_cuda and not b["jpg"].data.is_cuda and b["jpg"].data.is_pinned()
        assert b["cls"].tolist() == [int(expect[k]["cls"]) for k in b.keys]
        assert b["jpg"].tolist() == [expect[k]["jpg"] for k in b.keys]
        seen += len(b)
    assert torch.cuda.current_stream() == user
    assert seen == len(samples)
    plain = [{"x": torch.arange(10) * i, "y": [torch.ones(3)]} for i in range(5)]
    out = list(fastload.to_device(plain, "cuda"))
    assert all(o["x"].is_cuda and o["y"][0].is_cuda for o in out)
    assert [int(o["x"].sum()) for o in out] == [45 * i for i in range(5)]


def test_the_readme_loop(shards: tuple[Path, list[Sample]]) -> None:
    """docs/to-device.md's GPU example, verbatim but for the path, the batch size and the
    workers."""
    if _jpeg_encoder() is None:
        pytest.skip("the docs' loop decodes JPEGs: needs torchvision or Pillow")
    path, samples = shards
    ds = fastload.ShardIndexDataset(path, packed=True)
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                        collate_fn=fastload.collate, pin_memory=True)
    n = 0
    for batch in fastload.to_device(loader, "cuda", prefetch=2):   # copies ahead
        images = fastload.decode_images(batch["jpg"], device="cuda")  # nvJPEG, one call
        labels = batch["cls"].ints()   # packed fields stay on the host: ints on the CPU
        assert len(images) == len(labels) == len(batch)
        assert all(im.is_cuda and im.shape[0] == 3 for im in images)
        n += len(batch)
    assert n == len(samples)


def test_decode_images_from_a_worker_block(shards: tuple[Path, list[Sample]]) -> None:
    """nvJPEG over views of a registered worker block: the colours the images were
    made with (JPEG is lossy: within a few levels)."""
    if _jpeg_encoder() is None:  # neither torchvision nor Pillow: what decode_images says
        with pytest.raises(ImportError, match="pip install torchvision"):
            fastload.decode_images([b"x"], device="cuda")
        return
    path, _ = shards
    b = next(iter(_loader(path, pin=True)))
    assert _shm.mapped_of(b["jpg"].data) is not None
    out = fastload.decode_images(b["jpg"], device="cuda")
    for k, im in zip(b.keys, out, strict=True):
        i = int(k[1:])
        assert im.is_cuda and tuple(im.shape) == (3, 24 + i % 5, 32)
        assert abs(float(im.float().mean()) - (i * 37) % 256) < 6, k


@pytest.mark.parametrize("pin", [False, True], ids=["pin-off", "pin-on"])
@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "new-workers"])
def test_registration_over_epochs(
    shards: tuple[Path, list[Sample]], pin: bool, persistent: bool
) -> None:
    """Registrations and their cost over 3 epochs, each batch moved with
    ``b.to("cuda", non_blocking=True)`` and dropped at once: persistent workers keep
    their blocks, and new (forked) workers each epoch claim the exited ones' blocks, so
    they are registered in the first epoch only and none is unregistered. No
    cudaHostRegister or cudaHostUnregister runs on the main thread, nor does it wait for
    one: with pin_memory off every registration is the registrar thread's (the first
    copies from a block not registered yet read it as pageable memory). Every byte
    copied is right. Printed for the record (pytest -s)."""
    path, samples = shards
    expect = dict(samples)
    _gpu.drain()
    _shm.forget_views()
    _gpu.drain()
    loader = _loader(path, pin=pin, persistent=persistent)
    per_epoch = []
    for _ in range(3):
        before = _gpu.COUNTERS.snapshot()
        copies = []
        for b in loader:
            copies.append((list(b.keys), b.to("cuda", non_blocking=True)["npy"].data))
            del b
        torch.cuda.synchronize()
        _gpu.drain()
        now = _gpu.COUNTERS.snapshot()
        per_epoch.append({k: now[k] - before[k] for k in now})
        bad = [keys[0] for keys, g in copies
               if g.cpu().numpy().tobytes() != b"".join(expect[k]["npy"] for k in keys)]
        assert not bad, f"{len(bad)} of {len(copies)} batches copied another batch's bytes"
    del loader
    print(f"pin_memory={pin} persistent_workers={persistent}: " + "; ".join(
        f"+{e['registered']:.0f} registered ({e['registered_behind']:.0f} on the registrar) "
        f"in {e['register_ms']:.1f} ms, {e['unregistered']:.0f} unregistered in "
        f"{e['unregister_ms']:.1f} ms, main thread "
        f"{e['register_main_ms'] + e['unregister_main_ms']:.1f} ms, "
        f"{e['pending_copies']:.0f} tensors copied before registration"
        for e in per_epoch))
    assert all(e["register_failed"] == 0 for e in per_epoch)
    assert all(e["register_main_ms"] == 0 and e["unregister_main_ms"] == 0 for e in per_epoch)
    if not pin:
        assert all(e["registered"] == e["registered_behind"] for e in per_epoch)
    assert per_epoch[0]["registered"] > 0
    # the same blocks, persistent workers or new ones that claim the exited ones' (a pool
    # may add one where a batch was held longer)
    assert per_epoch[1]["registered"] + per_epoch[2]["registered"] < \
        per_epoch[0]["registered"]
    assert per_epoch[1]["unregistered"] == per_epoch[2]["unregistered"] == 0


def test_blocks_outlive_their_workers(shards: tuple[Path, list[Sample]]) -> None:
    """The blocks of workers that have exited stay registered and mapped, and the next
    epoch's (forked) workers write into them, once the copies from them have completed;
    let go of (forget_views), they are unregistered before their mapping goes."""
    path, samples = shards
    expect = dict(samples)
    first = [b for b in _loader(path, pin=True)]
    old = [m for m in list(_shm._views.values()) if m.registered]
    assert old
    del first
    gc.collect()
    for b in _loader(path, pin=True):  # new workers: they claim the old blocks
        assert b["npy"].tolist() == [expect[k]["npy"] for k in b.keys]
    mapped = list(_shm._views.values())
    assert any(m in mapped for m in old) and all(m.registered for m in old)
    _shm.forget_views()
    _gpu.drain()  # the copies done, the blocks' counts given back: unregistered
    assert not any(m.registered for m in old)


def test_registration_creates_no_context_on_device_0(tmp_path: Path) -> None:
    """``pin_memory("cuda:1")`` with device 0 current (a DDP rank without set_device)
    registers on device 1 and leaves device 0 without a context (a fresh process)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    code = """
import gc, importlib, pickle, torch, fastload
from multiprocessing.reduction import ForkingPickler
from fastload.data import _shm
importlib.import_module("fastload.data.collate")._in_worker = lambda: True
sent = fastload.collate([{"__key__": str(i), "x": b"y" * 1000} for i in range(4)])
b = pickle.loads(ForkingPickler.dumps(sent))
p = b.pin_memory("cuda:1")
m = _shm.mapped_of(p["x"].data)
assert m is not None and m.registered and m.device == 1, m
assert not torch._C._cuda_hasPrimaryContext(0), "a context on device 0"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
