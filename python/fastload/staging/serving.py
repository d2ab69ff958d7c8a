"""How a stage in the background answers its readers (issue 49): the channel's requests
(``want``, ``ahead``, ``wait``, ``progress``, ``list``) on the :class:`~.schedule.Schedule`'s
state, under its lock. :class:`Served` is the readers' half of that class (its state is
made in ``Schedule.__init__``); schedule.py is the stage's half.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .channel import encode_error
from .columns import Listing
from .done import Done
from .result import StageResult
from .state import read_manifest

if TYPE_CHECKING:
    from .early import Early

__all__ = ["Served", "inside", "manifest_files"]


def inside(relpath: str) -> str:
    """``relpath`` normalised, or PermissionError where it leaves the staged tree."""
    rel = os.path.normpath(relpath) if relpath else ""
    if not rel or rel == "." or os.path.isabs(rel) or rel == ".." or rel.startswith("../"):
        raise PermissionError(
            errno.EACCES, f"'{relpath}' is not a path inside the staged tree", relpath
        )
    return rel


class Served:
    """The readers' side of :class:`~.schedule.Schedule` (see there), and the state
    both sides share."""

    def __init__(self, dst: Path) -> None:
        self.dst = dst
        self.cond = threading.Condition(threading.RLock())
        self.state = "starting"
        self.result: StageResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self._files: Listing | None = None
        self._sizes_known = True  # False: the listing's sizes are learned as files land
        self._others: set[str] = set()  # folders and links: whole at the stage's end
        self._done: Done | None = None
        self._rows: dict[str, int] | None = None
        self._claimed = bytearray()
        self._asked: list[int] = []  # rows readers wait for that no job has taken
        self._last_ask = 0.0  # when a reader last waited for a file no job had taken
        self._failed: dict[int, BaseException] = {}  # a readers' job's error, by row
        # An archive's: the members whole here, and [bytes read of it, its size].
        self._members: set[str] | None = None
        self._stream = [0, 0]
        self._early: Early | None = None  # a tree's names and wants before the plan
        self._reading = 0  # files of the readers' jobs running
        # unpack="nested": the folders of the inner archives named so far, whether all
        # are, and those whose stage has ended.
        self._nested = False
        self._inner: set[str] = set()
        self._inner_all = False
        self._inner_done: set[str] = set()
        self._ahead: deque[int] = deque()  # rows hinted, for the chunks before the plan's
        self._hinted = bytearray()
        self._hints_early: list[str] = []  # hinted before the plan: queued when it begins
        # Every file at its final name is whole and the stage's own (Schedule.opened):
        # readers told so read what is there without asking.
        self.present_whole = False

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A reader's request: ``want`` (``paths``: wait until each is whole here),
        ``wait`` (until the stage ends), ``progress``, ``list`` (the source's files,
        once listed), ``ahead`` (``paths``: hints, answered at once)."""
        op = msg.get("op")
        if op == "ahead":
            self.ahead([str(p) for p in msg.get("paths", ())])
            return self._final()
        if op == "want":
            return {"results": self.want([str(p) for p in msg["paths"]]),
                    "present_whole": self.present_whole, **self._final()}  # fmt: skip
        if op == "wait":
            with self.cond:
                while self.state not in ("done", "failed"):
                    self.cond.wait()
            return self._final()
        if op == "progress":
            return {"progress": self.progress(), **self._final()}
        if op == "list":
            with self.cond:
                while self.state == "starting":
                    early = self._early
                    if early is not None and early.names is not None:
                        return {"files": list(early.names), **self._final()}
                    self.cond.wait()
                files = self._files
                if self._members is not None:
                    while self.state == "copying":  # an archive's members: known at its end
                        self.cond.wait()
                if self.state == "copying" and files is not None:
                    paths = list(map(os.fsdecode, files.path_bytes()))
                    for folder in sorted(self._inner_done):  # unpack="nested"
                        paths += [f"{folder}/{p}" for p in manifest_files(self.dst / folder)
                                  or []]  # fmt: skip
                    return {"files": paths if files.is_sorted() and not self._inner_done
                            else sorted(paths), **self._final()}  # fmt: skip
            return self._final()
        raise ValueError(f"unknown request {op!r}")

    def _final(self) -> dict[str, Any]:
        with self.cond:
            if self.state == "done":
                r = self.result
                assert r is not None
                return {"state": "done", "result": {
                    "files": r.files, "bytes": r.bytes, "seconds": r.seconds,
                    "engine": r.engine, "skipped": r.skipped,
                    "copied_files": r.copied_files, "copied_bytes": r.copied_bytes}}  # fmt: skip
            if self.state == "failed":
                assert self.error is not None
                return {"state": "failed", "error": encode_error(self.error)}
            return {"state": self.state}

    def progress(self) -> dict[str, Any]:
        with self.cond:
            out: dict[str, Any] = {"state": self.state}
            if self._members is not None:  # an archive: files known as they come
                out.update(files_done=len(self._members), bytes_done=self._stream[0],
                           bytes_total=self._stream[1] or None)  # fmt: skip
            if self._files is not None and self._done is not None:
                out.update(files_done=len(self._done), files_total=len(self._files),
                           bytes_done=self._done.total_bytes,
                           bytes_total=self._files.total_bytes if self._sizes_known
                           else None)  # fmt: skip
            if self.result is not None:
                r = self.result
                out.update(files_done=r.files, files_total=r.files, bytes_done=r.bytes,
                           bytes_total=r.bytes)  # fmt: skip
            return out

    def _row(self, rel: str) -> int | None:
        """``rel``'s row in the listing: a binary search of a sorted one (a walk's, a
        prefix's), else a dictionary made at the first request."""
        files = self._files
        assert files is not None
        if files.is_sorted():
            key, paths, ends = os.fsencode(rel), files.paths, files.offsets
            lo, hi = 0, len(files)
            while lo < hi:
                mid = (lo + hi) // 2
                if bytes(paths[ends[mid] : ends[mid + 1]]) < key:
                    lo = mid + 1
                else:
                    hi = mid
            found = lo < len(files) and bytes(paths[ends[lo] : ends[lo + 1]]) == key
            return lo if found else None
        if self._rows is None:
            self._rows = {files.path(i): i for i in range(len(files))}
        return self._rows.get(rel)

    def ahead(self, paths: list[str]) -> None:
        """Hints: ``paths`` are read soon, in this order. Each not taken yet goes to
        the chunks before the plan's own order (after the files readers wait for,
        whose jobs start at once); a path outside the tree or not in the source is
        ignored, and so is any hint once the stage is done or for an archive (its
        members come in its order)."""
        rels = []
        for p in paths:
            with contextlib.suppress(OSError):
                rels.append(inside(p))
        with self.cond:
            if self.state == "starting":
                if self._early is not None:
                    self._early.hint(rels)  # fetched before the plan (a tree's)
                self._hints_early.extend(rels)  # those left: queued when the plan begins
                return
            if self.state != "copying" or self._members is not None:
                return
        rows = [self._row(rel) for rel in rels]  # (the listing is fixed once copying)
        with self.cond:
            self._queue_ahead_rows(rows)

    def _queue_ahead(self, rels: list[str]) -> None:
        """(Under the lock, the listing known.) ``rels`` hinted."""
        if rels and self._files is not None:
            self._queue_ahead_rows([self._row(rel) for rel in rels])

    def _queue_ahead_rows(self, rows: list[int | None]) -> None:
        done = self._done
        assert done is not None
        for i in rows:
            if i is None or self._hinted[i] or self._claimed[i] or done.is_done(i):
                continue
            self._hinted[i] = 1
            self._ahead.append(i)

    def want(self, paths: list[str]) -> list[dict[str, Any]]:
        """Each path's answer once it is whole here (``{"ok": True}``), not in the
        source (FileNotFoundError) or failed (its error); a read waits here."""
        t0 = time.monotonic()
        out: list[dict[str, Any] | None] = [None] * len(paths)
        rels: list[str | None] = []
        for k, p in enumerate(paths):
            try:
                rels.append(inside(p))
            except OSError as e:
                rels.append(None)
                out[k] = {"error": encode_error(e)}
        waited = False
        asked: set[int] = set()  # the rows asked for (once each)
        found: dict[str, int | None] = {}  # each path's row, looked up once
        with self.cond:
            while True:
                pending, before = False, len(asked)
                for k, rel in enumerate(rels):
                    if out[k] is not None or rel is None:
                        continue
                    got = self._answer(rel, asked, found)
                    if got is None:
                        pending = True
                    else:
                        out[k] = got
                if len(asked) > before:
                    self.cond.notify_all()  # the readers' thread: rows were asked for
                if not pending:
                    break
                waited = True
                self.cond.wait()
        answers = [a for a in out if a is not None]
        if waited:
            for a in answers:
                a["waited"] = time.monotonic() - t0
        return answers

    def _answer(self, rel: str, asked: set[int], found: dict[str, int | None]
                ) -> dict[str, Any] | None:  # fmt: skip
        """(Under the lock.) ``rel``'s answer now, or None: not yet (its row, not in
        ``asked`` yet, is put ahead of the plan and added there; ``found``: the rows
        looked up already, by path)."""
        if self.state == "failed":
            assert self.error is not None
            return {"error": encode_error(self.error)}
        if self.state == "done":
            if os.path.lexists(self.dst / rel):
                return {"ok": True}
            return {"error": encode_error(_missing(self.dst, rel))}
        if self.state == "starting":
            return self._early.answer(rel) if self._early is not None else None
        if self._members is not None:  # an archive: in its order, nothing to ask for
            return {"ok": True} if rel in self._members else None
        if rel in found:
            row = found[rel]
        else:
            row = found[rel] = self._row(rel)
        if row is None:
            if rel in self._others:
                return None  # a folder or link: in place at the stage's end
            if self._nested:
                return self._nested_answer(rel)
            return {"error": encode_error(_missing(self.dst, rel))}
        assert self._done is not None
        if self._done.is_done(row):
            return {"ok": True}
        exc = self._failed.pop(row, None)
        if exc is not None:
            return {"error": encode_error(exc)}
        if row not in asked:
            asked.add(row)
            if not self._claimed[row]:
                self._asked.append(row)
                self._last_ask = time.monotonic()
        return None

    def _nested_answer(self, rel: str) -> dict[str, Any] | None:
        """(Under the lock.) unpack="nested": ``rel``, not a file of the outer source,
        in the folder of an inner archive is read once that archive's stage has ended;
        elsewhere it is missing once the outer source has named all its archives (until
        then it may be in one of those still to come: None, wait)."""
        folder = _folder_above(rel, self._inner)
        if folder is None:
            if not self._inner_all:
                return None
            return {"error": encode_error(_missing(self.dst, rel))}
        if folder not in self._inner_done:
            return None
        if os.path.lexists(self.dst / rel):
            return {"ok": True}
        return {"error": encode_error(_missing(self.dst, rel))}


def manifest_files(root: Path) -> list[str] | None:
    """The files of the complete stage at ``root`` (its manifest's), with those of the
    inner archives it extracted (unpack="nested": each a stage of its own in a folder);
    None where no complete stage is there."""
    m = read_manifest(root)
    if m is None or not m.get("complete"):
        return None
    out = [os.fsdecode(p) for p in m["files"].path_bytes()]
    if m.get("nested_zips"):
        from .zipnested import folder_of

        for folder in sorted({folder_of(rel) for rel in m["nested_zips"]}):
            out += [f"{folder}/{p}" for p in manifest_files(root / folder) or []]
    return out


def _folder_above(rel: str, folders: set[str]) -> str | None:
    """The folder of ``folders`` that holds ``rel``, if one does."""
    head = rel
    while "/" in head:
        head = head.rsplit("/", 1)[0]
        if head in folders:
            return head
    return None


def _missing(dst: Path, rel: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"'{rel}' is not in the staged tree '{dst}'",
                             str(dst / rel))  # fmt: skip
