"""A listing of objects in columns (issue 38): a prefix of millions of keys costs its keys'
and ETags' bytes plus a few typed arrays, not an :class:`ObjectInfo` per key.

:class:`ObjectList` is built a listing page (1,000 keys) at a time (:meth:`ObjectList.add`
per key's metadata, no object kept per key) and reads as a ``Sequence[ObjectInfo]``: an
ObjectInfo is made on demand for the one object asked for. Keys are encoded as
``os.fsencode`` does (UTF-8, surrogateescape), so their byte order is the store's and the
native walk's. It pickles as its columns (what fan-out's node 0 sends the others).
"""

from __future__ import annotations

import dataclasses
import operator
import re
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import accumulate, compress, islice
from typing import Any

from .._util import pieces, position, strictly_sorted

__all__ = ["ObjectInfo", "ObjectList", "compact_identity"]

_MD5 = re.compile(rb'"[0-9a-f]{32}"')


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object: its key relative to the listed prefix, size, ETag and time."""

    key: str
    size: int
    etag: str | None
    mtime_ns: int
    version: str | None = None

    @property
    def identity(self) -> str:
        """What changes whenever the object's content may have changed."""
        return self.version or self.etag or f"{self.size}:{self.mtime_ns}"


def _enc(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def _dec(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


class ObjectList(Sequence[ObjectInfo]):
    """Objects in columns: keys (one blob plus offsets), sizes and times (``array("q")``),
    ETags and versions (the offsets of versions made only once a version is seen: an
    unversioned bucket pays nothing for them). ETags are 16 raw bytes each while every
    one is an MD5's (``"`` and 32 hex digits and ``"``, what S3 gives an object not
    uploaded in parts); from the first other one on, a blob of them plus offsets (empty
    for none). It pickles with each key's length in 2 bytes (4 for a long one)."""

    def __init__(self) -> None:
        self.keys: bytes | bytearray = bytearray()
        self.key_ends = array("q", [0])
        self.size = array("q")
        self.mtime_ns = array("q")
        self.etags = bytearray()
        self.etag_ends: array[int] | None = None  # None: 16 raw bytes per ETag
        self.versions = bytearray()
        self.version_ends: array[int] | None = None
        # The keys as the bucket stores them, of the few objects listed under another
        # name (a key with a leading "/": placed without it): name -> stored key.
        self.stored: dict[str, str] = {}

    # --- building ----------------------------------------------------------------------

    def append(self, key: str, size: int, etag: str | None, mtime_ns: int,
               version: str | None = None) -> None:  # fmt: skip
        self.keys += _enc(key)
        self.key_ends.append(len(self.keys))
        self.size.append(size)
        self.mtime_ns.append(mtime_ns)
        self._put_etag(_enc(etag) if etag else b"")
        if version and self.version_ends is None:
            self.version_ends = array("q", [0]) * len(self.size)
        if self.version_ends is not None:
            if version:
                self.versions += _enc(version)
            self.version_ends.append(len(self.versions))

    def add(self, key: str, meta: Mapping[str, Any]) -> None:
        """One object of a listing page (obstore's metadata dict), under ``key``."""
        when = meta.get("last_modified")
        mtime_ns = int(when.timestamp() * 1e9) if when is not None else 0
        self.append(key, int(meta["size"]), meta.get("e_tag"), mtime_ns, meta.get("version"))

    @classmethod
    def of(cls, objects: Iterable[ObjectInfo]) -> ObjectList:
        out = cls()
        for o in objects:
            out.append(o.key, o.size, o.etag, o.mtime_ns, o.version)
        return out

    def take(self, rows: Iterable[int]) -> ObjectList:
        """The rows ``rows``, in that order."""
        out = ObjectList()
        out.stored = self.stored
        if self.version_ends is not None:
            out.version_ends = array("q", [0])
        k, v = memoryview(self.keys), memoryview(self.versions)
        ko, vo = self.key_ends, self.version_ends
        for r in rows:
            out.keys += k[ko[r] : ko[r + 1]]
            out.key_ends.append(len(out.keys))
            out.size.append(self.size[r])
            out.mtime_ns.append(self.mtime_ns[r])
            out._put_etag(self._etag_bytes(r))
            if vo is not None and out.version_ends is not None:
                out.versions += v[vo[r] : vo[r + 1]]
                out.version_ends.append(len(out.versions))
        return out

    def placed(self, names: Mapping[int, str]) -> ObjectList:
        """A copy with the keys of the rows in ``names`` replaced by those names, sorted
        again; :meth:`stored_key` still gives each one's key as stored."""
        if not names:
            return self
        out = ObjectList()
        out.keys = bytearray()
        out.key_ends = array("q", [0])
        stored = dict(self.stored)
        for i, key in enumerate(self.key_bytes()):
            if i in names:
                stored[names[i]] = _dec(key)
                key = _enc(names[i])
            out.keys += key
            out.key_ends.append(len(out.keys))
        out.size, out.mtime_ns = self.size, self.mtime_ns
        out.etags, out.etag_ends = self.etags, self.etag_ends
        out.versions, out.version_ends = self.versions, self.version_ends
        out.stored = stored
        return out.sorted().frozen()

    def select(self, keep: bytes | bytearray) -> ObjectList:
        """The rows whose byte in ``keep`` is not 0, in order (itself when all are)."""
        if keep.count(0) == 0:
            return self
        return self.take(compress(range(len(self)), keep))

    def sorted(self) -> ObjectList:
        """In key byte order (itself when it already is); a key listed twice is kept once
        (the first)."""
        if strictly_sorted(self.key_bytes()):
            return self
        order = sorted(range(len(self)), key=self.key)
        rows = array("q")
        last = None
        for r in order:
            k = self.key(r)
            if k != last:
                rows.append(r)
            last = k
        del order
        return self.take(rows)

    def extend(self, other: ObjectList, rows: range | None = None) -> None:
        """Appends ``other``'s rows (all, or ``rows``: consecutive) at C speed."""
        r = rows if rows is not None else range(len(other))
        if not len(r):
            return
        a, b = r.start, r.stop
        kb = len(self.keys) - other.key_ends[a]
        self.keys += memoryview(other.keys)[other.key_ends[a] : other.key_ends[b]]
        self.key_ends.extend(e + kb for e in other.key_ends[a + 1 : b + 1])
        self.size.extend(other.size[a:b])
        self.mtime_ns.extend(other.mtime_ns[a:b])
        mine, theirs = self.etag_ends, other.etag_ends
        if mine is None and theirs is None:
            self.etags += memoryview(other.etags)[16 * a : 16 * b]
        elif mine is not None and theirs is not None:
            eb = len(self.etags) - theirs[a]
            self.etags += memoryview(other.etags)[theirs[a] : theirs[b]]
            mine.extend(e + eb for e in theirs[a + 1 : b + 1])
        else:
            for i in r:
                self._put_etag(other._etag_bytes(i))
        if other.version_ends is not None and self.version_ends is None:
            self.version_ends = array("q", [0]) * (len(self.size) - (b - a) + 1)
        if self.version_ends is not None:
            if other.version_ends is None:
                self.version_ends.extend(array("q", [len(self.versions)]) * (b - a))
            else:
                vo = other.version_ends
                vb = len(self.versions) - vo[a]
                self.versions += memoryview(other.versions)[vo[a] : vo[b]]
                self.version_ends.extend(e + vb for e in vo[a + 1 : b + 1])

    @classmethod
    def joined(cls, top: ObjectList, parts: list[ObjectList]) -> ObjectList:
        """One sorted list of ``parts`` (each sorted, in order, apart: a folder's listing
        each) and ``top`` (a few keys, each sorting before or after a whole part), built
        in place: each part is let go of (taken out of ``parts``) once appended, so the
        whole is held about once. Sorted after all where the parts were not so."""
        top = top.sorted()
        out = cls()
        t = 0
        parts.reverse()
        while parts:
            p = parts.pop()
            if not len(p):
                continue
            first = p.key(0)
            start = t
            while t < len(top) and top.key(t) < first:
                t += 1
            out.extend(top, range(start, t))
            out.extend(p)
            del p
        out.extend(top, range(t, len(top)))
        return out.sorted().frozen()

    def frozen(self) -> ObjectList:
        """Itself with its keys as ``bytes`` (a listing's paths are: shared, not
        copied, by the plan), once built."""
        self.keys = bytes(self.keys)
        return self

    # --- reading -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.size)

    def key(self, i: int) -> bytes:
        return bytes(self.keys[self.key_ends[i] : self.key_ends[i + 1]])

    def key_str(self, i: int) -> str:
        return _dec(self.key(i))

    def stored_key(self, i: int) -> str:
        """Object ``i``'s key as the bucket stores it (relative to the listed prefix): its
        key, unless it was listed under another name (:meth:`placed`)."""
        key = self.key_str(i)
        return self.stored.get(key, key) if self.stored else key

    def key_bytes(self) -> Iterator[bytes]:
        """Every key, encoded, in order."""
        return pieces(self.keys, self.key_ends)

    def _put_etag(self, etag: bytes) -> None:
        """Appends an ETag (encoded; empty for none)."""
        if self.etag_ends is None:
            if _MD5.fullmatch(etag):
                self.etags += bytes.fromhex(etag[1:33].decode())
                return
            # The first ETag that is not an MD5's: every one kept as it is from now on.
            raw, n = self.etags, len(self.etags) // 16
            self.etags, self.etag_ends = bytearray(), array("q", [0])
            for k in range(n):
                self.etags += b'"%s"' % raw[16 * k : 16 * k + 16].hex().encode()
                self.etag_ends.append(len(self.etags))
        self.etags += etag
        self.etag_ends.append(len(self.etags))

    def _etag_bytes(self, i: int) -> bytes:
        ends = self.etag_ends
        if ends is None:
            return b'"%s"' % self.etags[16 * i : 16 * i + 16].hex().encode()
        return bytes(self.etags[ends[i] : ends[i + 1]])

    def etag(self, i: int) -> str | None:
        if self.etag_ends is None:  # an MD5's: made as a str at once (one per GET)
            return f'"{self.etags[16 * i : 16 * i + 16].hex()}"'
        got = self._etag_bytes(i)
        return _dec(got) if got else None

    def version(self, i: int) -> str | None:
        ends = self.version_ends
        if ends is None or ends[i + 1] == ends[i]:
            return None
        return _dec(bytes(self.versions[ends[i] : ends[i + 1]]))

    def identity(self, i: int) -> bytes:
        """Object ``i``'s :attr:`ObjectInfo.identity`, encoded."""
        ends = self.version_ends
        if ends is not None and ends[i + 1] > ends[i]:
            return bytes(self.versions[ends[i] : ends[i + 1]])
        etag = self._etag_bytes(i)
        return etag or b"%d:%d" % (self.size[i], self.mtime_ns[i])

    def tag(self, i: int) -> bytes:
        """Object ``i``'s identity as a manifest records it (:func:`compact_identity`)."""
        ends = self.version_ends
        if self.etag_ends is None and (ends is None or ends[i + 1] == ends[i]):
            return bytes(self.etags[16 * i : 16 * i + 16])
        return compact_identity(self.identity(i))

    def __getitem__(self, i: Any) -> Any:
        i = position(i, len(self))
        if isinstance(i, range):
            return [self[k] for k in i]
        return ObjectInfo(self.stored_key(i), self.size[i], self.etag(i), self.mtime_ns[i],
                          self.version(i))  # fmt: skip

    def __iter__(self) -> Iterator[ObjectInfo]:
        for i in range(len(self)):
            yield self[i]

    def digest_into(self, h: Any) -> None:
        """Feeds what identifies every object to the hash ``h`` (a fingerprint's part):
        keys, sizes, ETags, versions; the times only of objects with neither (their
        identity is their size and time)."""
        for col in (self.key_ends, self.keys, self.size, self.etags):
            h.update(col)
        eo = self.etag_ends
        if eo is None:
            h.update(b"md5")  # every object has an ETag: times are not part of identities
        else:
            h.update(eo)
            h.update(array("q", (0 if eo[i + 1] > eo[i] else t
                                 for i, t in enumerate(self.mtime_ns))))  # fmt: skip
        if self.version_ends is not None:
            h.update(self.version_ends)
            h.update(self.versions)

    def nbytes(self) -> int:
        """The bytes its columns hold."""
        cols = (self.keys, self.key_ends, self.size, self.mtime_ns, self.etags,
                self.etag_ends or b"", self.versions, self.version_ends or b"")  # fmt: skip
        return sum(memoryview(c).nbytes for c in cols)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        ends = state.pop("key_ends")
        lengths = array("H" if len(self) == 0 or max(_lengths(ends)) < 1 << 16 else "I",
                        _lengths(ends))  # fmt: skip
        state["key_lengths"] = lengths
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        lengths = state.pop("key_lengths")
        self.stored = {}
        self.__dict__.update(state)
        self.key_ends = array("q", [0])
        self.key_ends.extend(accumulate(lengths))


def compact_identity(identity: str | bytes) -> bytes:
    """An identity (:attr:`ObjectInfo.identity`) as a manifest's tag: an MD5's ETag as its
    16 bytes, any other as it is (encoded)."""
    raw = identity if isinstance(identity, bytes) else _enc(identity)
    return bytes.fromhex(raw[1:33].decode()) if _MD5.fullmatch(raw) else raw


def _lengths(ends: array[int]) -> Iterator[int]:
    return map(operator.sub, islice(ends, 1, None), ends)


def as_object_list(objects: Iterable[ObjectInfo]) -> ObjectList:
    """``objects`` as an :class:`ObjectList` (one is returned as it is)."""
    return objects if isinstance(objects, ObjectList) else ObjectList.of(objects)
