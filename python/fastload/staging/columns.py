"""Per-file state held in columns (issue 38): a tree of millions of files costs a few tens
of bytes per file, not Python objects per file.

- :class:`Listing`: a source's entries (paths as one byte blob plus offsets; kind, size,
  blocks, mode and mtime as typed arrays; link targets for the links only), in the
  walk's order. Indexing it gives an :class:`Entry`, so code written for a list of
  entries still works.
- :class:`FileTable`: complete files and their records (size, mtime, mode, chunk digests),
  sorted by path: what a manifest holds. It is written to, and mapped back from, one
  binary file beside ``manifest.json`` (:meth:`FileTable.write`, :meth:`FileTable.read`).
- The files of a listing found or made complete during a stage are in ``done.py``
  (:class:`~fastload.staging.done.Done`), whose ``table()`` is the manifest's table.

Columns are ``array.array`` (or memoryviews of a mapped table), not numpy: a job that
only stages does not import numpy. Paths are encoded with ``os.fsencode`` (UTF-8,
surrogateescape), so their byte order is the order of the native walk and of S3 listings.
"""

from __future__ import annotations

import heapq
import mmap
import operator
import os
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import accumulate, compress, islice
from pathlib import Path
from typing import Any, NamedTuple

from .._util import pieces, position, strictly_sorted

TABLE_MAGIC = b"FLTABLE1"
_HEAD = struct.Struct("<8sQQQ")  # magic, files, path bytes, digest bytes
# A table with tags (an object's identity per file: its ETag or version): the same, then
# the tags' offsets and bytes after the digests.
TAGGED_MAGIC = b"FLTABLE2"
_TAGS = struct.Struct("<Q")  # tag bytes (after _HEAD)

# Entry kinds of a listing (the native walk's).
FILE, DIR, LINK = 0, 1, 2

_SLICE = 65536  # entries converted at a time (Listing.of)

Column = Any  # array("q"/"I"/"B"), or a memoryview cast so, of a mapped table


class Record(NamedTuple):
    """A file known to be complete at its final path (journal and manifest)."""

    size: int
    mtime_ns: int
    mode: int
    digests: str  # hex of the fl64 of each chunk


Records = dict[str, Record]  # path -> its record


class Entry(NamedTuple):
    """One entry of a source's listing (the native walk's tuple, named)."""

    path: str
    kind: int  # FILE, DIR or LINK
    size: int
    blocks: int
    mode: int
    mtime_ns: int
    target: str  # a symbolic link's


def _gather(blob: Any, off: Column, rows: Iterable[int]) -> tuple[bytes, array[int]]:
    """The pieces of ``rows`` (in that order): their blob and offsets."""
    mv = memoryview(blob)
    out = bytearray()
    ends = array("q", [0])
    for r in rows:
        out += mv[off[r] : off[r + 1]]
        ends.append(len(out))
    return bytes(out), ends


def _runs(sel: bytes) -> Iterator[tuple[int, int]]:
    """The runs of 1s in ``sel``, as [start, end) (found at C speed: a run per change)."""
    i = 0
    while (a := sel.find(1, i)) >= 0:
        b = sel.find(0, a)
        i = b if b >= 0 else len(sel)
        yield a, i


