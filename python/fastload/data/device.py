"""Batches to an accelerator: the usual CUDA prefetcher (:func:`to_device`) and image
decoding of a packed field (:func:`decode_images`). The host side of a packed batch's
trip (its worker block page-locked in place, the block given back to its worker only
once the copies reading it have completed) is in :mod:`._shm` and :mod:`._gpu`, under
``PackedBatch.pin_memory`` and ``PackedBatch.to``.

Nothing here needs CUDA to import or to run on the CPU: :func:`to_device` to ``"cpu"``
moves batches with ``.to()`` only, and asks nothing of ``torch.cuda`` but whether it is
available when a CUDA device is named.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from . import _gpu
from .collate import PackedBatch, PackedField

__all__ = ["decode_images", "to_device"]

T = TypeVar("T")
_cu: Any = torch.cuda  # its constructors are untyped; used only where CUDA is available


def _cuda() -> bool:
    return bool(torch.cuda.is_available())


# --- to_device: the prefetcher ---------------------------------------------------------------


def _move(batch: Any, dev: torch.device, non_blocking: bool) -> Any:
    """``batch`` with its tensors on ``dev``; a packed field (encoded payloads of varying
    sizes) stays where it is, for its accessors and decode_images on the host."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dev, non_blocking=non_blocking)
    if isinstance(batch, PackedBatch):
        return batch._moved(dev, non_blocking, packed=False)
    if isinstance(batch, PackedField):
        return batch
    if isinstance(batch, Mapping):
        moved = {k: _move(v, dev, non_blocking) for k, v in batch.items()}
        return moved if type(batch) is dict else _rebuild(batch, moved)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_move(v, dev, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(v, dev, non_blocking) for v in batch)
    return batch


def _rebuild(original: Mapping[Any, Any], moved: dict[Any, Any]) -> Any:
    try:
        return type(original)(moved)  # type: ignore[call-arg]
    except TypeError:
        return moved


