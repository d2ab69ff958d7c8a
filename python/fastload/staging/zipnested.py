"""``unpack="nested"`` with zips: a tree holding zips (ScanNet's
``scans/scene0000_00/*.zip``), a zip holding zips or tars, or a tar holding zips, staged
with each inner archive extracted into a folder of its name without its suffix
(:class:`NestedZips`).

The outer source is staged as usual, its zips left out (``*.zip``, any case, excluded from a tree;
a zip's zip and tar members left out of its listing; a tar's zips extracted as files,
its tars by the native extractor); then each inner archive is staged as a source of its
own into its folder, with its own destination state beside that folder
(``.NAME.fastload``: manifest, journal, lock). A re-stage knows each part is done by its
own manifest: the outer one's fingerprint, and each inner zip's (its central directory,
read again: a few small reads) or inner tar's (its member's size and CRC-32 in the
outer zip: nothing read). An inner zip that is stored in its outer zip (the usual
case) is read in place, by ranges; a compressed one, and an inner tar, is decoded to a
temporary file beside the outer destination's state first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from .._util import selected
from .archive import SUFFIXES, Archive, detect_compression, not_an_archive
from .destination import Destination
from .readers import LocalArchive
from .request import StageRequest
from .result import StageResult
from .state import named_os_errors, read_manifest, state_dir, write_manifest
from .zipformat import Member, ZipLimits, data_span, is_zip_name, zip_error
from .zipio import Decoder, LocalZip, ZipData
from .zipsource import ZipSource

INNER_GLOB = "*.[zZ][iI][pP]"  # is_zip_name(): the suffix without case
_STRIPPED = (".zip", *sorted(SUFFIXES, key=len, reverse=True))


def folder_of(rel: str) -> str:
    """``scans/a/x_2d-label.zip`` -> ``scans/a/x_2d-label``; ``a/n01.tar.gz`` ->
    ``a/n01``."""
    low = rel.lower()
    for suffix in _STRIPPED:
        if low.endswith(suffix) and len(rel) > len(suffix):
            return rel[: -len(suffix)]
    return rel + ".d"


class _Known:
    """An inner tar's name and identity only: whether its stage is complete is known
    without decoding it (:meth:`Archive.is_complete`)."""

    stream = False

    def __init__(self, name: str, size: int, identity: tuple[Any, ...]) -> None:
        self.name, self.size, self.identity = name, size, identity


class _Slice:
    """A stored member of a zip, as a zip of its own: read by ranges in place."""

    def __init__(self, outer: ZipData, start: int, size: int, name: str, crc: int) -> None:
        self._outer, self._start = outer, start
        self.name, self.size = name, size
        self.identity: tuple[Any, ...] = (name, size, f"{outer.identity[2]}:{crc:08x}")

    def read_at(self, offset: int, length: int) -> bytes | memoryview:
        length = max(0, min(length, self.size - offset))
        return self._outer.read_at(self._start + offset, length)

    def changed(self) -> bool:
        return self._outer.changed()

    def close(self) -> None:
        pass


class NestedZips:
    """A source staged first (a tree without its zips, or a zip without its zip
    members), then each of its zips into the folder of its name without ``.zip``."""

    def __init__(self, outer: Any, req: StageRequest) -> None:
        self.outer = outer
        self.name, self.label, self.options = outer.name, outer.label, outer.options
        self.req = req
        self.spooled: list[str] = []  # a tar's zips staged by this run
        self.prefix_zips: list[str] | None = None  # an object prefix's, taken out of it
        if getattr(outer, "store", None) is not None and outer.listed:  # listed already
            outer.objects = self.take_zips(outer.objects)

    def take_zips(self, objects: Any) -> Any:
        """An object prefix's listing without its zips, which become :attr:`prefix_zips`
        (staged into their folders): the prefix listed once for both."""
        keys = [objects.key_str(i) for i in range(len(objects))]
        self.prefix_zips = sorted(k for k in keys if is_zip_name(k))
        return objects.select(bytes(not is_zip_name(k) for k in keys))

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        t0 = time.monotonic()
        if isinstance(self.outer, ZipSource):
            self.outer.skip_inner = True
            result = self.outer.run(req, dest, listing)
        elif isinstance(self.outer, Archive):  # a tar: its zips extracted as files
            _check_tar_zips(dest)
            result = self.outer.run(req, dest, listing)
        else:  # a tree: its zips left out
            result = self.outer.run(nested_tree_request(req), dest, listing)
        return self.run_inner(req, dest, result, t0)

    def fan_outer(self, dest: Destination) -> Any:
        """What fan-out (fanout/run.py) spreads over the nodes first, under ``dest``'s
        lock, before :meth:`run_inner`: a tar (its zips come out of it onto each node's
        disk), a zip without its inner archives, a tree without its zips."""
        if isinstance(self.outer, Archive):
            _check_tar_zips(dest)
            return self.outer
        if isinstance(self.outer, ZipSource):
            self.outer.skip_inner = True
            return self.outer
        return _TreeWithoutZips(self.outer, self)

    def run_inner(self, req: StageRequest, dest: Destination, result: StageResult,
                  t0: float, x: Any = None) -> StageResult:  # fmt: skip
        """Each inner archive staged into its folder, after the outer ``result``. With
        ``x`` (a fan-out's exchange, every leader calling this alike): a zip's or a
        tree's zips are each fanned out in turn (fanout/zips.py); a tar's zips, on each
        node's disk, and a zip's tars are staged by each node."""
        parts = [result]
        inner_req = dataclasses.replace(req, include=(), exclude=(), checksum=None,
                                        unpack="auto", fanout=False)  # fmt: skip
        limits = req.zip_options or ZipLimits()
        tar_req = dataclasses.replace(inner_req, unpack="nested")

        def zip_stage(data: ZipData, spent: Path | None) -> Callable[[Destination], StageResult]:
            def run(sub: Destination) -> StageResult:
                try:
                    got = ZipSource(data, inner_req, limits).run(inner_req, sub)
                finally:
                    data.close()
                if spent is not None:  # a tar's zip, extracted: no longer needed
                    spent.unlink()
                return got

            return run

        def fan_stage(data: ZipData, k: int) -> Callable[[Destination], StageResult]:
            from .fanout.zips import fan_zip

            def run(sub: Destination) -> StageResult:
                return fan_zip(x, ZipSource(data, inner_req, limits), sub, scope=f"inner{k}/")

            return run

        staged: list[str] = []
        # A stage read while it runs (wait=False): its readers of an inner archive's
        # files wait for that archive's stage (schedule.py).
        schedule = getattr(dest, "scheduler", None)
        try:
            for k, (rel, kind, opened) in enumerate(self._inner(dest, x)):
                staged.append(rel)
                if schedule is not None:
                    schedule.inner(folder_of(rel))
                sub_req = tar_req if kind == "tar" else inner_req
                sub = Destination(dest.root / folder_of(rel), sub_req)
                # (a folder of the source holding only zips: not made by the outer stage)
                sub.path.parent.mkdir(parents=True, exist_ok=True)
                if kind == "tar":
                    stage_one = opened
                elif kind == "zip" and x is not None:
                    stage_one = fan_stage(opened(), k)
                else:
                    data = opened()
                    stage_one = zip_stage(data, data.path if kind == "spooled" else None)
                with sub.locked():
                    if not sub.path.is_dir():  # (deleted: its earlier stage is gone)
                        sub.old = None
                    sub.path.mkdir(exist_ok=True)
                    parts.append(stage_one(sub))
                if schedule is not None:
                    schedule.inner(folder_of(rel), done=True)
            if schedule is not None:
                schedule.inner(None)
        finally:
            if isinstance(self.outer, ZipSource):
                self.outer.data.close()
        if not isinstance(self.outer, Archive):  # (a tar's are recorded as set aside)
            _record_inner(dest, staged)
        if isinstance(self.outer, Archive) and dest.old is not None:  # its zips moved out
            spool = _tar_spool(dest)
            for d in [*sorted(spool.rglob("*"), reverse=True), spool]:  # the empty folders
                with contextlib.suppress(OSError):
                    d.rmdir()
            parts[0] = dataclasses.replace(result, files=int(dest.old["files_count"]),
                                           bytes=int(dest.old["bytes"]))  # fmt: skip
            staged_now = {folder_of(rel) for rel in self.spooled}
            for rel in dest.old.get("nested_zips", []):  # those done before: their counts
                if folder_of(rel) not in staged_now:
                    old = read_manifest(dest.root / folder_of(rel)) or {}
                    parts.append(dataclasses.replace(
                        result, files=int(old.get("files_count", 0)),
                        bytes=int(old.get("bytes", 0)), copied_files=0, copied_bytes=0,
                        skipped=True))  # fmt: skip
        return dataclasses.replace(
            result,
            files=sum(p.files for p in parts), bytes=sum(p.bytes for p in parts),
            copied_files=sum(p.copied_files for p in parts),
            copied_bytes=sum(p.copied_bytes for p in parts),
            skipped=all(p.skipped for p in parts), seconds=time.monotonic() - t0,
        )  # fmt: skip

    def _inner(self, dest: Destination, x: Any = None) -> Iterator[tuple[str, str, Any]]:
        """Each inner archive: its path in the source, "zip" or "tar", and what opens
        its bytes (a zip's) or stages it into a destination (a tar's). In a fan-out
        (``x``) a tree's zips are those node 0 finds."""
        outer, req = self.outer, self.req
        spool = state_dir(dest.path)
        if isinstance(outer, ZipSource):
            for m in outer.inner:
                if is_zip_name(m.path):
                    yield m.path, "zip", lambda m=m: self._member_zip(outer, m, spool)
                else:
                    yield m.path, "tar", lambda sub, m=m: self._member_tar(outer, m, spool, sub)
            return
        if isinstance(outer, Archive):
            spool = _spool_tar_zips(dest)
            pending = sorted(q.relative_to(spool).as_posix() for q in spool.rglob("*")
                             if q.is_file()) if spool.is_dir() else []  # fmt: skip
            self.spooled = pending
            for rel in pending:
                yield rel, "spooled", lambda rel=rel: self._spooled_zip(spool, rel)
            return
        prefix = getattr(outer, "store", None) is not None  # an object prefix's
        root = Path(outer.name)
        found: list[Any] = [None]
        if x is None or x.node == 0:
            found = [(self.prefix_zips if self.prefix_zips is not None
                      else _prefix_zips(outer, req)) if prefix else _tree_zips(root, req)]
        if x is not None:
            x.sync("inner-zips")
            x.broadcast_object(found)
        for rel in found[0]:
            if prefix:
                yield rel, "zip", lambda rel=rel: _store_zip(outer, rel, req)
            else:
                yield rel, "zip", lambda p=root / rel: LocalZip(p)

    def _member_zip(self, outer: ZipSource, m: Member, spool: Path) -> ZipData:
        name = f"{outer.name}!/{m.path}"
        head = outer.data.read_at(m.offset, 30 + len(m.raw_name) + 1024)
        start, _end = data_span(outer.name, m, head)
        if m.method == 0:
            return _Slice(outer.data, m.offset + start, m.csize, name, m.crc)
        data = LocalZip(_spooled(outer, m, start, spool), temporary=True)
        data.name = name
        data.identity = (name, m.usize, f"{outer.data.identity[2]}:{m.crc:08x}")
        return data

    def _member_tar(self, outer: ZipSource, m: Member, spool: Path, sub: Destination
                    ) -> StageResult:  # fmt: skip
        """A tar in the outer zip staged into ``sub`` (under its lock): known complete
        by its member's size and CRC-32, else decoded to a temporary file and
        extracted as a nested tar."""
        name = f"{outer.name}!/{m.path}"
        identity = (name, m.usize, f"{outer.data.identity[2]}:{m.crc:08x}")
        options = {**sub.req.selection(), "on_special": sub.req.on_special, "file": True,
                   "unpack": sub.req.unpack_option}  # fmt: skip
        known = Archive(_Known(name, m.usize, identity), "none", options)
        _check_tar_zips(sub)  # (an inner zip's folder deleted: the tar is not complete)
        if known.is_complete(sub.req, sub):
            # Its zips: those a killed run left set aside still to extract.
            return NestedZips(known, sub.req).run(sub.req, sub)
        head = outer.data.read_at(m.offset, 30 + len(m.raw_name) + 1024)
        start, _end = data_span(outer.name, m, head)
        tmp = _spooled(outer, m, start, spool)
        try:
            with open(tmp, "rb") as f:
                head = f.read(512)
            compression = detect_compression(head, m.path)
            if compression is None:
                raise not_an_archive(name, m.path, head)
            data = LocalArchive(tmp)
            data.name, data.identity = name, identity
            # Its zips (and its tars' zips) extracted into their folders too.
            return NestedZips(Archive(data, compression, options), sub.req).run(sub.req, sub)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _spooled_zip(self, spool: Path, rel: str) -> LocalZip:
        """A zip of the outer tar, moved to ``spool``, named inside the tar."""
        data = LocalZip(spool / rel)
        data.name = f"{self.outer.name}!/{rel}"
        data.identity = (data.name, *data.identity[1:])
        return data


def _tree_zips(root: Path, req: StageRequest) -> list[str]:
    """The selected zips of the tree ``root``, by path, in order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            if not is_zip_name(f):
                continue  # (the cheap test first: a tree of millions holds few zips)
            p = Path(dirpath) / f
            rel = p.relative_to(root).as_posix()
            if p.is_file() and selected(rel, req.include, req.exclude):
                out.append(rel)
    return out


def _prefix_zips(outer: Any, req: StageRequest) -> list[str]:
    """The selected zips of the object prefix ``outer`` (keys relative to it), in order."""
    objects, _dirs = outer.store.list_tree(list(req.include), list(req.exclude))
    return sorted(k for k in map(objects.key_str, range(len(objects))) if is_zip_name(k))


def _store_zip(outer: Any, rel: str, req: StageRequest) -> ZipData:
    """The zip ``rel`` of the object prefix ``outer``, read by ranged GETs."""
    from ..sources.base import store_for
    from .zipio import StoreZip

    store = store_for(outer.name.rstrip("/") + "/" + rel, req.storage_options)
    return StoreZip(store, store.head())


class _TreeWithoutZips:
    """A tree (or an object prefix) as fan-out lists and plans it under
    unpack="nested": its zips left out (a prefix's kept by ``nested``, from the same
    listing)."""

    def __init__(self, tree: Any, nested: NestedZips) -> None:
        self.tree, self.nested = tree, nested

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.tree, attr)

    def listing(self, req: StageRequest) -> Any:
        if getattr(self.tree, "store", None) is None:
            return self.tree.listing(nested_tree_request(req))
        objects, dirs = self.tree.listing(req)  # (node 0's, in a fan-out)
        self.tree.objects = self.nested.take_zips(objects)
        return self.tree.objects, dirs

    def plan(self, req: StageRequest, dest: Destination, listing: Any = None) -> Any:
        return self.tree.plan(nested_tree_request(req), dest, listing)


def _tar_spool(dest: Destination) -> Path:
    return state_dir(dest.path) / "zips"


def _spool_tar_zips(dest: Destination) -> Path:
    """The zips a tar's stage wrote into ``dest`` moved into its state folder (the
    spool returned), and out of its manifest: they are extracted into their folders,
    not kept. Each is deleted from the spool once its stage is complete; a run killed
    before leaves it there, and the next one goes on from it."""
    spool = _tar_spool(dest)
    dest.reload()
    old = dest.old
    if old is None or not old.get("complete"):
        return spool
    table = old["files"]
    zips = [os.fsdecode(b) for b in table.path_bytes() if b[-4:].lower() == b".zip"]
    if not zips:
        return spool
    with named_os_errors("cannot set a tar's zips aside: "):
        for rel in zips:
            if os.path.lexists(dest.root / rel):  # (else set aside by a killed run)
                (spool / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(dest.root / rel, spool / rel)
        rest = table.without(zips)
        inner = sorted({*old.get("nested_zips", []), *zips})
        write_manifest(dest.path, {**old, "files_count": len(rest), "bytes": rest.total_bytes,
                                   "nested_zips": inner}, rest)  # fmt: skip
    dest.reload()
    return spool


def _record_inner(dest: Destination, inner: list[str]) -> None:
    """The inner archives of a tree or a zip, staged into their folders, named in the
    outer manifest (``nested_zips``, as a tar's are): verify() reads them too."""
    m = read_manifest(dest.path)
    if m is not None and m.get("complete") and m.get("nested_zips", []) != inner:
        with named_os_errors("cannot record the inner archives: "):
            write_manifest(dest.path, {**m, "nested_zips": inner}, m["files"])
        dest.reload()


def _check_tar_zips(dest: Destination) -> None:
    """A tar's stage whose zips were set aside (its manifest's ``nested_zips``) is
    complete only while each of them is still to stage (in the spool) or staged (its
    folder's manifest complete and not damaged): where one is neither (its folder
    deleted, or found damaged by verify()), the tar's manifest is marked incomplete,
    and its stage puts what is missing back."""
    old = dest.old
    if old is None or not old.get("complete"):
        return
    spool = _tar_spool(dest)
    for rel in old.get("nested_zips", []):
        folder = dest.root / folder_of(rel)
        done = read_manifest(folder) if folder.is_dir() else None
        whole = done is not None and done.get("complete") and not done.get("damaged")
        if not (spool / rel).is_file() and not whole:  # (damaged: verify() found it so)
            write_manifest(dest.path, {**old, "fingerprint": None}, old["files"])
            dest.reload()
            return


def _spooled(outer: ZipSource, m: Member, start: int, spool: Path) -> Path:
    """The member ``m`` of ``outer`` (its data at ``start`` past its local header),
    decoded to a temporary file in ``spool``; checked by its CRC-32 and size."""
    spool.mkdir(parents=True, exist_ok=True)
    tmp = spool / f".inner-{os.getpid()}-{m.index}.fl-tmp"
    dec = Decoder(outer.name, m)
    try:
        with open(tmp, "wb") as out:
            pos, left = m.offset + start, m.csize
            while left:
                piece = outer.data.read_at(pos, min(4 << 20, left))
                if not len(piece):
                    raise zip_error(outer.name, "truncated data", m.path)
                out.write(dec.feed(piece))
                pos, left = pos + len(piece), left - len(piece)
            dec.end()
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def nested_tree_request(req: StageRequest) -> StageRequest:
    """A tree's request with its zips left out (they are staged into their folders)."""
    return dataclasses.replace(req, exclude=(*req.exclude, INNER_GLOB))
