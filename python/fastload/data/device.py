"""Batches to an accelerator: the usual CUDA prefetcher (:func:`to_device`), the workers'
shared-memory blocks page-locked in place so a packed batch is copied straight from its
block (host registration), the leases of those blocks kept until the copies reading them
have completed (fences), and image decoding of a packed field (:func:`decode_images`).

Nothing here needs CUDA to import or to run on the CPU: registration is skipped where
``torch.cuda.is_available()`` is false, and :func:`to_device` to ``"cpu"`` moves batches
with ``.to()`` only.

The lease rule: a block goes back to its worker's pool when the last lease on it is gone
(cpp/shm/block.hpp). A non-blocking copy from a registered block reads it after
``.to()`` has returned, so the source tensors (each holding its lease) are kept here
with an event recorded after the copy, and let go of once ``event.query()`` says it has
completed (checked whenever a batch arrives or is moved; ``event.synchronize()`` when
more than ``MAX_PENDING`` are waiting, or before a block is unregistered).
"""

from __future__ import annotations

import io
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch

from . import _shm

__all__ = ["decode_images", "to_device"]

T = TypeVar("T")
_cu: Any = torch.cuda  # its constructors are untyped; used only where CUDA is available


# --- fences: leases kept until a copy has completed ---------------------------------------


class Event(Protocol):
    """What a fence waits on (``torch.cuda.Event``, or a stand-in in tests)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


MAX_PENDING = 64


class Fences:
    """Objects (the source tensors of non-blocking copies, so their leases) kept alive
    until the event recorded after the copy has completed. Events are let go of in the
    order they were held: one still running keeps the later ones (a conservative wait:
    they are usually on one stream)."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._pending: deque[tuple[Event, Any]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def hold(self, event: Event, keep: Any) -> None:
        with self._lock:
            self._pending.append((event, keep))
            while len(self._pending) > self.max_pending:
                ev, _ = self._pending.popleft()
                ev.synchronize()
        self.poll()

    def poll(self) -> int:
        """Lets go of what completed copies kept; returns how many are still pending."""
        with self._lock:
            while self._pending and self._pending[0][0].query():
                self._pending.popleft()
            return len(self._pending)

    def drain(self) -> None:
        """Waits for every pending copy, then lets go of what they kept."""
        with self._lock:
            while self._pending:
                ev, _ = self._pending.popleft()
                ev.synchronize()


FENCES = Fences()


def poll() -> None:
    if len(FENCES):
        FENCES.poll()


# --- host registration ---------------------------------------------------------------------


def _cuda() -> bool:
    return bool(torch.cuda.is_available())


def _rc(res: Any) -> int:
    return int(getattr(res, "value", res))


def register_host(m: _shm._Mapped) -> bool:
    """Page-locks a mapped worker block for CUDA (once; ``cudaHostRegister``), so copies
    from it run at the link's speed and ``is_pinned()`` holds for tensors over it. False
    where CUDA is not available or registration failed (the block is then copied
    through ordinary pinning)."""
    if m.registered:
        return True
    if not _cuda():
        return False
    with _shm._lock:
        if not m.registered and m.base:
            rc = _rc(_cu.cudart().cudaHostRegister(m.base, m.length, 0))
            m.registered = rc == 0
    return m.registered


def release_host(m: _shm._Mapped) -> None:
    """Unregisters a block whose mapping this process lets go of, after every copy that
    may read it (a mapping is never unmapped while registered)."""
    if not m.registered:
        return
    FENCES.drain()
    _cu.cudart().cudaHostUnregister(m.base)
    m.registered = False


def registered(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a worker block page-locked here (registering it if CUDA is
    available and it is not yet)."""
    m = _shm.mapped_of(t)
    return m is not None and register_host(m)


def pin(t: torch.Tensor, device: Any = None) -> torch.Tensor:
    """``t`` in page-locked memory: itself when it lies in a registered worker block (no
    copy), else ``t.pin_memory()``."""
    if registered(t):
        return t
    return t.pin_memory() if device is None else t.pin_memory(device)


def copy_to(tensors: Sequence[torch.Tensor], device: Any, non_blocking: bool) -> list[torch.Tensor]:
    """The tensors moved to ``device``; a non-blocking copy to CUDA from registered
    blocks keeps its sources (their leases) until an event recorded after it completes."""
    dev = torch.device(device)
    if dev.type != "cuda" or not non_blocking:
        return [t.to(dev, non_blocking=non_blocking) for t in tensors]
    sources = [t for t in tensors if registered(t)]
    out = [t.to(dev, non_blocking=True) for t in tensors]
    if sources:
        ev = _cu.Event()
        ev.record(torch.cuda.current_stream(dev))
        FENCES.hold(ev, sources)
    return out


# --- to_device: the prefetcher ---------------------------------------------------------------


def _move(batch: Any, dev: torch.device, non_blocking: bool) -> Any:
    from .collate import PackedBatch, PackedField

    if isinstance(batch, torch.Tensor):
        return batch.to(dev, non_blocking=non_blocking)
    if isinstance(batch, (PackedBatch, PackedField)):
        return batch.to(dev, non_blocking=non_blocking)
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
    from .collate import PackedBatch, PackedField

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
    them, or :class:`~fastload.PackedBatch` (copied straight from its shared-memory block
    where the block is registered: see ``pin_memory``). Anything that is not a tensor
    passes through. On another device (``"cpu"``) each batch is moved with ``.to()``.
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
        user.wait_event(ev)
        for t in tensors_of(out):
            if t.device.type == "cuda":
                t.record_stream(user)
        submit()
        yield out


# --- image decoding ----------------------------------------------------------------------


def _payloads(field: Any) -> list[torch.Tensor]:
    from .collate import PackedField

    if isinstance(field, PackedField):
        out = []
        for i in range(len(field)):
            t = field[i]
            if t is None:
                raise ValueError(f"decode_images: sample {i} has no payload in this field")
            out.append(t)
        return out
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

    With torchvision and CUDA: one batched nvJPEG call (``torchvision.io.decode_jpeg`` of
    the list of zero-copy views into the field's block). Otherwise on the CPU, by
    torchvision or else Pillow, the images then moved to ``device``. ``ImportError``
    naming both when neither is installed.
    """
    dev = torch.device(device)
    payloads = _payloads(field)
    tv = _torchvision_io()
    if tv is not None:
        if dev.type == "cuda" and _cuda():
            out = tv.decode_jpeg(payloads, mode=tv.ImageReadMode.RGB, device=dev)
            return list(out)
        images = [tv.decode_image(p, mode=tv.ImageReadMode.RGB) for p in payloads]
    else:
        images = [_pil_decode(p) for p in payloads]
    return images if dev.type == "cpu" else [im.to(dev) for im in images]


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
