"""fastload.data.device without CUDA: the fences that keep a block's lease until a copy's
event has completed (stand-in events over real shared-memory blocks; the rest of the
hand-off with a stand-in for CUDA is tests/data/test_gpu_handoff.py), to_device("cpu")
over plain and packed batches from real DataLoader workers, host registration skipped
cleanly, nothing CUDA-only imported or initialised, and decode_images' fallback."""

from __future__ import annotations

import collections
import gc
import multiprocessing
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kit.tools import require_module

torch = require_module("torch")

from torch.utils.data import DataLoader  # noqa: E402

import fastload  # noqa: E402
from fastload import PackedBatch  # noqa: E402
from fastload.data import _shm, device  # noqa: E402
from kit.shards import Sample, make_samples, write_tarfile  # noqa: E402

pytestmark = pytest.mark.native


class StandIn:
    """A stand-in for torch.cuda.Event: done when the test says so; synchronize() is
    counted (and completes it, as waiting would)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Sample]]:
    root = tmp_path_factory.mktemp("device")
    samples = make_samples(60, seed=7)
    paths = []
    for s in range(3):
        p = root / f"shard-{s}.tar"
        write_tarfile(p, samples[s * 20 : (s + 1) * 20])
        paths.append(str(p))
    fastload.ShardIndex.build(paths, root / "index.fidx")
    return root / "index.fidx", samples


def test_fences_wait_when_full() -> None:
    """Over max_pending, the oldest copy is waited for (synchronize), never dropped while
    running; each is let go of when its own event has completed."""
    f = _shm.Fences(max_pending=3)
    events = [StandIn() for _ in range(4)]
    for e in events[:3]:
        f.hold(e, object())
    assert len(f) == 3 and not any(e.waited for e in events)
    events[1].done = True  # a later copy done first: let go of, the earlier one kept
    assert f.poll() == 2
    f.hold(events[3], object())
    more = [StandIn() for _ in range(2)]
    for e in more:
        f.hold(e, None)
    assert [e.waited for e in events] == [1, 0, 1, 0] and len(f) == 3
    f.drain()
    assert len(f) == 0 and all(e.waited == 1 for e in more)


def test_a_block_returns_to_its_pool_only_after_the_copy_event() -> None:
    """The lease rule over a real block: a tensor over the received block, kept by a
    fence, keeps the block's count up after the batch is dropped, so the worker's pool
    writes the next batch into another block; once the event has completed the block
    is free, and reused."""
    pool = _shm._BlockPool()
    t = pool.take(50_000)
    block = pool.block_of(t.untyped_storage())
    assert block is not None
    got = torch.frombuffer(_shm._attach_block(*_shm._BlockHandover(block, pool).__reduce__()[1]),
                          dtype=torch.uint8)
    del t  # the worker's own lease goes once the batch is sent
    gc.collect()
    event = StandIn()
    _shm.FENCES.hold(event, [got[:100]])  # as copy_to does after a non-blocking copy
    del got  # the batch dropped by the training loop
    gc.collect()
    try:
        assert block.users == 1  # the fence's lease
        other = pool.take(50_000)
        assert other.data_ptr() != block.address  # not the block being copied from
        del other
        _shm.poll()
        assert block.users == 1  # the copy has not completed
        event.done = True
        _shm.poll()  # what each arriving batch does
        assert block.users == 0
        again = pool.take(50_000)
        assert again.data_ptr() == block.address  # free, and reused
        del again
    finally:
        _shm.FENCES.drain()
        _shm.forget_views()


def test_no_registration_without_cuda(shards: tuple[Path, list[Sample]]) -> None:
    """Batches from workers are in blocks this process maps; without CUDA none is
    registered, and pinning falls back to torch's own (which needs an accelerator)."""
    if torch.cuda.is_available():
        pytest.fail("this test is the CPU side; tests/gpu covers registration")
    path, _ = shards
    loader = DataLoader(fastload.ShardIndexDataset(path, packed=True), batch_size=8,
                        num_workers=2, collate_fn=fastload.collate,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    b = next(iter(loader))
    m = _shm.mapped_of(b["jpg"].data)
    assert m is not None and m.base <= b["jpg"].data.data_ptr() < m.base + m.length
    assert not _shm.register_host(m) and not m.registered
    assert not _shm.registered(b["jpg"].data)
    assert _shm.mapped_of(torch.zeros(4)) is None
    moved = b.to("cpu", non_blocking=True)  # no fence for a CPU "copy"
    assert len(_shm.FENCES) == 0 and moved["jpg"].tolist() == b["jpg"].tolist()


Pair = collections.namedtuple("Pair", ["x", "y"])


def test_to_device_cpu_plain_batches() -> None:
    batches: list[Any] = [
        torch.arange(4),
        {"a": torch.ones(2), "b": [torch.zeros(1), "text", 3]},
        (torch.arange(2), torch.arange(3)),
        Pair(torch.ones(1), {"z": torch.zeros(2)}),
        collections.OrderedDict(k=torch.arange(5)),
    ]
    out = list(fastload.to_device(iter(batches), "cpu"))
    assert len(out) == 5
    assert torch.equal(out[0], batches[0])
    assert out[1]["b"][1:] == ["text", 3] and torch.equal(out[1]["a"], torch.ones(2))
    assert isinstance(out[2], tuple) and torch.equal(out[2][1], torch.arange(3))
    assert isinstance(out[3], Pair) and torch.equal(out[3].y["z"], torch.zeros(2))
    assert isinstance(out[4], collections.OrderedDict)
    assert [type(t).__name__ for t in device.tensors_of(out[1])] == ["Tensor", "Tensor"]
    with pytest.raises(ValueError, match="prefetch must be at least 1"):
        next(fastload.to_device(batches, "cpu", prefetch=0))


def test_to_device_cpu_packed_batches_from_workers(shards: tuple[Path, list[Sample]]) -> None:
    path, samples = shards
    expect = dict(samples)
    loader = DataLoader(fastload.ShardIndexDataset(path, packed=True), batch_size=16,
                        num_workers=2, collate_fn=fastload.collate,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    seen = {}
    for b in fastload.to_device(loader, torch.device("cpu"), prefetch=3):
        assert isinstance(b, PackedBatch)
        for k, jpg in zip(b.keys, b["jpg"].tolist(), strict=True):
            seen[k] = jpg
    assert seen == {k: v["jpg"] for k, v in expect.items()}


def test_to_device_cuda_without_cuda_says_so() -> None:
    if torch.cuda.is_available():
        pytest.fail("this test is the CPU side; tests/gpu covers CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        next(fastload.to_device([torch.ones(1)], "cuda"))


def test_no_cuda_initialised_on_the_cpu_path(shards: tuple[Path, list[Sample]]) -> None:
    """A whole CPU epoch through to_device, pin checks and .to() leaves CUDA untouched
    (a fresh process: nothing else there could have initialised it)."""
    path, _ = shards
    code = f"""
import multiprocessing, sys, torch
from torch.utils.data import DataLoader
import fastload
from fastload.data import _shm
loader = DataLoader(fastload.ShardIndexDataset({str(path)!r}, packed=True), batch_size=8,
                    num_workers=2, collate_fn=fastload.collate,
                    multiprocessing_context=multiprocessing.get_context("fork"))
n = 0
for b in fastload.to_device(loader, "cpu"):
    _shm.registered(b["jpg"].data)
    b.to("cpu", non_blocking=True)
    n += len(b)
assert n == 60, n
assert not torch.cuda.is_initialized()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_decode_images_cpu_fallback() -> None:
    """Pillow or torchvision where installed (real JPEGs decoded); neither: an
    ImportError naming both."""
    samples = [{"__key__": "a", "jpg": b"x"}, {"__key__": "b", "jpg": b"y"}]
    field = fastload.collate(samples)["jpg"]
    if not _installed("PIL") and not _installed("torchvision"):
        with pytest.raises(ImportError, match=r"torchvision.*pillow"):
            fastload.decode_images(field, device="cpu")
        with pytest.raises(ImportError, match="pip install torchvision"):
            fastload.decode_images([b"x"], device="cpu")
    else:
        jpegs = [_jpeg(8, 6, (255, 0, 0)), _jpeg(4, 4, (0, 0, 255))]
        packed = fastload.collate([{"__key__": str(i), "jpg": j} for i, j in enumerate(jpegs)])
        images = fastload.decode_images(packed["jpg"], device="cpu")
        assert [tuple(im.shape) for im in images] == [(3, 6, 8), (3, 4, 4)]
        assert images[0].dtype == torch.uint8 and int(images[0][0].float().mean()) > 200
        assert int(images[1][2].float().mean()) > 200  # blue
    with pytest.raises(TypeError, match="PackedField or a list"):
        fastload.decode_images(b"not a field", device="cpu")
    gap = fastload.collate([{"__key__": "a", "jpg": b"1"}, {"__key__": "b"}],
                           allow_missing=True)
    with pytest.raises(ValueError, match="sample 1 has no payload"):
        fastload.decode_images(gap["jpg"], device="cpu")


def _jpeg(w: int, h: int, rgb: tuple[int, int, int]) -> bytes:
    if _installed("PIL"):
        import io

        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (w, h), rgb).save(buf, format="JPEG", quality=95)
        return buf.getvalue()
    import torchvision.io as tvio

    img = torch.tensor(rgb, dtype=torch.uint8).view(3, 1, 1).expand(3, h, w).contiguous()
    return bytes(tvio.encode_jpeg(img, quality=95).numpy())
