"""ShardIndexDataset: a map-style PyTorch dataset over indexed tar shards."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Callable

from torch.utils.data import Dataset

from ..cache import is_remote
from ..index import ShardIndex
from ..sources.objstore import StorageOptions
from . import _probe
from ._fetch import Source, check_access, check_fields, fetch, index_of
from ._remote import FETCH, RemoteReader, open_remote
from .collate import collate as pack_samples
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

    **Object storage.** ``source`` may name shards in a bucket: ``"s3://bucket/train-
    {000000..000999}.tar"`` (braces, globs, a prefix ending in ``/``, a list of URLs;
    ``gs://`` and ``az://`` too; ``storage_options`` as for :func:`fastload.stage`).
    Shards are read through a node-local cache (``cache_dir``, default the environment's
    ``tmpdir``/``cache``) holding at most ``cache_limit`` bytes (an int or ``"50GB"``;
    ``None``: no limit): each shard is downloaded whole, once per node whichever process
    asks first, and evicted least recently used first, never while a process reads it
    (see :mod:`fastload.cache`). The index comes from ``index.fidx`` beside the shards
    (what ``pack`` writes) when it describes them, else it is built once from the
    shards' headers and kept in the cache. ``fetch="range"`` reads each sample with one
    ranged GET instead of downloading its shard (sparse access); values are then
    ``bytes``. Samples and their positions are those of the same shards read locally.

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
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: StorageOptions | None = None,
        fetch: str = "shard",
    ) -> None:
        check_access(access)
        if fetch not in FETCH:
            raise ValueError(f"fetch must be 'shard' or 'range', not {fetch!r}")
        if packed and (transform is not None or copy):
            raise ValueError(
                "packed=True returns PackedBatches: transform and copy apply to dicts only "
                "(transform the packed batch in a collate_fn instead)"
            )
        self._remote: RemoteReader | None = None
        if is_remote(source):
            assert isinstance(source, (str, list, tuple))
            self._remote = open_remote(source, cache_dir, cache_limit, storage_options,
                                       "ShardIndexDataset")
            index = self._remote.get()
        else:
            index = index_of(source)
        self.fetch = fetch
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
        if self._remote is not None:
            return self._remote.get()
        if self._index is None or self._pid != os.getpid():
            # After fork() the parent's native state (its I/O engine's threads) is not
            # ours; the index is reopened, which is cheap (one mmap, one checksum).
            self._index = ShardIndex.open(self._path, check=False)
            self._pid = os.getpid()
        return self._index

    def __len__(self) -> int:
        return self._len

    def _read(self, indices: Sequence[int]) -> list[Any]:
        if self._remote is None:
            return fetch(self.index, indices, self.fields, self.copy, self.access)
        if self.fetch == "range":
            return self._remote.read_ranges(indices, self.fields)
        fields, copy, access = self.fields, self.copy, self.access
        return self._remote.read(
            indices, lambda ix, ids: fetch(ix, ids, fields, copy, access)
        )

    def __getitem__(self, i: int) -> Any:
        sample = _probe.timed(_probe.READ, self._read)([i])[0]
        t = _probe.timed(_probe.TRANSFORM, self.transform)
        return sample if t is None else t(sample)

    def __getitems__(self, indices: Sequence[int]) -> Any:
        read = _probe.timed(_probe.READ, self._read)  # itself unless a monitor is on
        if self.packed:
            if self._remote is None:
                return _probe.timed(_probe.READ, fetch_packed)(
                    self.index, indices, self.fields, self.access)
            return _probe.timed(_probe.COLLATE, pack_samples)(read(indices), fields=self.fields)
        batch = read(indices)
        if self.transform is not None:
            t = self.transform
            if _probe.ACTIVE is None:
                batch = [t(s) for s in batch]
            else:
                batch = _probe.ACTIVE.timed(_probe.TRANSFORM, lambda b: [t(s) for s in b])(batch)
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
        self.__dict__.setdefault("_remote", None)
        self.__dict__.setdefault("fetch", "shard")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"ShardIndexDataset({os.fspath(self._path)!r}, {self._len} samples, "
            f"fields={self.fields}, copy={self.copy}, access={self.access!r})"
        )