def tensors_of(batch: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a batch (nested dicts, lists, tuples; packed batches' blocks)."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, PackedField):
        yield from batch._tensors()
    elif isinstance(batch, PackedBatch):
        for _, v in batch.items():
            yield from tensors_of(v)
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from tensors_of(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors_of(v)


def to_device(
    batches: Iterable[T], device: str | torch.device = "cuda", prefetch: int = 2
) -> Iterator[T]:
    """Yields the batches of ``batches`` (a DataLoader, any iterable) on ``device``.

    On CUDA the next ``prefetch`` batches are copied on a side stream while the current
    one is used; the stream that takes a batch waits for its copy, and its tensors are
    marked as used there (``record_stream``), so their memory is not reused before that
    stream's work on them is done. Batches may be tensors, dicts, lists and tuples of
    them, or :class:`~fastload.PackedBatch`, whose tensor fields (``stack``/``ints``
    fields, ``collate``'s int columns) are copied straight from its shared-memory block
    where the block is registered (see ``pin_memory``); its packed fields (encoded
    payloads: ``batch["jpg"]``) stay on the host, pinned where the loader pins, for
    :func:`decode_images` and every accessor (``field.to("cuda")`` moves one).
    Anything that is not a tensor passes through. On another device (``"cpu"``) each
    batch is moved with ``.to()``.
    """
    if prefetch < 1:
        raise ValueError(f"prefetch must be at least 1, not {prefetch}")
    dev = torch.device(device)
    if dev.type != "cuda":
        for b in batches:
            yield _move(b, dev, False)
        return
    if not _cuda():
        raise RuntimeError(
            f"to_device: device {str(dev)!r} asked for, but CUDA is not available to torch "
            f"{torch.__version__} (use device='cpu')"
        )
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    side = _cu.Stream(dev)
    _gpu.use_stream(side)  # a block read there goes back only after the copies
    ahead: deque[tuple[Any, Any]] = deque()
    it = iter(batches)

    def submit() -> bool:
        try:
            b = next(it)
        except StopIteration:
            return False
        with torch.cuda.stream(side):
            out = _move(b, dev, True)
            ev = _cu.Event()
            ev.record(side)
        ahead.append((out, ev))
        return True

    while len(ahead) < prefetch and submit():
        pass
    while ahead:
        out, ev = ahead.popleft()
        user = torch.cuda.current_stream(dev)
        _gpu.use_stream(user)
        user.wait_event(ev)
        for t in tensors_of(out):
            if t.device.type == "cuda":
                t.record_stream(user)
        submit()
        _gpu.poll()
        yield out


# --- image decoding ----------------------------------------------------------------------


def _payloads(field: Any) -> list[torch.Tensor]:
    """The encoded images as host uint8 tensors: views of a packed field's block (one
    ``split``, no view per sample built in Python; a field on a device is copied back
    once), or the tensors/bytes of a list."""
    if isinstance(field, PackedField):
        if field.present is not None and not bool(field.present.all()):
            i = int(torch.nonzero(~field.present.cpu()).flatten()[0])
            raise ValueError(f"decode_images: sample {i} has no payload in this field")
        b = field._b()
        data = field._host_data()
        sizes = [b[i + 1] - b[i] for i in range(len(b) - 1)]
        return list(data[b[0] : b[-1]].split_with_sizes(sizes))
    if isinstance(field, (list, tuple)):
        return [
            v if isinstance(v, torch.Tensor) else torch.frombuffer(bytearray(v), dtype=torch.uint8)
            for v in field
        ]
    raise TypeError(
        f"decode_images takes a PackedField or a list of encoded images, not {type(field).__name__}"
    )


def decode_images(field: Any, device: str | torch.device = "cuda") -> list[torch.Tensor]:
    """The JPEG payloads of a packed field (``batch["jpg"]``, or a list of uint8 tensors or
    bytes) decoded to ``(3, H, W)`` uint8 tensors on ``device``.

    With torchvision and CUDA: nvJPEG, over zero-copy views into the field's block on
    the host (a field moved to the GPU is copied back once: nvJPEG reads host memory);
    one batched call from torchvision 0.19 (which takes a list on CUDA), one call per
    image before. An image nvJPEG cannot decode (a bad file, a kind of JPEG it rejects)
    is decoded alone on the CPU, and one no decoder takes is a ``ValueError`` naming
    it. Otherwise on the CPU, by torchvision or else Pillow, the images then moved to
    ``device``. ``ImportError`` naming both when neither is installed.
    """
    dev = torch.device(device)
    payloads = _payloads(field)
    tv = _torchvision_io()
    if tv is None:
        images = [_pil_decode(p) for p in payloads]
        return images if dev.type == "cpu" else [im.to(dev) for im in images]
    rgb = tv.ImageReadMode.RGB

    def cpu(p: torch.Tensor) -> torch.Tensor:
        im: torch.Tensor = tv.decode_image(p, mode=rgb)
        return im if dev.type == "cpu" else im.to(dev)

    if dev.type == "cuda" and _cuda():
        batched = (lambda ps: tv.decode_jpeg(ps, mode=rgb, device=dev)) \
            if _lists_on_cuda() else None
        return decode_each(payloads, batched,
                           lambda p: tv.decode_jpeg(p, mode=rgb, device=dev), cpu)
    return decode_each(payloads, None, cpu, cpu)


_DecodeError = (RuntimeError, ValueError)


def decode_each(
    payloads: list[torch.Tensor],
    batched: Any,
    one: Any,
    fallback: Any,
) -> list[torch.Tensor]:
    """``batched(payloads)`` (one call for all, if given); where it fails, ``one(p)`` per
    image, and ``fallback(p)`` (the CPU) for an image ``one`` fails on; ``ValueError``
    naming the first image neither decodes."""
    if batched is not None:
        try:
            return list(batched(payloads))
        except _DecodeError:
            pass  # one of them is bad: each alone, below
    out = []
    for i, p in enumerate(payloads):
        try:
            out.append(one(p))
            continue
        except _DecodeError:
            pass
        try:
            out.append(fallback(p))
        except _DecodeError as e:
            raise ValueError(
                f"decode_images: payload {i} ({p.numel()} bytes) is not an image this "
                f"decoder reads: {e}"
            ) from None
    return out


def _lists_on_cuda() -> bool:
    """torchvision's decode_jpeg takes a list of images on CUDA (0.19 and later)."""
    try:
        import torchvision  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False
    parts = []
    for x in str(torchvision.__version__).split("+")[0].split(".")[:2]:
        digits = "".join(c for c in x if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= (0, 19)


def _torchvision_io() -> Any:
    try:
        import torchvision.io as tvio  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    return tvio


def _pil_decode(payload: torch.Tensor) -> torch.Tensor:
    try:
        from PIL import Image  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise ImportError(
            "decode_images needs torchvision (nvJPEG on the GPU, or its CPU decoder) or "
            "Pillow (CPU): pip install torchvision, or pip install pillow"
        ) from None
    import numpy as np

    with Image.open(io.BytesIO(payload.numpy().tobytes())) as im:
        arr = np.asarray(im.convert("RGB"))
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()
