"""An object store prefix listed (:func:`list_columns`) and read as a directory tree to
stage (:func:`list_tree`), and the rule of where a key goes under the destination
(:func:`placement`). ObjectStore's ``list_columns`` and ``list_tree`` are these.

Keys are taken as the bucket stores them where the listing is made here
(sources/s3raw.py: an S3 store whose credentials are keys); obstore's own listing parses
keys, fails on a ``.``, ``..`` or empty segment or a control character, and drops a
leading or trailing ``/`` (so a folder marker ``d/`` is told from an empty object ``d``
only by a HEAD there).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .._util import folders_of, selected
from ..errors import stage_error
from .objlist import ObjectList

if TYPE_CHECKING:
    from .objstore import ObjectStore

__all__ = ["list_columns", "list_tree", "placement"]

# Listings of "directories" under a prefix in flight at once.
LIST_IN_FLIGHT = 16
# Keys a message names at most (the count of the others follows).
NAMED = 100
_PATH_ERROR = re.compile(r'Error parsing Path "((?:[^"\\]|\\.)*)"')


def placement(key: str) -> str | None:
    """Where the key ``key`` (relative to the staged prefix) goes under the destination:
    itself, without a leading ``/`` (tools that join paths with one write ``/a.txt``);
    None where it cannot go safely (a ``.`` or ``..`` segment, an empty one, nothing
    left, or a ``/`` at the end: a folder marker is not placed as a file)."""
    name = key.lstrip("/")
    if not name or name.endswith("/"):
        return None
    if any(seg in ("", ".", "..") for seg in name.split("/")):
        return None
    return name


def _shown(key: str) -> str:
    """A key in a message: control characters as escapes, the rest as it is."""
    return "".join(c if " " <= c != "\x7f" else f"\\x{ord(c):02x}" for c in key)


def _literal(key: str) -> str:
    """An exclude pattern matching ``key`` alone (``*``, ``?``, ``[`` as themselves)."""
    return re.sub(r"([*?\[])", r"[\1]", _shown(key))


def _pages(store: ObjectStore, prefix: str) -> Iterator[list[Any]]:
    """The listing of the keys under ``prefix`` (a folder ending in ``/``, or "" for
    the bucket), a page of metadata dicts at a time."""
    if store._raw is not None:
        token: str | None = None
        with store._raw.session() as sess:
            while True:
                objects, _, token = store._raw.list_page(prefix, token, session=sess)
                yield objects
                if token is None:
                    return
    try:
        yield from store._ob.list(store._store, prefix=prefix.rstrip("/") or None,
                                  chunk_size=1000)  # fmt: skip
    except Exception as e:
        raise _unparsed(store, e) from None


def _delimited(store: ObjectStore, prefix: str) -> tuple[list[Any], list[str]]:
    """The objects right under ``prefix`` and its "folders"."""
    if store._raw is None:
        try:
            got = store._ob.list_with_delimiter(store._store, prefix.rstrip("/") or None)
        except Exception as e:
            raise _unparsed(store, e) from None
        return got["objects"], [p for p in got["common_prefixes"] if p.rstrip("/")]
    objects: list[Any] = []
    folders: list[str] = []
    token: str | None = None
    with store._raw.session() as sess:
        while True:
            page, subs, token = store._raw.list_page(prefix, token, "/", sess)
            objects += page
            folders += subs
            if token is None:
                return objects, folders


def _unparsed(store: ObjectStore, e: Exception) -> Exception:
    """obstore's refusal of a key's spelling in a listing, in fastload's words (other
    errors as they are)."""
    if type(e).__name__ != "InvalidPathError":
        return e
    m = _PATH_ERROR.search(str(e))
    key = m.group(1) if m else "?"
    return stage_error(
        errno.EINVAL,
        f"'{store.url}': the key '{_shown(key)}' cannot be listed through obstore, which "
        "refuses a key with a '.' or '..' segment, an empty one, or a control character; "
        "fastload lists such a bucket itself where the credentials are keys "
        "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or storage_options), or a public one "
        "(anonymous=True)",
        store.url,
    )


def list_columns(store: ObjectStore, include: Sequence[str] | None = None,
                 exclude: Sequence[str] | None = None, *, as_stored: bool = False
                 ) -> ObjectList:  # fmt: skip
    """Every object under the prefix (a directory tree: keys split on ``/``), keys
    relative to it, filtered by glob patterns, sorted by key, in columns (no object per
    key: each page's metadata dicts are dropped once its keys are added). Keys ending in
    ``/`` (folder markers) are left out unless ``as_stored`` (and the listing is made
    here, which sees them).

    A first listing of everything; where its first page is full and names a folder, the
    top level is listed with a delimiter instead and the "directories" it names are then
    listed at once, :data:`LIST_IN_FLIGHT` at a time, each one page after another. A
    flat prefix costs one listing; a tree of many directories costs the pages of its
    largest directory in sequence, not all of them."""
    prefix = store.prefix.rstrip("/")
    base = f"{prefix}/" if prefix else ""
    inc, exc = list(include or ()), list(exclude or ())

    def take(metas: Iterable[Mapping[str, Any]], into: ObjectList) -> None:
        for meta in metas:
            path = meta["path"]
            if not path.startswith(base) or path == base:
                continue  # not under it, or the prefix's own marker
            if path.endswith("/") and not as_stored:
                continue  # a "folder" marker
            rel = path[len(base):]
            if selected(rel, inc, exc):
                into.add(rel, meta)

    def under(sub: str) -> ObjectList:
        # Each page (1,000 keys) is taken as it comes: its metadata dicts are dropped
        # before the next page, not held for the whole prefix. A listing cut short is
        # listed again from its start (pages are not resumed).
        def attempt() -> ObjectList:
            got = ObjectList()
            for page in _pages(store, sub):
                take(page, got)
                del page  # not held while the next one is fetched
            return got

        infos: ObjectList = store._call(base, attempt)
        return infos

    def flat() -> ObjectList | None:
        # The first page of a listing of everything: where it is not full, or names no
        # folder, the rest follows in the same listing (a flat prefix of a million keys
        # is never held as metadata dicts); else None: a tree, listed by folder.
        got = ObjectList()
        pages = _pages(store, base)
        first: list[Any] = next(pages, [])
        if len(first) >= 1000 and any("/" in m["path"][len(base):].rstrip("/")
                                      for m in first):  # fmt: skip
            return None
        take(first, got)
        del first
        for page in pages:
            take(page, got)
            del page  # not held while the next one is fetched
        return got

    listed: ObjectList | None = store._call(base, flat)
    if listed is not None:
        return listed.sorted().frozen()
    objects, subs = store._call(base, lambda: _delimited(store, base))
    first = ObjectList()
    take(objects, first)
    del objects
    parts: list[ObjectList] = []
    if len(subs) == 1:
        parts.append(under(subs[0]))
    elif subs:
        with ThreadPoolExecutor(min(LIST_IN_FLIGHT, len(subs)),
                                thread_name_prefix="fastload-list") as pool:  # fmt: skip
            parts.extend(pool.map(under, subs))
    # The folders' listings are in key order and apart (each under its own "a/"); a key
    # at the top sorts before or after a folder's whole listing, never inside.
    return ObjectList.joined(first, parts)


def list_tree(store: ObjectStore, include: Sequence[str] | None = None,
              exclude: Sequence[str] | None = None) -> tuple[ObjectList, list[str]]:  # fmt: skip
    """:func:`list_columns` as a directory tree to stage: the objects (each under its
    :func:`placement`), and the folders that markers name (zero-byte keys ending in
    ``/``, what the console's "Create folder", s3fs and rclone write).

    The filters apply first, to the keys as stored (relative to the prefix); then,
    before anything is written: a key that cannot be placed safely is an error naming
    every such key and the ``--exclude`` that leaves them out; a key that is an object
    and also a prefix of others (``a`` and ``a/b``), or two keys placed at one name
    (``/a`` and ``a``), a FileExistsError naming both. Markers are kept unless include
    patterns are given (as directories are). Where obstore lists, a marker shows
    without its ``/``: one with keys under it is a marker, one without is told from an
    empty file by a HEAD; a listing made here needs none."""
    raw = store._raw is not None
    everything = list_columns(store, as_stored=True)
    inc, exc = list(include or ()), list(exclude or ())
    n = len(everything)
    chosen = bytearray(b"\1") * n
    if inc or exc:
        for i, key in enumerate(everything.key_bytes()):
            chosen[i] = selected(os.fsdecode(key), inc, exc)
    keep = bytearray(chosen)
    dirs: list[str] = []
    names: dict[int, str] = {}  # rows placed under another name
    unsafe: list[str] = []
    for i, key in enumerate(everything.key_bytes()):
        if not chosen[i]:
            continue
        k = os.fsdecode(key)
        if raw and k.endswith("/") and everything.size[i] == 0:
            keep[i] = 0
            marked = placement(k.rstrip("/"))
            if marked is not None:
                dirs.append(marked)
            elif k.strip("/"):
                unsafe.append(k)
            continue
        name = placement(k)
        if name is None:
            unsafe.append(k)
            keep[i] = 0
        elif name != k:
            names[i] = name
    if unsafe:
        raise _unplaceable(store, unsafe)
    everything = everything.select(keep)
    chosen = bytearray(b"\1") * len(everything)
    if names:
        kept = [i for i in range(n) if keep[i]]
        at = {row: j for j, row in enumerate(kept)}
        names = {at[i]: name for i, name in names.items()}
        _check_twins(store, everything, names)
        everything = everything.placed(names)
    parents: dict[bytes, int] = {}  # a folder -> the row of a key under it (-1: a marker)
    for i, key in enumerate(everything.key_bytes()):
        for folder in folders_of(key):
            parents.setdefault(folder, i)
    for d in dirs:
        for folder in (*folders_of(os.fsencode(d)), os.fsencode(d)):
            parents.setdefault(folder, -1)
    keep = bytearray(chosen)
    for i, key in enumerate(everything.key_bytes()):
        size = everything.size[i]
        if key in parents:
            keep[i] = 0
            if size == 0:
                dirs.append(os.fsdecode(key))
                continue
            where = store.url if store.url.endswith("/") else store.url + "/"
            k = everything.stored_key(i)
            j = parents[key]
            other = everything.stored_key(j) if j >= 0 else f"{k}/"
            raise stage_error(
                errno.EEXIST,
                f"'{where}': '{_shown(store._full(k))}' and '{_shown(store._full(other))}' "
                "are both in the bucket, an object and a prefix of the same name, which "
                "cannot both be on a file system: stage a narrower prefix, or exclude "
                f"one (--exclude '{_literal(k)}')",
                store.url,
            )
        if size == 0 and not raw and store._is_marker(os.fsdecode(key)):
            dirs.append(os.fsdecode(key))
            keep[i] = 0
    del parents
    objects = everything.select(keep).frozen()
    dirs = [] if inc else [d for d in dirs if selected(d, [], exc)]
    return objects, dirs


def _check_twins(store: ObjectStore, objs: ObjectList, names: Mapping[int, str]) -> None:
    """Two keys placed at one name (``/a.txt`` and ``a.txt``): an error naming both."""
    placed: dict[str, int] = {}
    twins: list[tuple[int, int]] = []
    for i, name in sorted(names.items()):
        if name in placed:
            twins.append((placed[name], i))
        placed[name] = i
    for i, key in enumerate(objs.key_bytes()):
        j = placed.get(os.fsdecode(key))
        if j is not None and i not in names:
            twins.append((j, i))
    for j, i in twins[:1]:
        other, k, name = objs.key_str(j), objs.key_str(i), names[j]
        raise stage_error(
                errno.EEXIST,
            f"'{store.url}': '{_shown(store._full(other))}' and '{_shown(store._full(k))}' "
            f"would both be staged as '{_shown(name)}': exclude one (--exclude "
            f"'{_literal(other)}')",
            store.url,
        )


def _unplaceable(store: ObjectStore, keys: list[str]) -> OSError:
    shown = ", ".join(f"'{_shown(k)}'" for k in keys[:NAMED])
    more = f" and {len(keys) - NAMED} more" if len(keys) > NAMED else ""
    flags = " ".join(f"--exclude '{_literal(k)}'" for k in keys[:NAMED])
    return stage_error(
        errno.EINVAL,
        f"'{store.url}': {len(keys)} key{'s' if len(keys) > 1 else ''} cannot be placed "
        "safely under the destination (a '.' or '..' segment, an empty one, or a '/' at "
        f"the end of an object with bytes): {shown}{more}; nothing was written; leave "
        f"them out with {flags}{' and more' if more else ''} (exclude=[...] in Python)",
        store.url,
    )