class Listing(Sequence[Entry]):
    """A source's entries in columns, in the order given (a walk's: sorted by path)."""

    def __init__(
        self,
        paths: bytes,
        offsets: Column,
        kind: Column,
        size: Column,
        blocks: Column,
        mode: Column,
        mtime_ns: Column,
        targets: dict[int, str],
    ) -> None:
        self.paths, self.offsets = paths, offsets
        self.kind, self.size, self.blocks = kind, size, blocks
        self.mode, self.mtime_ns = mode, mtime_ns
        self.targets = targets  # row -> a link's target
        self._sorted: bool | None = None  # is_sorted(), once known

    @classmethod
    def of(cls, entries: Iterable[tuple[Any, ...]], *, consume: bool = False) -> Listing:
        """From entries (``Entry`` or the native walk's tuples), in their order; taken a
        slice at a time, column by column (C loops, no Python loop per entry). With
        ``consume``, a list given is emptied as it is converted, so its tuples are freed
        while the columns grow."""
        kind, size, blocks = array("B"), array("q"), array("q")
        mode, mtime, ends = array("I"), array("q"), array("q", [0])
        blob = bytearray()
        targets: dict[int, str] = {}
        rows = entries if isinstance(entries, list) else list(entries)
        start = 0
        while rows:
            k = start
            cols = list(zip(*rows[:_SLICE], strict=True))
            if consume or rows is not entries:
                del rows[:_SLICE]
            else:
                rows = rows[_SLICE:]
            start += len(cols[0])
            paths = [p.encode("utf-8", "surrogateescape") for p in cols[0]]
            ends.extend(islice(accumulate(map(len, paths), initial=len(blob)), 1, None))
            blob += b"".join(paths)
            kind.extend(cols[1])
            size.extend(cols[2])
            blocks.extend(cols[3])
            mode.extend(cols[4])
            mtime.extend(cols[5])
            targets.update((k + j, t) for j, t in enumerate(cols[6]) if cols[1][j] == LINK)
        return cls(bytes(blob), ends, kind, size, blocks, mode, mtime, targets)

    @classmethod
    def from_walk(cls, cols: dict[str, Any]) -> Listing:
        """From the columns of ``_core.walk_columns`` (taken out of ``cols``: each
        column's bytes are freed once its array is made, so at most one column is held
        twice)."""

        def col(name: str, code: str) -> array[int]:
            out = array(code)
            out.frombytes(cols.pop(name))
            return out

        offsets, kind = col("offsets", "q"), col("kind", "B")
        size, blocks, mode = col("size", "q"), col("blocks", "q"), col("mode", "I")
        mtime = col("mtime_ns", "q")
        out = cls(cols.pop("paths"), offsets, kind, size, blocks, mode, mtime,
                  cols.pop("targets"))  # fmt: skip
        out._sorted = True  # the walk sorts its paths' bytes, each listed once
        return out

    def __len__(self) -> int:
        return len(self.kind)

    def path_bytes(self) -> Iterator[bytes]:
        """Every path, encoded, in order (one at a time)."""
        return pieces(self.paths, self.offsets)

    def path(self, i: int) -> str:
        return os.fsdecode(self.paths[self.offsets[i] : self.offsets[i + 1]])

    def is_sorted(self) -> bool:
        """Whether the paths are in byte order (a walk's are), each once (checked once:
        a listing's columns are not changed in place)."""
        if self._sorted is None:
            self._sorted = strictly_sorted(self.path_bytes())
        return self._sorted

    def __getitem__(self, i: Any) -> Any:
        i = position(i, len(self))
        if isinstance(i, range):
            return [self[k] for k in i]
        return Entry(self.path(i), self.kind[i], self.size[i], self.blocks[i], self.mode[i],
                     self.mtime_ns[i], self.targets.get(i, ""))  # fmt: skip

    def __iter__(self) -> Iterator[Entry]:
        for i in range(len(self)):
            yield self[i]

    def take(self, rows: Sequence[int]) -> Listing:
        """The rows ``rows``, in that order."""
        blob, off = _gather(self.paths, self.offsets, rows)

        def col(c: Column, code: str) -> array[int]:
            return array(code, (c[r] for r in rows))

        targets = {j: self.targets[r] for j, r in enumerate(rows) if r in self.targets}
        return Listing(blob, off, col(self.kind, "B"), col(self.size, "q"),
                       col(self.blocks, "q"), col(self.mode, "I"), col(self.mtime_ns, "q"),
                       targets)  # fmt: skip

    def of_kind(self, *kinds: int) -> Listing:
        """The entries of these kinds, in order (C loops: the selectors are the kind column
        translated to 0 and 1)."""
        sel = bytes(self.kind).translate(bytes(int(v in kinds) for v in range(256)))
        off = self.offsets
        lengths = compress(map(operator.sub, islice(off, 1, None), off), sel)
        ends = array("q", [0])
        ends.extend(accumulate(lengths))
        mv = memoryview(self.paths)
        blob = b"".join([mv[off[a] : off[b]] for a, b in _runs(sel)])  # a piece per run
        targets, at, below = {}, 0, 0
        for r in sorted(self.targets):
            if sel[r]:
                below += sel.count(1, at, r)  # selected rows before r
                at = r
                targets[below] = self.targets[r]

        def col(c: Column, code: str) -> array[int]:
            return array(code, compress(c, sel))

        out = Listing(blob, ends, col(self.kind, "B"), col(self.size, "q"),
                      col(self.blocks, "q"), col(self.mode, "I"), col(self.mtime_ns, "q"),
                      targets)  # fmt: skip
        if self._sorted:
            out._sorted = True  # a subsequence of sorted paths is sorted
        return out

    def with_paths(self, paths: Iterable[str]) -> Listing:
        """The same entries under other paths (a single file's, named as its destination)."""
        blob = bytearray()
        ends = array("q", [0])
        for p in paths:
            blob += os.fsencode(p)
            ends.append(len(blob))
        return Listing(bytes(blob), ends, self.kind, self.size, self.blocks, self.mode,
                       self.mtime_ns, self.targets)  # fmt: skip

    @property
    def total_bytes(self) -> int:
        return sum(self.size)

    def digest_into(self, h: Any) -> None:
        """Feeds every column to the hash ``h`` (the listing's part of a fingerprint)."""
        for col in (self.offsets, self.paths, self.kind, self.size, self.blocks, self.mode,
                    self.mtime_ns):  # fmt: skip
            h.update(col)
        for i in sorted(self.targets):
            h.update(b"%d\0%s\0" % (i, os.fsencode(self.targets[i])))


