"""ShardIndexDataset: a map-style PyTorch dataset over indexed tar shards."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Callable

from torch.utils.data import Dataset

from ..index import ShardIndex
from ._fetch import Source, check_access, check_fields, fetch, index_of
from .collate import fetch_packed

__all__ = ["ShardIndexDataset"]


# Where torch is not installed mypy sees Dataset as Any; the ignore covers that case.
class ShardIndexDataset(Dataset[Any]):  # type: ignore[misc, unused-ignore]
    """Random access to the samples of webdataset-style tar shards.

    ``source``: a :class:`~fastload.ShardIndex`, the path of an index file, or shards
    (a list of paths, a glob, a directory; their index is built once and cached).

    ``ds[i]`` is a dict: ``"__key__"`` and one entry per field (``fields``: only these,
    each required; ``None``: every field of the sample). Values are read-only zero-copy
    buffers over the mmapped shard (:class:`fastload._core.Payload`: use ``bytes(v)``,
    ``memoryview(v)``, ``numpy.frombuffer(v, numpy.uint8)``), or ``bytes`` with
    ``copy=True``; ``transform`` is applied to each dict. ``__getitems__`` fetches a whole
    batch in one native call with the GIL released (``DataLoader`` uses it).

    ``access="read"`` reads each batch with all its reads in flight at once through the
    I/O engine, for shards on network storage where a page fault costs a round trip;
    ``"mmap"`` (default) maps shards, best on local disk.

    ``packed=True``: ``__getitems__`` returns a :class:`~fastload.PackedBatch` read from
    the index straight into one block per field (shared memory in a DataLoader worker),
    with ``DataLoader(ds, batch_size=B, collate_fn=fastload.collate)`` (which passes a
    PackedBatch through); ``ds[i]`` is still a dict. ``transform`` and ``copy`` do not
    apply to packed batches (decode them after the DataLoader, or in a ``collate_fn``
    wrapping ``fastload.collate``).

    Pickling carries the index's path, not its mapping: every ``DataLoader`` worker
    (fork or spawn) reopens the index on first use. Payloads pickle as ``bytes``.
    """

    def __init__(
        self,
        source: Source,
        *,
        fields: Sequence[str] | None = None,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        copy: bool = False,
        access: str = "mmap",
        packed: bool = False,
    ) -> None:
        check_access(access)
        if packed and (transform is not None or copy):
            raise ValueError(
                "packed=True returns PackedBatches: transform and copy apply to dicts only "
                "(transform the packed batch in a collate_fn instead)"
            )
        index = index_of(source)
        fields = check_fields(index, fields)
        self._index: ShardIndex | None = index
        self._pid = os.getpid()
        self._path = index.path
        self._len = len(index)
        self.fields: list[str] | None = None if fields is None else list(fields)
        self.transform = transform
        self.copy = copy
        self.access = access
        self.packed = packed

    @property
    def index(self) -> ShardIndex:
        """The index, (re)opened in this process on first use."""
        if self._index is None or self._pid != os.getpid():
            # After fork() the parent's native state (its I/O engine's threads) is not
            # ours; the index is reopened, which is cheap (one mmap, one checksum).
            self._index = ShardIndex.open(self._path, check=False)
            self._pid = os.getpid()
        return self._index

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> Any:
        sample = fetch(self.index, [i], self.fields, self.copy, self.access)[0]
        return sample if self.transform is None else self.transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> Any:
        if self.packed:
            return fetch_packed(self.index, indices, self.fields, self.access)
        batch = fetch(self.index, indices, self.fields, self.copy, self.access)
        if self.transform is not None:
            t = self.transform
            batch = [t(s) for s in batch]
        return batch

    def get(self, key: str) -> Any:
        """The sample with this key (``KeyError`` if there is none)."""
        return self[self.index.position(key)]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_index"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.setdefault("packed", False)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"ShardIndexDataset({os.fspath(self._path)!r}, {self._len} samples, "
            f"fields={self.fields}, copy={self.copy}, access={self.access!r})"
        )
