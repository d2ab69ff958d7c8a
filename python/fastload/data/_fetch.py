"""What the datasets over an index share: finding the index of a source, checking the
fields and access mode asked for, reopening the index in each process, and the batched
native fetch."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import Any, Union

from ..errors import IndexFormatError, stage_error
from ..index import ShardIndex, Shards, default_index_path, expand_shards

__all__ = ["ACCESS", "LocalIndex", "Source", "check_access", "check_fields", "fetch", "index_of"]

_MAGIC = b"\x89FLIDX\r\n"
ACCESS = ("mmap", "read")

Source = Union[ShardIndex, Shards]


def _is_index_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(_MAGIC)) == _MAGIC
    except (IsADirectoryError, FileNotFoundError):
        return False


def index_of(source: Source) -> ShardIndex:
    """A ShardIndex for a source: itself, the index file it names, or the cached index
    of the shards it names (built on first use, reused while no shard changes)."""
    if isinstance(source, ShardIndex):
        return source
    if isinstance(source, (str, os.PathLike)) and _is_index_file(os.fspath(source)):
        return ShardIndex.open(source)
    if isinstance(source, (str, os.PathLike)) and os.fspath(source).endswith(".fidx"):
        name = os.fspath(source)
        if not os.path.exists(name):
            raise stage_error(
                errno.ENOENT,
                f"no index file '{name}': build one with 'fastload index SHARDS -o {name}' "
                "(or ShardIndex.build), or pass the shards themselves",
                name,
            )
    paths = expand_shards(source)
    cached = default_index_path(paths)
    try:
        return ShardIndex.open(cached)
    except (FileNotFoundError, IndexFormatError):
        return ShardIndex.build(paths, cached)


def check_access(access: str) -> str:
    if access not in ACCESS:
        raise ValueError(f"access must be 'mmap' or 'read', not {access!r}")
    return access


def check_fields(index: ShardIndex, fields: Sequence[str] | str | None) -> list[str] | None:
    """``fields`` as a list without repeats (``None``: every field), each checked to be
    a field of the index."""
    if fields is None:
        return None
    if isinstance(fields, str):
        fields = [fields]
    have = set(index.fields)
    missing = [f for f in fields if f not in have]
    if missing:
        raise ValueError(
            f"no field {missing[0]!r} in index {os.fspath(index.path)!r} "
            f"(its fields: {', '.join(index.fields)})"
        )
    return list(dict.fromkeys(fields))


def fetch(
    index: ShardIndex,
    indices: Sequence[int],
    fields: Sequence[str] | None,
    copy: bool,
    access: str,
) -> list[Any]:
    """The samples at ``indices`` as dicts, read in one native call with the GIL
    released (see :class:`~fastload.ShardIndexDataset` for what the values are)."""
    batch: list[Any] = index._native.fetch(indices, fields, copy, access)
    return batch


class LocalIndex:
    """An index opened in this process: reopened on first use after fork() (the parent's
    native state, such as its I/O engine's threads, is not the child's) or unpickling
    (which carries the path only). Reopening is cheap: one mmap, no checksum."""

    def __init__(self, index: ShardIndex) -> None:
        self._index: ShardIndex | None = index
        self._pid = os.getpid()
        self.path = index.path

    def get(self) -> ShardIndex:
        if self._index is None or self._pid != os.getpid():
            self._index = ShardIndex.open(self.path, check=False)
            self._pid = os.getpid()
        return self._index

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._index = None
        self._pid = -1
