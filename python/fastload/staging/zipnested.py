"""``unpack="nested"`` for zips: a tree holding zips (ScanNet's
``scans/scene0000_00/*.zip``), or a zip holding zips, staged with each inner zip
extracted into a folder of its name without ``.zip`` (:class:`NestedZips`).

The outer source is staged as usual, its zips left out (``*.zip`` excluded from a tree;
a zip's zip members left out of its listing); then each inner zip is staged as a source
of its own into its folder, with its own destination state beside that folder
(``.NAME.fastload``: manifest, journal, lock). A re-stage knows each part is done by its
own manifest: the outer one's fingerprint, and each inner zip's (its central directory,
read again: a few small reads). An inner zip that is stored in its outer zip (the usual
case) is read in place, by ranges; a compressed one is decoded to a temporary file
beside the outer destination's state first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._util import selected
from .destination import Destination
from .request import StageRequest
from .result import StageResult
from .state import state_dir
from .zipformat import Member, ZipLimits, data_span, is_zip_name, zip_error
from .zipio import Decoder, LocalZip, ZipData
from .zipsource import ZipSource

INNER_GLOB = "*.zip"


def folder_of(rel: str) -> str:
    """``scans/a/x_2d-label.zip`` -> ``scans/a/x_2d-label``."""
    return rel[: -len(".zip")] if is_zip_name(rel) and len(rel) > 4 else rel + ".d"


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

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        t0 = time.monotonic()
        if isinstance(self.outer, ZipSource):
            self.outer.skip_inner = True
            result = self.outer.run(req, dest, listing)
        else:  # a tree: its zips left out
            result = self.outer.run(nested_tree_request(req), dest, listing)
        parts = [result]
        inner_req = dataclasses.replace(req, include=(), exclude=(), checksum=None,
                                        unpack="auto", fanout=False)  # fmt: skip
        limits = req.zip_options or ZipLimits()
        try:
            for rel, data in self._inner(dest):
                sub = Destination(dest.root / folder_of(rel), inner_req)
                try:
                    sub.path.mkdir(exist_ok=True)
                    with sub.locked():
                        parts.append(ZipSource(data, inner_req, limits).run(inner_req, sub))
                finally:
                    data.close()
        finally:
            if isinstance(self.outer, ZipSource):
                self.outer.data.close()
        return dataclasses.replace(
            result,
            files=sum(p.files for p in parts), bytes=sum(p.bytes for p in parts),
            copied_files=sum(p.copied_files for p in parts),
            copied_bytes=sum(p.copied_bytes for p in parts),
            skipped=all(p.skipped for p in parts), seconds=time.monotonic() - t0,
        )  # fmt: skip

    def _inner(self, dest: Destination) -> Iterator[tuple[str, ZipData]]:
        """Each inner zip: its path in the source and its bytes."""
        outer, req = self.outer, self.req
        if isinstance(outer, ZipSource):
            for m in outer.inner:
                yield m.path, self._member_zip(outer, m, state_dir(dest.path))
            return
        root = Path(outer.name)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for f in sorted(filenames):
                p = Path(dirpath) / f
                rel = p.relative_to(root).as_posix()
                if is_zip_name(f) and p.is_file() and selected(rel, list(req.include),
                                                                list(req.exclude)):  # fmt: skip
                    yield rel, LocalZip(p)

    def _member_zip(self, outer: ZipSource, m: Member, spool: Path) -> ZipData:
        name = f"{outer.name}!/{m.path}"
        head = outer.data.read_at(m.offset, 30 + len(m.raw_name) + 1024)
        start, _end = data_span(outer.name, m, head)
        if m.method == 0:
            return _Slice(outer.data, m.offset + start, m.csize, name, m.crc)
        spool.mkdir(parents=True, exist_ok=True)
        tmp = spool / f".inner-{os.getpid()}-{m.index}.zip.fl-tmp"
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
            data = LocalZip(tmp, temporary=True)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        data.name = name
        data.identity = (name, m.usize, f"{outer.data.identity[2]}:{m.crc:08x}")
        return data


def nested_tree_request(req: StageRequest) -> StageRequest:
    """A tree's request with its zips left out (they are staged into their folders)."""
    return dataclasses.replace(req, exclude=(*req.exclude, INNER_GLOB))
