"""The field type of packed batches (:class:`PackedField`, re-exported by
:mod:`.collate`, which owns :class:`~.collate.PackedBatch` and the packing): one
payload block and its offsets, and its accessors, on the host or on a device."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ._shm import _land, _ship, _Spec, copy_to, pin

__all__ = ["PackedField"]


class PackedField:
    """One field of a :class:`PackedBatch`: the payloads of every sample back to back in
    ``data`` (uint8, 1-D), sample ``i`` at ``data[offsets[i]:offsets[i + 1]]``;
    ``present`` (bool, or ``None`` when every sample has the field) marks the samples
    that have it (``collate(..., allow_missing=True)``).

    ``field[i]`` is a zero-copy uint8 tensor view (``None`` for a missing payload) that
    keeps the block alive after the batch is gone; ``field.buffer(i)`` the same as a
    memoryview; ``field.tolist()`` copies out ``bytes``.

    A field moved to a device (``field.to("cuda")``) keeps its sample bounds and
    ``present`` on the host, so ``field[i]`` (a view on the device), ``len`` and
    ``nbytes`` never wait for the device; ``to_bytes``, ``tolist`` and ``ints`` copy the
    payloads back first (``ints`` returns its tensor on the field's device); ``buffer``
    (a view of host memory) raises ``ValueError`` there.
    """

    __slots__ = ("_bounds", "data", "offsets", "present")

    def __init__(
        self, data: torch.Tensor, offsets: torch.Tensor, present: torch.Tensor | None = None
    ) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise ValueError(
                f"data must be a 1-D uint8 tensor, not {data.dtype} {tuple(data.shape)}"
            )
        if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError("offsets must be a non-empty 1-D int64 tensor")
        self.data = data
        self.offsets = offsets
        self.present = present
        self._bounds: list[int] | None = None

    def _b(self) -> list[int]:
        if self._bounds is None:
            self._bounds = self.offsets.tolist()
        return self._bounds

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def _check(self, i: int) -> int:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for a batch of {n}")
        return i

    def missing(self, i: int) -> bool:
        return self.present is not None and not bool(self.present[self._check(i)])

    def __getitem__(self, i: int) -> torch.Tensor | None:
        i = self._check(i)
        if self.present is not None and not bool(self.present[i]):
            return None
        b = self._b()
        return self.data[b[i] : b[i + 1]]

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        for i in range(len(self)):
            yield self[i]

    def buffer(self, i: int) -> memoryview | None:
        """Sample ``i``'s payload as a read-only memoryview, zero-copy (``None`` if it
        has none); it keeps the block alive. Host fields only: ``ValueError`` for a
        field on a device."""
        if self.data.device.type != "cpu":
            raise ValueError(
                f"buffer() is a zero-copy view of host memory, and this field is on "
                f"{self.data.device}: use field[i] (a view there) or to_bytes(i) (a copy)"
            )
        t = self[i]
        return None if t is None else t.numpy().data.toreadonly()

    def to_bytes(self, i: int) -> bytes | None:
        t = self[i]
        return None if t is None else t.cpu().numpy().tobytes()

    def _host_data(self) -> torch.Tensor:
        """``data`` on the host: itself, or for a field on a device one copy back."""
        return self.data if self.data.device.type == "cpu" else self.data.cpu()

    def tolist(self) -> list[bytes | None]:
        """Every payload as ``bytes`` (``None`` where missing): one copy each."""
        mv = self._host_data().numpy().data
        b = self._b()
        out: list[bytes | None] = [mv[b[i] : b[i + 1]].tobytes() for i in range(len(self))]
        if self.present is not None:
            for i in torch.nonzero(~self.present).flatten().tolist():
                out[i] = None
        return out

    def sizes(self) -> torch.Tensor:
        """The payload sizes (int64, 0 where missing)."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def nbytes(self) -> int:
        if self._bounds is None:
            return int(self.offsets[-1])
        return self._bounds[-1]

    def uniform_size(self) -> int | None:
        """The size every payload has, or ``None`` if they differ or one is missing."""
        if self.present is not None and not bool(self.present.all()):
            return None
        n = len(self)
        if n == 0:
            return 0
        size = self.nbytes // n
        if size * n != self.nbytes:
            return None
        if self.offsets.device.type != "cpu":  # from the host bounds: no wait for the device
            b = self._b()
            return size if all(b[i + 1] - b[i] == size for i in range(n)) else None
        return size if bool((self.sizes() == size).all()) else None

    def stacked(self) -> torch.Tensor:
        """The payloads as a ``(len, size)`` uint8 tensor, zero-copy (``.view(dtype)``
        reinterprets it); ``ValueError`` unless every payload has the same size."""
        size = self.uniform_size()
        if size is None:
            raise ValueError("stacked() needs payloads of one size, all present")
        return self.data[: size * len(self)].view(len(self), size)

    def ints(self) -> torch.Tensor:
        """The payloads read as decimal integers (``b"417"``: class labels such as a
        webdataset ``.cls``), an int64 tensor; ``ValueError`` naming the sample for one
        that is not."""
        if self.present is not None and not bool(self.present.all()):
            raise ValueError("ints() needs every sample to have the field")
        text = self._host_data().numpy().tobytes().decode("ascii", errors="replace")
        b = self._b()
        try:
            values = [int(text[b[i] : b[i + 1]]) for i in range(len(self))]
        except ValueError:
            bad = next(i for i in range(len(self)) if not _is_int(text[b[i] : b[i + 1]]))
            raise ValueError(
                f"payload {bad} ({text[b[bad] : b[bad + 1]][:40]!r}) is not a decimal integer"
            ) from None
        out = torch.tensor(values, dtype=torch.int64)
        return out if self.data.device.type == "cpu" else out.to(self.data.device)

    def pin_memory(self, device: Any = None) -> PackedField:
        """The field in page-locked memory: as it is where its block is a worker's block
        registered with CUDA in this process (registered here on first use; no copy),
        else its payload block and offsets pinned (one copy each)."""
        return PackedField._of([pin(t, device) for t in self._tensors()])

    def to(self, device: Any, non_blocking: bool = False) -> PackedField:
        """The field on ``device``: ``data`` and ``offsets`` (one transfer each; the block
        goes back to its worker once the copy has completed); ``present`` and the
        sample bounds stay on the host."""
        dev = torch.device(device)
        return self._moved(dev, copy_to([self.data, self.offsets], dev, non_blocking))

    def _moved(self, dev: torch.device, moved: Sequence[torch.Tensor]) -> PackedField:
        """This field over ``moved`` (its data and offsets on ``dev``)."""
        f = PackedField._of([*moved] + ([] if self.present is None else [self.present]))
        if dev.type != "cpu" and self.offsets.device.type == "cpu":
            f._bounds = self._b()  # read here, on the host: field[i] never syncs there
        else:
            f._bounds = self._bounds
        return f

    def _tensors(self) -> list[torch.Tensor]:
        return [self.data, self.offsets] + ([] if self.present is None else [self.present])

    @classmethod
    def _of(cls, tensors: Sequence[torch.Tensor]) -> PackedField:
        """A field of tensors that were one already (moved, pinned or received)."""
        f = cls.__new__(cls)
        f.data, f.offsets = tensors[0], tensors[1]
        f.present = tensors[2] if len(tensors) > 2 else None
        f._bounds = None
        return f

    def __getstate__(self) -> tuple[list[Any], list[_Spec]]:
        return _ship(self._tensors())

    def __setstate__(self, state: tuple[list[Any], list[_Spec]]) -> None:
        t = _land(*state)
        self.data, self.offsets = t[0], t[1]
        self.present = t[2] if len(t) > 2 else None
        self._bounds = None

    def __repr__(self) -> str:
        return f"PackedField({len(self)} payloads, {self.nbytes} bytes)"


def _is_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return False
    return True
