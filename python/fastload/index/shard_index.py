"""ShardIndex: a memory-mapped index of webdataset-style tar shards.

An index file (``.fidx``, described in ``docs/index-format.md``) lists every sample of a
set of tar shards: its key, its shard, and the offset and size of each of its members.
It is built by scanning tar headers only (in parallel, in C++) and opened with mmap, so
opening it costs the same for a thousand samples as for a million.

>>> idx = ShardIndex.build("data/shard-{000000..000099}.tar", "data/train.fidx")
>>> idx = ShardIndex.open("data/train.fidx")
>>> len(idx), idx.fields
>>> idx[0].key, idx.lookup("sample00000042").members
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from .. import _core
from ..errors import IndexFormatError
from .shards import PathLike, Shards, default_index_path, expand_shards

__all__ = ["IndexMember", "SampleInfo", "ShardIndex", "ShardInfo"]




class IndexMember(NamedTuple):
    """One member (file) of a sample: its field name and where its bytes lie."""

    field: str
    offset: int
    size: int


class SampleInfo(NamedTuple):
    """Where a sample lies: its position, key, shard and members."""

    position: int
    key: str
    shard: str
    members: tuple[IndexMember, ...]

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(m.field for m in self.members)


class ShardInfo(NamedTuple):
    """A shard as recorded in the index."""

    path: str
    """The path to open (the recorded path, resolved against the index's folder)."""
    stored_path: str
    """The path as recorded: relative to the index's folder, unless absolute."""
    size: int
    mtime_ns: int
    first_sample: int
    samples: int








def _stored_path(shard: str, index_dir: str) -> str:
    """The shard's path relative to the index's folder (absolute if that fails)."""
    try:
        return os.path.relpath(os.path.abspath(shard), index_dir)
    except ValueError:
        return os.path.abspath(shard)


class ShardIndex:
    """An opened shard index. Build one with :meth:`build`, open one with :meth:`open`.

    ``len(idx)`` samples; ``idx[i]`` and ``idx.lookup(key)`` give a :class:`SampleInfo`;
    ``idx.position(key)`` the position of a key; ``idx.shards`` the shard list;
    ``idx.fields`` every field name. Pickles as its path (reopened on unpickling).
    """

    def __init__(self, native: Any, path: Path) -> None:
        self._native = native
        self._path = path

    # --- making and opening -------------------------------------------------------------

    @classmethod
    def build(
        cls,
        shards: Shards,
        path: PathLike | None = None,
        *,
        on_duplicate: str = "error",
        threads: int | None = None,
    ) -> ShardIndex:
        """Scans the shards (tar headers only, ``threads`` at a time; default: one per
        CPU) and writes the index to ``path`` atomically (default: a cache folder, see
        :func:`default_index_path`). ``on_duplicate``: a key seen twice is an error
        (``"error"``) or keeps its first sample (``"first"``). Raises
        :class:`~fastload.TarFormatError` for malformed or compressed shards and members
        without a key, ``FileNotFoundError`` for missing shards."""
        if on_duplicate not in ("error", "first"):
            raise ValueError(f"on_duplicate must be 'error' or 'first', not {on_duplicate!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        paths = expand_shards(shards)
        dest = Path(os.path.abspath(path if path is not None else default_index_path(paths)))
        dest.parent.mkdir(parents=True, exist_ok=True)
        index_dir = os.path.abspath(dest.parent)
        stored = [_stored_path(p, index_dir) for p in paths]
        _core.build_index(paths, stored, os.fspath(dest), on_duplicate, threads or 0)
        return cls(_core.Index(os.fspath(dest), check_shards=False), dest)

    @classmethod
    def open(cls, path: PathLike, *, rebuild: bool = False, check: bool = True) -> ShardIndex:
        """Opens an index, checking magic, version and checksum, and (``check``) that
        every shard still has the size and mtime it was indexed with. A stale or
        corrupt index raises :class:`~fastload.IndexFormatError` saying what is wrong;
        with ``rebuild=True`` a stale one is rebuilt from its shards instead."""
        p = Path(os.path.abspath(path))
        try:
            return cls(_core.Index(os.fspath(p), check_shards=check), p)
        except IndexFormatError:
            if not rebuild:
                raise
        # Stale: the shard list is still readable. A corrupt index raises again here.
        old = _core.Index(os.fspath(p), check_shards=False)
        shards = [old.shard(i)[1] for i in range(old.shard_count)]
        policy = str(old.info()["on_duplicate"])
        del old
        return cls.build(shards, p, on_duplicate=policy)

    # --- the index ----------------------------------------------------------------------

    @property
    def path(self) -> Path:
        return self._path

    def __len__(self) -> int:
        return len(self._native)

    def __getitem__(self, i: int) -> SampleInfo:
        n = len(self._native)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        key, shard, members = self._native.sample(j)
        return SampleInfo(
            j,
            key,
            self._native.shard(shard)[1],
            tuple(IndexMember(f, o, s) for f, o, s in members),
        )

    def __iter__(self) -> Iterator[SampleInfo]:
        for i in range(len(self)):
            yield self[i]

    def position(self, key: str) -> int:
        """The position of the sample with this key; ``KeyError`` if there is none."""
        i = self._native.find(key)
        if i is None:
            raise KeyError(key)
        return int(i)

    def lookup(self, key: str) -> SampleInfo:
        """The sample with this key; ``KeyError`` if there is none."""
        return self[self.position(key)]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._native.find(key) is not None

    def keys(self) -> list[str]:
        """Every key, in sample order."""
        return list(self._native.keys())

    @property
    def fields(self) -> list[str]:
        """Every field name found in the shards, in order of first appearance."""
        return list(self._native.fields)

    @property
    def shards(self) -> list[ShardInfo]:
        out = []
        for i in range(self._native.shard_count):
            stored, path, size, mtime_ns, first, count = self._native.shard(i)
            out.append(ShardInfo(path, stored, size, mtime_ns, first, count))
        return out

    def info(self) -> dict[str, Any]:
        """The header's facts: version, counts, file size, duplicate policy."""
        d: dict[str, Any] = dict(self._native.info())
        d["path"] = os.fspath(self._path)
        return d

    def check(self) -> None:
        """Raises :class:`~fastload.IndexFormatError` if a shard changed since indexing."""
        self._native.check_shards()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (os.fspath(self._path),))

    def __repr__(self) -> str:
        return (
            f"ShardIndex({os.fspath(self._path)!r}: {len(self)} samples in "
            f"{self._native.shard_count} shards, fields {self.fields})"
        )


def _reopen(path: str) -> ShardIndex:
    return ShardIndex.open(path)
