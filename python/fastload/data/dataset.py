"""ShardIndexDataset: a map-style PyTorch dataset over indexed tar shards."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Callable, Union

from torch.utils.data import Dataset

from ..errors import IndexFormatError
from ..index import ShardIndex, Shards, default_index_path, expand_shards

__all__ = ["ShardIndexDataset"]

_MAGIC = b"\x89FLIDX\r\n"
_ACCESS = ("mmap", "read")

Source = Union[ShardIndex, Shards]


def _is_index_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except (IsADirectoryError, FileNotFoundError):
        return False


def _index_of(source: Source) -> ShardIndex:
    """A ShardIndex for a source: itself, the index file it names, or the cached index
    of the shards it names (built on first use, reused while no shard changes)."""
    if isinstance(source, ShardIndex):
        return source
    if isinstance(source, (str, os.PathLike)) and _is_index_file(os.fspath(source)):
        return ShardIndex.open(source)
    paths = expand_shards(source)
    cached = default_index_path(paths)
    try:
        return ShardIndex.open(cached)
    except (FileNotFoundError, IndexFormatError):
        return ShardIndex.build(paths, cached)


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
    ) -> None:
        if access not in _ACCESS:
            raise ValueError(f"access must be 'mmap' or 'read', not {access!r}")
        if isinstance(fields, str):
            fields = [fields]
        index = _index_of(source)
        if fields is not None:
            have = set(index.fields)
            missing = [f for f in fields if f not in have]
            if missing:
                raise ValueError(
                    f"no field {missing[0]!r} in index {os.fspath(index.path)!r} "
                    f"(its fields: {', '.join(index.fields)})"
                )
            fields = list(dict.fromkeys(fields))
        self._index: ShardIndex | None = index
        self._pid = os.getpid()
        self._path = index.path
        self._len = len(index)
        self.fields: list[str] | None = None if fields is None else list(fields)
        self.transform = transform
        self.copy = copy
        self.access = access

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
        sample = self.index._native.fetch([i], self.fields, self.copy, self.access)[0]
        return sample if self.transform is None else self.transform(sample)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        batch: list[Any] = self.index._native.fetch(indices, self.fields, self.copy, self.access)
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
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"ShardIndexDataset({os.fspath(self._path)!r}, {self._len} samples, "
            f"fields={self.fields}, copy={self.copy}, access={self.access!r})"
        )
