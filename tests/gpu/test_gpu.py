"""Packed batches to a CUDA device (issue 34): worker blocks registered in place, so
pin_memory() copies nothing; non-blocking copies straight from a block, its lease kept
until the copy's event; to_device's side-stream prefetch; decode_images with nvJPEG.
Every test here needs CUDA and is skipped, saying so, where torch has none (the CPU side
is tests/data/test_device.py)."""

from __future__ import annotations

import gc
import multiprocessing
from pathlib import Path

import pytest

from kit.tools import require_module

torch = require_module("torch")

if not torch.cuda.is_available():
    pytest.skip(
        f"no CUDA device (torch {torch.__version__}): the GPU hand-off runs where one is "
        "present; tests/data/test_device.py covers the CPU side",
        allow_module_level=True,
    )

from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload.data import _shm  # noqa: E402
from kit.shards import Sample, make_samples, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    root = tmp_path_factory.mktemp("gpu")
    samples = make_samples(120, seed=3)
    paths = []
    for s in range(4):
        p = root / f"shard-{s}.tar"
        write_tarfile(p, samples[s * 30 : (s + 1) * 30])
        paths.append(str(p))
    fastload.ShardIndex.build(paths, root / "index.fidx")
    return root / "index.fidx", samples


def _loader(path: Path, pin: bool, workers: int = 2) -> DataLoader:
    return DataLoader(fastload.ShardIndexDataset(path, packed=True), batch_size=16,
                      num_workers=workers, collate_fn=fastload.collate, pin_memory=pin,
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
        assert data.is_pinned()
        assert b["jpg"].offsets.is_pinned()
        assert dict(zip(b.keys, b["jpg"].tolist(), strict=True)) == {k: expect[k] for k in b.keys}
        n += len(b)
    assert n == len(samples)


def test_non_blocking_copy_from_the_block(shards: tuple[Path, list[Sample]]) -> None:
    """b.to("cuda", non_blocking=True) from a registered block: the right bytes on the
    device, and the block's lease held (the fence) until the copy has completed."""
    path, samples = shards
    expect = {k: v["jpg"] for k, v in samples}
    got = {}
    for b in _loader(path, pin=True):
        block = _shm.mapped_of(b["jpg"].data)
        assert block is not None
        torch.cuda._sleep(50_000_000)  # the copy queued behind work: still running below
        g = b.to("cuda", non_blocking=True)
        assert g["jpg"].data.is_cuda and len(_shm.FENCES) >= 1  # the lease kept
        del b
        gc.collect()
        torch.cuda.synchronize()
        _shm.FENCES.poll()
        assert len(_shm.FENCES) == 0  # the copy is done: the lease went back
        for i, k in enumerate(g.keys):
            t = g["jpg"][i]
            got[k] = b"" if t is None else t.cpu().numpy().tobytes()
    assert got == expect


def test_to_device_prefetches_on_a_side_stream(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    expect = {k: v["jpg"] for k, v in samples}
    got = {}
    user = torch.cuda.current_stream()
    for b in fastload.to_device(_loader(path, pin=True, workers=4), "cuda", prefetch=3):
        assert b["jpg"].data.is_cuda
        # work on the user's stream, reading what the side stream copied
        total = int(b["jpg"].data.to(torch.int64).sum())
        assert total == sum(sum(expect[k]) for k in b.keys)
        for i, k in enumerate(b.keys):
            t = b["jpg"][i]
            got[k] = b"" if t is None else t.cpu().numpy().tobytes()
    assert torch.cuda.current_stream() == user
    assert got == expect
    plain = [{"x": torch.arange(10) * i, "y": [torch.ones(3)]} for i in range(5)]
    out = list(fastload.to_device(plain, "cuda"))
    assert all(o["x"].is_cuda and o["y"][0].is_cuda for o in out)
    assert [int(o["x"].sum()) for o in out] == [45 * i for i in range(5)]


def test_unregistered_when_a_worker_is_gone(shards: tuple[Path, list[Sample]]) -> None:
    """Blocks of workers that have exited are unregistered (after pending copies) before
    their mapping is let go of."""
    path, _ = shards
    first = [b for b in _loader(path, pin=True)]
    old = [m for m in list(_shm._views.values()) if m.registered]
    assert old
    del first
    gc.collect()
    for _ in _loader(path, pin=True):  # new workers: the old workers' views dropped
        pass
    assert not any(m.registered for m in old)


def test_decode_images_on_the_gpu() -> None:
    """nvJPEG through torchvision where it is installed (the GPU node has it); without
    it, the CPU fallback's answer (an ImportError naming what to install, where Pillow
    is missing too)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        if importlib.util.find_spec("PIL") is None:
            with pytest.raises(ImportError, match="pip install torchvision"):
                fastload.decode_images([b"x"], device="cuda")
        return
    import torchvision.io as tvio

    imgs = [torch.full((3, 40, 60), 200, dtype=torch.uint8),
            torch.full((3, 20, 30), 50, dtype=torch.uint8)]
    jpegs = [bytes(tvio.encode_jpeg(im, quality=95).numpy()) for im in imgs]
    b = fastload.collate([{"__key__": str(i), "jpg": j} for i, j in enumerate(jpegs)])
    out = fastload.decode_images(b["jpg"], device="cuda")
    assert [tuple(o.shape) for o in out] == [(3, 40, 60), (3, 20, 30)]
    assert all(o.is_cuda for o in out)
    means = [float(o.float().mean()) for o in out]
    assert abs(means[0] - 200) < 4 and abs(means[1] - 50) < 4
