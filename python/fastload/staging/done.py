"""The files of a listing found or made complete during a stage, in columns (issue 38):
:class:`Done`, whose :meth:`Done.table` is the manifest's table (``columns.py`` has the
listing and the table themselves)."""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Iterator, Mapping
from itertools import compress, repeat
from typing import Any

from .columns import Column, FileTable, Listing, Record, _gather

__all__ = ["Done", "LockedDone"]


def _ones(flags: bytes | bytearray) -> Iterable[int]:
    """The places of the non-zero bytes of ``flags``."""
    return compress(range(len(flags)), flags)


class Done(Mapping[str, Record]):
    """The files of a listing (``files``) that are complete: rows of an earlier stage's
    table (``base``, ``base_rows[i]`` the row of file ``i`` there, -1 for none), and
    files this stage completed, set by row (:meth:`set`) or by path. A record set is its
    digests (appended to one blob, in the order files finish) and, only where they differ
    from the listing's, its size, time and mode: a file copied as listed costs 16 bytes
    here besides its digests. :meth:`table` is what the manifest records.

    :meth:`set` and :meth:`set_listed` may be called from several threads at once (the
    fan-out writers finish files on 8): a record's place and its digests are appended
    under a lock, else two files could take the same place and one the other's digests."""

    def __init__(
        self, files: Listing, base: FileTable | None = None, base_rows: Column | None = None
    ) -> None:
        n = len(files)
        self.files = files
        self.base = base if base is not None else FileTable.empty()
        self.base_rows = base_rows if base_rows is not None else array("q", [-1]) * n
        # row -> its digests' place in _dig/_dend, -1 for none (made at the first set):
        self._at: array[int] | None = None
        self._dig, self._dend = bytearray(), array("q", [0])
        self._other: dict[int, tuple[int, int, int]] = {}  # row -> (size, mtime, mode) not listed
        self._rows: dict[str, int] | None = None
        self._lock = threading.Lock()
        bsize = self.base.size
        # Kept up by set():
        self._count = sum(1 for r in self.base_rows if r >= 0)
        self._bytes = sum(bsize[r] for r in self.base_rows if r >= 0)

    def _meta(self, i: int) -> tuple[int, int, int]:
        """Row ``i``'s size, mtime and mode as set (the listing's unless told otherwise)."""
        got = self._other.get(i)
        if got is not None:
            return got
        f = self.files
        return f.size[i], f.mtime_ns[i], f.mode[i]

    def set(self, i: int, rec: Record | tuple[int, int, int, Any]) -> None:
        """Row ``i`` is complete with record ``rec`` (digests as hex or bytes); set again,
        the last record wins."""
        with self._lock:
            self._set(i, rec)

    def _set(self, i: int, rec: Record | tuple[int, int, int, Any]) -> None:
        if self._at is None:
            self._at = array("q", [-1]) * len(self.files)
        d, k, b = rec[3], self._at[i], self.base_rows[i]
        if k >= 0:
            self._bytes -= self._meta(i)[0]
        elif b >= 0:
            self._bytes -= self.base.size[b]
        else:
            self._count += 1
        self._bytes += rec[0]
        self._at[i] = len(self._dend) - 1
        meta = (rec[0], rec[1], rec[2])
        f = self.files
        if meta != (f.size[i], f.mtime_ns[i], f.mode[i]):
            self._other[i] = meta
        else:
            self._other.pop(i, None)
        self._dig += bytes.fromhex(d) if isinstance(d, str) else d
        self._dend.append(len(self._dig))

    def set_listed(self, rows: Iterable[int], digests: Iterable[bytes]) -> None:
        """Rows complete as listed (the listing's size, time and mode), each with its raw
        digests: :meth:`set` for a copier's batch, without a record per file."""
        with self._lock:
            self._set_listed(rows, digests)

    def _set_listed(self, rows: Iterable[int], digests: Iterable[bytes]) -> None:
        if self._at is None:
            self._at = array("q", [-1]) * len(self.files)
        at, base_rows, other = self._at, self.base_rows, self._other
        fsize, dig, dend = self.files.size, self._dig, self._dend
        count, nbytes = self._count, self._bytes
        for i, d in zip(rows, digests, strict=True):
            if at[i] >= 0:
                nbytes -= self._meta(i)[0]
            elif base_rows[i] >= 0:
                nbytes -= self.base.size[base_rows[i]]
            else:
                count += 1
            nbytes += fsize[i]
            at[i] = len(dend) - 1
            if other:
                other.pop(i, None)
            dig += d
            dend.append(len(dig))
        self._count, self._bytes = count, nbytes

    def row(self, path: str) -> int:
        if self._rows is None:
            self._rows = {self.files.path(i): i for i in range(len(self.files))}
        return self._rows[path]

    def __setitem__(self, path: str, rec: Record) -> None:
        self.set(self.row(path), rec)

    def _set_rows(self) -> Iterable[int]:
        """For each file, its digests' place, or -1 (not set by this stage)."""
        return self._at if self._at is not None else repeat(-1, len(self.files))

    def mask(self) -> bytearray:
        """1 for each file that is complete."""
        return bytearray(
            a >= 0 or b >= 0 for a, b in zip(self._set_rows(), self.base_rows, strict=True)
        )

    def mask_bits(self) -> bytes:
        """The complete files as a bitmap (bit ``i % 8`` of byte ``i // 8``)."""
        m = self.mask()
        n = len(m)
        out = bytearray((n + 7) // 8)
        for bit in range(8):
            col = m[bit::8]  # the files i with i % 8 == bit, one per byte of the bitmap
            for k in _ones(col):
                out[k] |= 1 << bit
        return bytes(out)

    def rows(self) -> list[int]:
        """The complete files' rows."""
        return list(compress(range(len(self.files)), self.mask()))

    def __len__(self) -> int:
        return self._count

    def is_done(self, i: int) -> bool:
        return (self._at is not None and self._at[i] >= 0) or self.base_rows[i] >= 0

    def _record(self, i: int) -> Record:
        k = self._at[i] if self._at is not None else -1
        if k < 0:
            return self.base.record(self.base_rows[i])
        d = bytes(self._dig[self._dend[k] : self._dend[k + 1]])
        return Record(*self._meta(i), d.hex())

    def __iter__(self) -> Iterator[str]:
        for i in self.rows():
            yield self.files.path(i)

    def __getitem__(self, path: str) -> Record:
        try:
            i = self.row(path)
        except KeyError:
            raise KeyError(path) from None
        if not self.is_done(i):
            raise KeyError(path)
        return self._record(i)

    def items(self) -> Iterator[tuple[str, Record]]:  # type: ignore[override]
        for i in self.rows():
            yield self.files.path(i), self._record(i)

    def values(self) -> Iterator[Record]:  # type: ignore[override]
        for i in self.rows():
            yield self._record(i)

    @property
    def total_bytes(self) -> int:
        return int(self._bytes)

    def table(self) -> FileTable:
        """The complete files as a table: the earlier table's rows kept, this stage's
        records added (each sorted by path, then merged)."""
        at = self._set_rows()
        kept = self.base.take(
            sorted(b for k, b in zip(at, self.base_rows, strict=True) if k < 0 and b >= 0)
        )
        if self._at is None:
            return kept.sorted()
        files = self.files
        if not self._other and len(files) and self._at.count(-1) == 0:
            # Every file done by this stage, as listed: the listing's columns are the
            # table's (shared, not copied); only the digests are put in listing order.
            dig, doff = _gather(self._dig, self._dend, self._at)
            whole = FileTable(files.paths, files.offsets, files.size, files.mtime_ns,
                              files.mode, dig, doff)  # fmt: skip
            whole = whole if files.is_sorted() else whole.sorted()
            return kept.sorted().union(whole) if len(kept) else whole
        mine = array("q", (i for i, k in enumerate(self._at) if k >= 0))  # in listing order
        paths, off = _gather(files.paths, files.offsets, mine)
        dig, doff = _gather(self._dig, self._dend, (self._at[i] for i in mine))
        size, mtime, mode = array("q"), array("q"), array("I")
        if self._other:
            for i in mine:
                s, t, m = self._meta(i)
                size.append(s)
                mtime.append(t)
                mode.append(m)
        else:
            size.extend(files.size[i] for i in mine)
            mtime.extend(files.mtime_ns[i] for i in mine)
            mode.extend(files.mode[i] for i in mine)
        del mine
        fresh = FileTable(paths, off, size, mtime, mode, dig, doff).sorted()
        if not len(fresh):
            return kept.sorted()
        return kept.sorted().union(fresh) if len(kept) else fresh


class LockedDone:
    """A stage's :class:`Done` under a lock (a stage in the background's, schedule.py:
    two jobs complete files of it at once); every change wakes the readers waiting."""

    def __init__(self, done: Done, cond: threading.Condition) -> None:
        self._done, self._cond = done, cond

    def set(self, i: int, rec: Any) -> None:
        with self._cond:
            self._done.set(i, rec)
            self._cond.notify_all()

    def set_listed(self, rows: Iterable[int], digests: Iterable[bytes]) -> None:
        rows, digests = list(rows), list(digests)
        with self._cond:
            self._done.set_listed(rows, digests)
            self._cond.notify_all()

    def is_done(self, i: int) -> bool:
        with self._cond:
            return self._done.is_done(i)

    def __len__(self) -> int:
        with self._cond:
            return len(self._done)

    @property
    def total_bytes(self) -> int:
        with self._cond:
            return self._done.total_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._done, name)
