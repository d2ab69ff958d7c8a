"""Packed batches: a batch of samples as one contiguous uint8 tensor per field plus an
int64 offsets tensor, so a DataLoader worker hands it to the main process through
shared memory (torch passes a tensor's storage by file descriptor) instead of pickling
every payload as ``bytes`` through a pipe.

:func:`collate` packs a list of sample dicts (what the datasets' batched fetch returns)
with one native copy per payload, the GIL released; in a DataLoader worker the tensors
are allocated in shared memory up front (in blocks the worker reuses once the main
process has dropped their last batch), so nothing is copied again on the way to the
main process. :class:`PackedBatch` is what comes out.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import torch

from .. import _core
from ..index import ShardIndex
from . import _gpu
from ._field import PackedField
from ._shm import (
    _Arena,
    _attach_block,
    _BlockHandover,
    _in_worker,
    _land,
    _ship,
    copy_to,
    pin,
)

__all__ = ["PackedBatch", "PackedField", "collate", "fetch_packed"]

Value = Union["PackedField", torch.Tensor]


# --- the packed types ------------------------------------------------------------------


class PackedBatch:
    """A batch of samples packed for the trip from a DataLoader worker: per field a
    :class:`PackedField` (one payload block and its offsets) or, for fields packed with
    ``stack``/``ints``, an ordinary tensor with one row per sample.

    ``len(batch)`` samples; ``batch.keys`` their keys (also ``batch["__key__"]``);
    ``batch.fields`` the field names; ``batch["jpg"]`` a field (``batch["jpg"][i]`` a
    zero-copy view); ``batch.to_samples()`` the batch as a list of dicts of ``bytes``.
    ``pin_memory()`` (what ``DataLoader(pin_memory=True)`` calls) pins one block per
    field; ``to(device)`` moves them. Pickling carries tensors only (and the keys), so
    torch moves the blocks between processes through shared memory.

    A received batch is lazy: unpickling adopts its blocks' leases and nothing more; its
    tensors are built when a field is first touched (``nbytes``, ``len`` and ``keys``
    need none), and a batch dropped untouched gives its blocks straight back.
    """

    __slots__ = ("_fields_", "_keys", "_lazy", "_n", "_nbytes", "meta")

    def __init__(
        self,
        keys: Sequence[str],
        fields: Mapping[str, Value],
        meta: Mapping[str, list[Any]] | None = None,
    ) -> None:
        self._keys: list[str] | tuple[int, str | bytes] = list(keys)
        self._n = len(keys)
        self._fields_: dict[str, Value] | None = dict(fields)
        self._lazy: tuple[tuple[Any, ...], bytes] | None = None  # (storages, specs) received
        self._nbytes: int | None = None
        self.meta: dict[str, list[Any]] = dict(meta or {})
        n = self._n
        for name, v in self._fields.items():
            if len(v) != n:
                raise ValueError(f"field {name!r} has {len(v)} rows for {n} keys")

    def __len__(self) -> int:
        return self._n

    @property
    def _fields(self) -> dict[str, Value]:
        """The fields, their tensors built on first use after the batch was received."""
        fields = self._fields_
        if fields is None:
            lazy = self._lazy
            if lazy is None:  # another thread built them meanwhile
                return self._fields_  # type: ignore[return-value]
            bases, spec = lazy
            layout, specs = pickle.loads(spec)
            fields = self._fields_ = _unflat(layout, _land(bases, specs))
            self._lazy = None  # after the fields are set: see above
        return fields

    @property
    def keys(self) -> list[str]:
        """The samples' keys (split on first use after a batch was received: most loops
        never look at them)."""
        if isinstance(self._keys, tuple):
            self._keys = _split_keys(self._keys)
        return self._keys

    @keys.setter
    def keys(self, keys: Sequence[str]) -> None:
        self._keys = list(keys)
        self._n = len(self._keys)

    @property
    def fields(self) -> list[str]:
        return list(self._fields)

    def __contains__(self, name: object) -> bool:
        return name in self._fields or name == "__key__" or name in self.meta

    def __getitem__(self, name: str) -> Any:
        if _gpu.STATE.active:  # a copy from the field may follow on this thread's stream
            _gpu.note_streams()
        try:
            return self._fields[name]
        except KeyError:
            if name == "__key__":
                return self.keys
            if name in self.meta:
                return self.meta[name]
            raise KeyError(
                f"no field {name!r} in this batch (its fields: {', '.join(self._fields)})"
            ) from None

    def items(self) -> Iterable[tuple[str, Value]]:
        if _gpu.STATE.active:  # as __getitem__
            _gpu.note_streams()
        return self._fields.items()

    @property
    def nbytes(self) -> int:
        """Payload bytes (tensor bytes for stacked fields)."""
        if self._nbytes is None:
            self._nbytes = sum(
                v.nbytes if isinstance(v, PackedField) else v.numel() * v.element_size()
                for v in self._fields.values()
            )
        return self._nbytes

    def to_samples(self) -> list[dict[str, Any]]:
        """The batch as a list of sample dicts: ``"__key__"``, then ``bytes`` (or
        ``None``) per packed field and a row (a tensor, or an int for ``ints`` fields)
        per stacked one."""
        out: list[dict[str, Any]] = [{"__key__": k} for k in self.keys]
        for name, rows in self.meta.items():
            for d, v in zip(out, rows, strict=True):
                d[name] = v
        for name, v in self._fields.items():
            # bytes per payload; ints for an int64 column; rows of a stacked one
            values: list[Any]
            if isinstance(v, PackedField):
                values = v.tolist()
            else:
                values = v.tolist() if v.dim() == 1 else list(v.unbind(0))
            for d, x in zip(out, values, strict=True):
                if x is not None:
                    d[name] = x
        return out

    def pin_memory(self, device: Any = None) -> PackedBatch:
        """The batch in page-locked memory (what ``DataLoader(pin_memory=True)`` calls):
        as it is where its blocks are workers' blocks registered with CUDA here (each
        registered once, on first use), else one pinned copy per block."""
        tensors, layout = self._flat()
        return self._with(layout, [pin(t, device) for t in tensors])

    def to(self, device: Any, non_blocking: bool = False) -> PackedBatch:
        """The batch on ``device``: one transfer per tensor (a packed field's ``present``
        and sample bounds stay on the host: see :class:`PackedField`). From registered
        blocks, a block goes back to its worker only once the copies reading it have
        completed, so a worker cannot reuse a block being read."""
        return self._moved(device, non_blocking, packed=True)

    def _moved(self, device: Any, non_blocking: bool, packed: bool) -> PackedBatch:
        """The batch with its tensor fields on ``device``, and its packed fields too if
        ``packed`` (else they stay where they are: ``to_device``)."""
        dev = torch.device(device)
        fields = self._fields
        src: list[torch.Tensor] = []
        for v in fields.values():
            if not isinstance(v, PackedField):
                src.append(v)
            elif packed:
                src += [v.data, v.offsets]
        moved = iter(copy_to(src, dev, non_blocking))
        out: dict[str, Value] = {}
        for name, v in fields.items():
            if not isinstance(v, PackedField):
                out[name] = next(moved)
            else:
                out[name] = v._moved(dev, (next(moved), next(moved))) if packed else v
        b = PackedBatch.__new__(PackedBatch)
        b._keys, b._n, b.meta = self._keys, self._n, self.meta
        b._fields_, b._lazy, b._nbytes = out, None, self._nbytes
        return b

    def _flat(self) -> tuple[list[torch.Tensor], list[tuple[str, int]]]:
        """Every tensor, and per field its name and tensor count (0: a plain tensor)."""
        tensors: list[torch.Tensor] = []
        layout: list[tuple[str, int]] = []
        for name, v in self._fields.items():
            ts = v._tensors() if isinstance(v, PackedField) else [v]
            layout.append((name, len(ts) if isinstance(v, PackedField) else 0))
            tensors += ts
        return tensors, layout

    def _with(self, layout: list[tuple[str, int]], tensors: list[torch.Tensor]) -> PackedBatch:
        out = PackedBatch.__new__(PackedBatch)
        out._keys, out._n, out.meta = self._keys, self._n, self.meta
        out._fields_, out._lazy, out._nbytes = _unflat(layout, tensors), None, self._nbytes
        return out

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """A call of :func:`_received`: the keys as one string, the storages (a pool
        block travels as a reference), and the tensors' layout as one ``bytes`` decoded
        only when a field is touched. The usual batch from a worker (one pool block, no
        meta) is one ``bytes`` and the block's descriptor the first time
        (:func:`_received_block`)."""
        tensors, layout = self._flat()
        bases, specs = _ship(tensors)
        keys = self._keys if isinstance(self._keys, tuple) else _join_keys(self._keys)
        spec = pickle.dumps((layout, specs), protocol=pickle.HIGHEST_PROTOCOL)
        if len(bases) == 1 and isinstance(bases[0], _BlockHandover) and isinstance(keys, tuple) \
                and not self.meta:
            handle, fdno, length, pid, inode, gone = bases[0].args()
            text = keys[1] if isinstance(keys[1], bytes) else keys[1].encode()
            head = _HEAD.pack(pid, inode, fdno, length, self.nbytes, keys[0], len(text),
                              len(gone))
            return _received_block, (b"".join((head, struct.pack(f"<{len(gone)}Q", *gone),
                                               text, spec)), handle)
        return _received, (keys, self.nbytes, self.meta or None, tuple(bases), spec)

    def __repr__(self) -> str:
        return f"PackedBatch({len(self)} samples, fields={self.fields}, {self.nbytes} bytes)"


# pid, inode, descriptor number, mapping length, nbytes, samples, key bytes, gone inodes
_HEAD = struct.Struct("<qQqQqqII")


def _received_block(blob: bytes, handle: Any) -> PackedBatch:
    """A batch in one pool block unpickled (its lease adopted, nothing built): ``blob``
    holds ``_HEAD``, the inodes of blocks the sender let go of, the keys (UTF-8, joined
    by NUL) and the layout (a pickle); ``handle`` the block's descriptor, the first time
    it is handed over."""
    pid, inode, fdno, length, nbytes, n, nkeys, ngone = _HEAD.unpack_from(blob)
    at = _HEAD.size + 8 * ngone
    gone = struct.unpack_from(f"<{ngone}Q", blob, _HEAD.size) if ngone else ()
    lease = _attach_block(handle, fdno, length, pid, inode, gone)
    b = PackedBatch.__new__(PackedBatch)
    b._keys, b._n, b.meta = (n, blob[at : at + nkeys]), n, {}
    b._fields_, b._lazy, b._nbytes = None, ((lease,), blob[at + nkeys :]), nbytes
    return b


def _received(
    keys: tuple[int, str | bytes] | list[str], nbytes: int, meta: dict[str, list[Any]] | None,
    bases: tuple[Any, ...], spec: bytes,
) -> PackedBatch:
    """A batch unpickled: its storages landed (the blocks' leases adopted), its tensors
    not yet built."""
    b = PackedBatch.__new__(PackedBatch)
    b._keys = keys
    b._n = keys[0] if isinstance(keys, tuple) else len(keys)
    b.meta = meta if meta is not None else {}
    b._fields_, b._lazy, b._nbytes = None, (bases, spec), nbytes
    return b


def _unflat(layout: list[tuple[str, int]], tensors: list[torch.Tensor]) -> dict[str, Value]:
    fields: dict[str, Value] = {}
    at = 0
    for name, count in layout:
        if count == 0:
            fields[name] = tensors[at]
            at += 1
        else:
            fields[name] = PackedField._of(tensors[at : at + count])
            at += count
    return fields


def _join_keys(keys: list[str]) -> tuple[int, str] | list[str]:
    """The keys as one string (one object to pickle and unpickle, not one per sample),
    or the list where a key holds the separator."""
    joined = "\0".join(keys)
    return (len(keys), joined) if joined.count("\0") == len(keys) - 1 else keys


def _split_keys(state: tuple[int, str | bytes] | list[str]) -> list[str]:
    if isinstance(state, list):
        return state
    n, joined = state
    text = joined.decode() if isinstance(joined, bytes) else joined
    return text.split("\0") if n else []


# --- packing ---------------------------------------------------------------------------


def _field_of(block: torch.Tensor, offsets: torch.Tensor, missing: list[int] | None,
              n: int) -> PackedField:
    present = None
    if missing is not None:
        present = torch.ones(n, dtype=torch.bool)
        present[missing] = False
    return PackedField(block, offsets.view(torch.int64), present)


def finish(
    batch: PackedBatch, stack: Iterable[str] | str, ints: Iterable[str] | str
) -> PackedBatch:
    """``batch`` with the fields named in ``stack`` and ``ints`` turned into tensors (see
    :func:`collate`)."""
    batch._nbytes = None  # ints changes it
    for name in [stack] if isinstance(stack, str) else stack:
        f = batch._fields.get(name)
        if isinstance(f, PackedField):
            try:
                batch._fields[name] = f.stacked()
            except ValueError:
                raise ValueError(
                    f"stack: field {name!r} has payloads of different sizes (or missing ones); "
                    f"sizes seen: {sorted(set(f.sizes().tolist()))[:8]}"
                ) from None
    for name in [ints] if isinstance(ints, str) else ints:
        f = batch._fields.get(name)
        if isinstance(f, PackedField):
            try:
                batch._fields[name] = f.ints()
            except ValueError as e:
                raise ValueError(f"ints: field {name!r}: {e}") from None
    return batch


def collate(
    samples: Sequence[Mapping[str, Any]] | PackedBatch,
    *,
    fields: Sequence[str] | None = None,
    allow_missing: bool = False,
    stack: Iterable[str] | str = (),
    ints: Iterable[str] | str = (),
) -> PackedBatch:
    """Packs a list of samples (dicts of bytes-like payloads: fastload ``Payload``,
    ``bytes``, numpy arrays, any buffer) into a :class:`PackedBatch`: per field one
    uint8 tensor, each payload copied into it once in native code with the GIL released.
    In a DataLoader worker the tensors live in shared memory, so they reach the main
    process without another copy. A ``PackedBatch`` is returned as it is (so this can be
    both a dataset's and the DataLoader's ``collate_fn``).

    ``fields``: the fields to pack, in order (default: every field of the samples, in
    order of first appearance); a sample without one is a ``KeyError`` naming the sample
    and the field, unless ``allow_missing`` (its view is then ``None``). ``"__key__"``
    gives ``batch.keys``; other ``"__...__"`` entries are kept as lists in
    ``batch.meta``. A field whose values are Python ints (a transform decoded them)
    becomes an int64 tensor. ``stack``: fields whose payloads all have one size, given
    as ``(len, size)`` uint8 tensors; ``ints``: fields of decimal text (``.cls``)
    given as int64 tensors. Use ``functools.partial`` to set these for a DataLoader.
    """
    if isinstance(samples, PackedBatch):
        return samples
    if isinstance(samples, Mapping):
        raise TypeError("collate takes a list of samples (dicts), not one sample")
    n = len(samples)
    keys = [s.get("__key__", "") for s in samples]
    if fields is None:
        names = list(dict.fromkeys(k for s in samples for k in s if not k.startswith("__")))
        meta_names = list(
            dict.fromkeys(k for s in samples for k in s if k.startswith("__") and k != "__key__")
        )
    else:
        names = list(dict.fromkeys([fields] if isinstance(fields, str) else fields))
        meta_names = []
    meta = {m: [s.get(m) for s in samples] for m in meta_names}
    columns = [[s.get(f) for s in samples] for f in names]

    out: dict[str, Value] = {}
    packed_names: list[str] = []
    packed_cols: list[list[Any]] = []
    for name, col in zip(names, columns, strict=True):
        first = next((v for v in col if v is not None), None)
        if isinstance(first, int) and not isinstance(first, bool):
            out[name] = _int_column(name, col, keys)
        else:
            packed_names.append(name)
            packed_cols.append(col)
    arena = _Arena(_in_worker())
    missing = _core.pack_payloads(packed_cols, arena, packed_names, keys, allow_missing)
    for c, name in enumerate(packed_names):
        block, offsets = arena.pieces[2 * c], arena.pieces[2 * c + 1]
        out[name] = _field_of(block, offsets, missing[c], n)
    batch = PackedBatch(keys, {f: out[f] for f in names}, meta)
    return finish(batch, stack, ints)


def _int_column(name: str, col: list[Any], keys: list[str]) -> torch.Tensor:
    for k, v in zip(keys, col, strict=True):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(
                f"field {name!r} of sample {k!r} is a {type(v).__name__} where the other "
                "samples have ints"
            )
    return torch.tensor(col, dtype=torch.int64)


def fetch_packed(
    index: ShardIndex,
    indices: Sequence[int],
    fields: Sequence[str] | None,
    access: str = "mmap",
    *,
    allow_missing: bool = False,
) -> PackedBatch:
    """The samples at ``indices`` read from the index straight into a
    :class:`PackedBatch` (shared memory in a DataLoader worker): one copy per payload,
    from the mapped shard or by the I/O engine's reads, no ``Payload`` or dict per
    sample."""
    arena = _Arena(_in_worker())
    keys, names, missing = index._native.fetch_packed(
        indices, fields, arena, access, allow_missing
    )
    n = len(keys)
    out = {
        name: _field_of(arena.pieces[2 * c], arena.pieces[2 * c + 1], missing[c], n)
        for c, name in enumerate(names)
    }
    return PackedBatch(keys, out)
