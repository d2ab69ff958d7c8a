"""What a stage in the background knows, and how it serves readers first (issue 49).

:class:`Schedule` is shared by the stager's threads: the stage itself, the thread
fetching files readers asked for, and the channel's threads answering readers. A
tree-shaped source (a tree, an object prefix) runs its plan through
:meth:`Schedule.transfer` (the hook of tree.run_plan where ``dest.scheduler`` is set):
the files to do go in small chunks (the files in flight, CHUNK_BYTES at most),
each a ``source.transfer``, two at once at half the engine's depth each (a reader's file
taken by a chunk waits for it: a few round trips); beside them, a second thread fetches
the files readers asked for that no chunk has taken yet, a job for all those asked at once,
through the same ``transfer`` (same engine, digests, journal). A file is taken once,
by a chunk or by the readers' job (``claimed``), so the store serves it once; a file a
readers' job could not fetch goes back to the plan, and whatever is still not done when
the chunks end is done last by the stage itself, whose errors are a plain stage's.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import threading
import time
from array import array
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ..errors import stage_error
from .channel import encode_error
from .columns import Listing
from .done import Done
from .job import ProgressCallback, in_flight, set_poll_ms
from .request import StageRequest
from .result import StageResult
from .state import JournalFlusher

__all__ = ["CHUNKS_AT_ONCE", "CHUNK_BYTES", "CHUNK_MIN", "Schedule", "inside"]

# Files per chunk of the plan: the files in flight of a plain stage (its depth:
# job.in_flight) times CHUNK_DEPTHS, at least CHUNK_MIN; CHUNKS_AT_ONCE run at once, each
# at half the depth. (Chunks of twice the depth: a batch of 32 random files of 2,000 on
# netsim waited 0.19-0.71 s, of the depth 0.11-0.24 s, the stage's time the same.)
CHUNK_MIN = 32
CHUNK_DEPTHS = 1
CHUNKS_AT_ONCE = 2
CHUNK_BYTES = 256 << 20
READERS_IN_FLIGHT = 64  # files in flight of a readers' job at most
READERS_POLL_MS = 10  # how soon a file a job finished reaches its readers


def _depth(source: Any, req: StageRequest) -> int:
    """The files in flight a plain stage of ``source`` keeps (``workers``, else the
    rule's: job.in_flight for a tree, remote's default for objects)."""
    if req.workers:
        return int(req.workers)
    src = getattr(source, "src", None)
    if src is not None:
        return in_flight(None, src, latency_s=source.latency(req)).files
    from .remote import DEFAULT_OBJECTS_IN_FLIGHT

    return DEFAULT_OBJECTS_IN_FLIGHT


def inside(relpath: str) -> str:
    """``relpath`` normalised, or PermissionError where it leaves the staged tree."""
    rel = os.path.normpath(relpath) if relpath else ""
    if not rel or rel == "." or os.path.isabs(rel) or rel == ".." or rel.startswith("../"):
        raise PermissionError(
            errno.EACCES, f"'{relpath}' is not a path inside the staged tree", relpath
        )
    return rel


class _LockedDone:
    """A stage's :class:`Done` under the schedule's lock (two jobs complete files of it
    at once); every change wakes the readers waiting."""

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


class Schedule:
    """The state of one stage in the background (``dst``): ``state`` is "starting"
    (listing, planning: no plan yet), "copying", "done" or "failed"."""

    def __init__(self, dst: Path) -> None:
        self.dst = dst
        self.cond = threading.Condition(threading.RLock())
        self.state = "starting"
        self.result: StageResult | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self._files: Listing | None = None
        self._others: set[str] = set()  # folders and links: whole at the stage's end
        self._done: Done | None = None
        self._rows: dict[str, int] | None = None
        self._claimed = bytearray()
        self._asked: list[int] = []  # rows readers wait for that no job has taken
        self._failed: dict[int, BaseException] = {}  # a readers' job's error, by row
        # An archive's: the members whole here, and [bytes read of it, its size].
        self._members: set[str] | None = None
        self._stream = [0, 0]

    # --- the stage's side --------------------------------------------------------------

    def finish(self, result: StageResult) -> None:
        with self.cond:
            self.state, self.result = "done", result
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            self.state, self.error = "failed", exc
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()

    def _check_cancelled(self) -> None:
        if self.cancelled:
            raise stage_error(errno.ECANCELED, f"staging '{self.dst}' was cancelled",
                              str(self.dst))  # fmt: skip

    def transfer(
        self, source: Any, req: StageRequest, dest: Any, plan: Any, done: Done,
        flusher: JournalFlusher, on_progress: ProgressCallback | None,
    ) -> tuple[str, int, int]:  # fmt: skip
        """run_plan's copy of ``plan.todo``: in chunks, the files readers ask for
        first (see the module's docstring). Returns the engine and the files and bytes
        copied, as ``source.transfer`` does."""
        files: Listing = plan.files
        with self.cond:
            self._files, self._done = files, done
            self._others = {plan.entries.path(i) for i in range(len(plan.entries))}
            self._claimed = bytearray(len(files))
            self.state = "copying"
            self.cond.notify_all()
        if hasattr(source, "latency"):
            source.latency(req)  # measured once, before two threads may ask for it
        shared = dataclasses.replace(plan, done=_LockedDone(done, self.cond))
        counts: list[Any] = ["none", 0, 0]
        readers = threading.Thread(
            target=self._serve_readers, args=(source, req, dest, shared, flusher, counts),
            name="fastload-readers-first", daemon=True,
        )  # fmt: skip
        stop = [False]
        self._stop_readers = stop
        readers.start()

        def progress() -> None:
            if on_progress is not None:
                with self.cond:
                    on_progress(done.total_bytes, files.total_bytes, len(done), len(files))

        depth = _depth(source, req)
        # Small chunks (a reader's file taken by one waits for it: two round trips),
        # two at once, each at half the depth: the engine's depth is kept between them.
        chunk = max(CHUNK_MIN, int(CHUNK_DEPTHS * depth))
        half = dataclasses.replace(req, workers=max(1, depth // 2))

        def run(rows: list[int], sub: StageRequest = half) -> None:
            set_poll_ms(READERS_POLL_MS)
            part = dataclasses.replace(shared, todo=array("q", rows))
            used, n, nbytes = source.transfer(sub, dest, part, shared.done, flusher, None)
            with self.cond:
                counts[0] = used if used != "none" else counts[0]
                counts[1] += n
                counts[2] += nbytes
            progress()

        try:
            with ThreadPoolExecutor(CHUNKS_AT_ONCE, thread_name_prefix="fastload-chunk") as pool:
                running: set[Future[None]] = set()
                todo, k = plan.todo, 0
                while True:
                    if len(running) >= CHUNKS_AT_ONCE:  # a slot first, then the rows:
                        # rows taken early would wait, unreachable by the readers' job
                        finished, running = wait(running, return_when=FIRST_COMPLETED)
                        for f in finished:
                            f.result()  # a chunk's error: the stage's (the other ends first)
                    rows: list[int] = []
                    with self.cond:
                        self._check_cancelled()
                        size, nbytes = files.size, 0
                        while k < len(todo) and len(rows) < chunk and nbytes < CHUNK_BYTES:
                            i = todo[k]
                            k += 1
                            if not self._claimed[i]:
                                self._claimed[i] = 1
                                rows.append(i)
                                nbytes += size[i]
                    if not rows:
                        break
                    running.add(pool.submit(run, rows))
                for f in running:
                    f.result()
        finally:
            with self.cond:
                stop[0] = True
                self.cond.notify_all()
            readers.join()
        # What a readers' job could not do (its error went to its readers), and what
        # was left when it stopped: the stage's own, whose errors fail it.
        with self.cond:
            left = [i for i in plan.todo if not done.is_done(i)]
        for start in range(0, len(left), chunk):
            self._check_cancelled()
            run(left[start : start + chunk], req)
        return str(counts[0]), counts[1], counts[2]

    def _serve_readers(self, source: Any, req: StageRequest, dest: Any, plan: Any,
                       flusher: JournalFlusher, counts: list[Any]) -> None:  # fmt: skip
        """The readers' jobs: every file asked for and not yet taken, at once."""
        stop = self._stop_readers
        done = plan.done
        set_poll_ms(READERS_POLL_MS)
        while True:
            with self.cond:
                while not self._asked and not stop[0] and not self.cancelled:
                    self.cond.wait()
                if stop[0] or self.cancelled:
                    return
                rows = sorted({i for i in self._asked if not self._claimed[i]})
                self._asked.clear()
                for i in rows:
                    self._claimed[i] = 1
            if not rows:
                continue
            sub = dataclasses.replace(req, workers=min(len(rows), READERS_IN_FLIGHT))
            part = dataclasses.replace(plan, todo=array("q", rows))
            try:
                used, n, nbytes = source.transfer(sub, dest, part, done, flusher, None)
                with self.cond:
                    counts[0] = used if used != "none" else counts[0]
                    counts[1] += n
                    counts[2] += nbytes
            except Exception as e:
                self._readers_failed(rows, e)

    def _readers_failed(self, rows: list[int], exc: Exception) -> None:
        """A readers' job failed: its error goes to the readers of the file it names
        (of every file of the job where it names none); the files not done go back to
        the plan (the stage does them, or fails as a plain stage would)."""
        files = self._files
        assert files is not None and self._done is not None
        where = str(getattr(exc, "filename", "") or "")
        with self.cond:
            left = [i for i in rows if not self._done.is_done(i)]
            named = [i for i in left if where and (where == files.path(i)
                     or where.endswith("/" + files.path(i)))]  # fmt: skip
            for i in named or left:
                self._failed[i] = exc
            for i in left:
                self._claimed[i] = 0
            if named:  # the others are still wanted
                self._asked.extend(i for i in left if i not in named)
            self.cond.notify_all()

    # --- an archive's extraction (archive.py's hooks) ----------------------------------

    def extracting(self, done: list[str], size: int) -> None:
        """An archive's extraction begins; ``done``: members already whole here."""
        with self.cond:
            self._members = set(done)
            self._stream = [0, size]
            self.state = "copying"
            self.cond.notify_all()

    def extracted(self, paths: list[str]) -> None:
        with self.cond:
            assert self._members is not None  # extracting() came first
            self._members.update(paths)
            self.cond.notify_all()

    def streamed(self, fed: int) -> None:
        """How far the extraction is in the archive (bytes read of it)."""
        with self.cond:
            self._stream[0] = fed

    # --- the readers' side (the channel's threads) -------------------------------------

    def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A reader's request: ``want`` (``paths``: wait until each is whole here),
        ``wait`` (until the stage ends), ``progress``, ``list`` (the source's files,
        once listed)."""
        op = msg.get("op")
        if op == "want":
            return {"results": self.want([str(p) for p in msg["paths"]]),
                    **self._final()}  # fmt: skip
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
                    self.cond.wait()
                files = self._files
                if self._members is not None:
                    while self.state == "copying":  # an archive's members: known at its end
                        self.cond.wait()
                if self.state == "copying" and files is not None:
                    paths = list(map(os.fsdecode, files.path_bytes()))
                    return {"files": paths if files.is_sorted() else sorted(paths),
                            **self._final()}  # fmt: skip
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
                           bytes_total=self._files.total_bytes)  # fmt: skip
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
        with self.cond:
            while True:
                pending, before = False, len(asked)
                for k, rel in enumerate(rels):
                    if out[k] is not None or rel is None:
                        continue
                    got = self._answer(rel, asked)
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

    def _answer(self, rel: str, asked: set[int]) -> dict[str, Any] | None:
        """(Under the lock.) ``rel``'s answer now, or None: not yet (its row, not in
        ``asked`` yet, is put ahead of the plan and added there)."""
        if self.state == "failed":
            assert self.error is not None
            return {"error": encode_error(self.error)}
        if self.state == "done":
            if os.path.lexists(self.dst / rel):
                return {"ok": True}
            return {"error": encode_error(_missing(self.dst, rel))}
        if self.state == "starting":
            return None
        if self._members is not None:  # an archive: in its order, nothing to ask for
            return {"ok": True} if rel in self._members else None
        row = self._row(rel)
        if row is None:
            if rel in self._others:
                return None  # a folder or link: in place at the stage's end
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
        return None


def _missing(dst: Path, rel: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"'{rel}' is not in the staged tree '{dst}'",
                             str(dst / rel))  # fmt: skip