class FileTable(Mapping[str, Record]):
    """Complete files and their records, sorted by path (a manifest's files). Digests are
    the raw little-endian fl64 of each chunk; :class:`Record` carries them in hex."""

    def __init__(
        self,
        paths: Any,
        offsets: Column,
        size: Column,
        mtime_ns: Column,
        mode: Column,
        digests: Any,
        digest_offsets: Column,
        tags: tuple[Any, Column] | None = None,
    ) -> None:
        self.paths, self.offsets = paths, offsets
        self.size, self.mtime_ns, self.mode = size, mtime_ns, mode
        self.digests, self.digest_offsets = digests, digest_offsets
        self.tags = tags  # (blob, offsets): each file's tag (an object's identity), or None

    # --- making one ----------------------------------------------------------------------

    @classmethod
    def empty(cls) -> FileTable:
        return cls(b"", array("q", [0]), array("q"), array("q"), array("I"), b"",
                   array("q", [0]))  # fmt: skip

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[str | bytes, int, int, int, Any]]) -> FileTable:
        """From (path, size, mtime_ns, mode, digests as hex or bytes) rows in any order;
        a path given twice keeps its last row."""
        size, mtime, mode = array("q"), array("q"), array("I")
        blob, ends = bytearray(), array("q", [0])
        dig, dends = bytearray(), array("q", [0])
        for p, s, m, md, d in rows:
            size.append(s)
            mtime.append(m)
            mode.append(md)
            blob += p if isinstance(p, bytes) else os.fsencode(p)
            ends.append(len(blob))
            dig += bytes.fromhex(d) if isinstance(d, str) else d
            dends.append(len(dig))
        return cls(bytes(blob), ends, size, mtime, mode, bytes(dig), dends).sorted()

    @classmethod
    def of(cls, records: Mapping[str, Record]) -> FileTable:
        """From a mapping of records (a table is returned as it is)."""
        if isinstance(records, FileTable):
            return records
        return cls.of_rows((p, *r) for p, r in records.items())

    def _key(self, i: int) -> bytes:
        return bytes(self.paths[self.offsets[i] : self.offsets[i + 1]])

    def path_bytes(self) -> Iterator[bytes]:
        return pieces(self.paths, self.offsets)

    def sorted(self) -> FileTable:
        """This table in path order, without duplicate paths (the last row of a path
        wins); itself when it already is."""
        if strictly_sorted(self.path_bytes()):
            return self
        keys = list(self.path_bytes())
        last = {k: i for i, k in enumerate(keys)}
        order = array("q", sorted(last.values(), key=keys.__getitem__))
        del keys, last
        return self.take(order)

    def take(self, rows: Sequence[int]) -> FileTable:
        """The rows ``rows`` (in that order)."""
        blob, off = _gather(self.paths, self.offsets, rows)
        dig, doff = _gather(self.digests, self.digest_offsets, rows)
        tags = None if self.tags is None else _gather(*self.tags, rows)
        return FileTable(blob, off, array("q", (self.size[r] for r in rows)),
                         array("q", (self.mtime_ns[r] for r in rows)),
                         array("I", (self.mode[r] for r in rows)), dig, doff,
                         tags)  # fmt: skip

    def tag(self, i: int) -> bytes | None:
        """File ``i``'s tag (an object's identity), or None where the table has none."""
        if self.tags is None:
            return None
        blob, off = self.tags
        return bytes(blob[off[i] : off[i + 1]])

    def tagged(self, listed: Listing, tags: Iterable[bytes]) -> FileTable:
        """This table with a tag per file: ``tags[i]`` of the file ``listed.path(i)``
        (``listed`` sorted); a file of the table not listed gets an empty tag."""
        same = (self.paths is listed.paths and self.offsets is listed.offsets) or (
            len(self) == len(listed) and memoryview(self.paths) == memoryview(listed.paths)
            and _as_bytes(self.offsets) == _as_bytes(listed.offsets))  # fmt: skip
        rows: Iterable[int] = range(len(self)) if same else self.matches(listed.path_bytes())
        out, ends = bytearray(), array("q", [0])
        at = 0
        for r, t in zip(rows, tags, strict=False):
            if r < 0:
                continue
            while at < r:  # rows without a tag
                ends.append(len(out))
                at += 1
            out += t
            ends.append(len(out))
            at = r + 1
        while at < len(self):
            ends.append(len(out))
            at += 1
        return FileTable(self.paths, self.offsets, self.size, self.mtime_ns, self.mode,
                         self.digests, self.digest_offsets, (out, ends))  # fmt: skip

    # --- reading it --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.size)

    def __iter__(self) -> Iterator[str]:
        return map(os.fsdecode, self.path_bytes())

    def digest(self, i: int) -> bytes:
        return bytes(self.digests[self.digest_offsets[i] : self.digest_offsets[i + 1]])

    def record(self, i: int) -> Record:
        return Record(self.size[i], self.mtime_ns[i], self.mode[i], self.digest(i).hex())

    def find(self, path: str | bytes) -> int:
        """The row of ``path``, or -1 (a binary search)."""
        key = path if isinstance(path, bytes) else os.fsencode(path)
        lo, hi = 0, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._key(mid) < key:
                lo = mid + 1
            else:
                hi = mid
        return lo if lo < len(self) and self._key(lo) == key else -1

    def __getitem__(self, path: str) -> Record:
        i = self.find(path)
        if i < 0:
            raise KeyError(path)
        return self.record(i)

    def __contains__(self, path: object) -> bool:
        return isinstance(path, (str, bytes)) and self.find(path) >= 0

    def items(self) -> Iterator[tuple[str, Record]]:  # type: ignore[override]
        for i, p in enumerate(self):
            yield p, self.record(i)

    def values(self) -> Iterator[Record]:  # type: ignore[override]
        for i in range(len(self)):
            yield self.record(i)

    @property
    def total_bytes(self) -> int:
        return sum(self.size)

    def matches(self, paths: Iterable[bytes]) -> array[int]:
        """For each of ``paths`` (sorted, encoded), its row here or -1: one merge of two
        sorted sequences, no index built."""
        out = array("q")
        mine = self.path_bytes()
        cur, row = next(mine, None), 0
        for p in paths:
            while cur is not None and cur < p:
                cur, row = next(mine, None), row + 1
            out.append(row if cur == p else -1)
        return out

    def without(self, paths: Iterable[str | bytes]) -> FileTable:
        """This table less ``paths``."""
        drop = sorted({p if isinstance(p, bytes) else os.fsencode(p) for p in paths})
        gone = bytearray(len(self))
        for r in self.matches(drop):
            if r >= 0:
                gone[r] = 1
        if not any(gone):
            return self
        return self.take(array("q", (i for i, g in enumerate(gone) if not g)))

    def union(self, other: FileTable) -> FileTable:
        """The rows of both (this table's where both have a path), in path order."""
        rest = other.without(self.path_bytes())
        n = len(self)
        merged = heapq.merge(
            ((k, i) for i, k in enumerate(self.path_bytes())),
            ((k, n + j) for j, k in enumerate(rest.path_bytes())),
        )
        order = array("q", (i for _, i in merged))
        return _concat(self, rest).take(order)

    # --- on disk -------------------------------------------------------------------------

    def write(self, path: Path) -> None:
        """Writes the table to ``path`` (a temporary renamed into place, fsynced)."""
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        magic = TABLE_MAGIC if self.tags is None else TAGGED_MAGIC
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(magic, len(self), len(self.paths), len(self.digests)))
            if self.tags is not None:
                f.write(_TAGS.pack(len(self.tags[0])))
            cols = [(self.offsets, "q"), (self.size, "q"), (self.mtime_ns, "q"),
                    (self.digest_offsets, "q"), (self.mode, "I")]  # fmt: skip
            if self.tags is not None:
                cols.append((self.tags[1], "q"))
            for col, code in cols:
                a = col if isinstance(col, array) else array(code, col)
                if sys.byteorder != "little":
                    a = array(code, a)
                    a.byteswap()
                f.write(a)
            f.write(self.paths)
            f.write(self.digests)
            if self.tags is not None:
                f.write(self.tags[0])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> FileTable:
        """Maps a table written by :meth:`write` (its pages are read as they are used).
        Raises ValueError naming ``path`` when it is not one, or torn."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEAD.size:
                raise ValueError(f"'{path}': not a fastload file table (too short)")
            buf = memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        magic, n, npaths, ndig = _HEAD.unpack_from(buf, 0)
        ntags, extra, pos = 0, 0, _HEAD.size
        if magic == TAGGED_MAGIC and size >= _HEAD.size + _TAGS.size:
            (ntags,) = _TAGS.unpack_from(buf, pos)
            pos += _TAGS.size
            extra = _TAGS.size + 8 * (n + 1) + ntags
        elif magic != TABLE_MAGIC:
            raise ValueError(f"'{path}': not a fastload file table")
        if size != _HEAD.size + 8 * (4 * n + 2) + 4 * n + npaths + ndig + extra:
            raise ValueError(f"'{path}': not a fastload file table, or torn")

        def col(code: str, count: int, width: int) -> Any:
            nonlocal pos
            view = buf[pos : pos + count * width]
            pos += count * width
            if sys.byteorder != "little" and code != "B":
                a = array(code, view.tobytes())
                a.byteswap()
                return a
            return view.cast(code) if code != "B" else view  # type: ignore[call-overload]

        off, sz, mt = col("q", n + 1, 8), col("q", n, 8), col("q", n, 8)
        doff, mode = col("q", n + 1, 8), col("I", n, 4)
        toff = col("q", n + 1, 8) if magic == TAGGED_MAGIC else None
        paths, dig = col("B", npaths, 1), col("B", ndig, 1)
        tags = None if toff is None else (col("B", ntags, 1), toff)
        return cls(paths, off, sz, mt, mode, dig, doff, tags)


def _as_bytes(col: Column) -> memoryview:
    mv = memoryview(col)
    return mv if mv.format == "B" else mv.cast("B")


def _concat(a: FileTable, b: FileTable) -> FileTable:
    def cat(x: Column, y: Column, code: str) -> array[int]:
        out = array(code, x)
        out.extend(y)
        return out

    def cat_off(x: Column, y: Column) -> array[int]:
        out = array("q", x)
        base = x[-1]
        out.extend(v + base for v in y[1:])
        return out

    return FileTable(bytes(a.paths) + bytes(b.paths), cat_off(a.offsets, b.offsets),
                     cat(a.size, b.size, "q"), cat(a.mtime_ns, b.mtime_ns, "q"),
                     cat(a.mode, b.mode, "I"), bytes(a.digests) + bytes(b.digests),
                     cat_off(a.digest_offsets, b.digest_offsets))  # fmt: skip
