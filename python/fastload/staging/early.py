"""A tree staged in the background, before its plan exists (issue 49): what readers get
while the stager still walks the source (a stat per file: seconds on a network file
system at a million files).

:class:`Early` is made by the schedule as soon as the source is open:

- its *names*: a walk of the source that reads directories only (one scandir per folder,
  many folders at once, the entries' types from the directory itself: no stat per file),
  the paths of its regular files, sorted. A dataset's classes, length and targets need
  nothing more, so they are final long before the stager's listing is;
- the files readers *want* meanwhile: each stat'ed on its own (a path not in the source:
  FileNotFoundError at once), fetched by a copy job of the same engine (digests on the
  way) at its final name, and handed to the plan when it begins (:meth:`Early.close`):
  the schedule journals them and takes them out of the files to do, so the store still
  serves each file once. A file already whole in the destination (an earlier run's, of
  the size and time the source has) is answered at once, not fetched;
- the files readers *hint* (a sampler's next ones, Schedule.ahead): fetched the same
  way by a thread of their own, JOBS_AT_ONCE jobs of HINTS_AT_ONCE files at once, in
  the order hinted (a hint naming no regular file of the source is ignored; one whose
  fetch fails is left to the plan). Wanted files too go in up to JOBS_AT_ONCE jobs.

Only a plain tree (a directory on a file system, no include/exclude selection) has an
early part; other sources' readers wait for the plan.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import threading
from array import array
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from itertools import accumulate
from pathlib import Path
from typing import Any, NamedTuple

from .. import _core
from .channel import encode_error, named_by
from .columns import DIR, FILE, Listing
from .job import run_job, set_poll_ms
from .request import StageRequest
from .state import quick_same
from .tree import LocalTree

__all__ = ["Early", "Fetched", "early_for", "walk_names"]

NAME_THREADS = 32  # folders read at once by the names' walk
STAT_THREADS = 32  # wanted files stat'ed at once
FETCH_IN_FLIGHT = 64  # wanted files fetched at once, at most
POLL_MS = 10  # how soon a fetched file reaches its readers
HINTS_AT_ONCE = 32  # hinted files per job
JOBS_AT_ONCE = 4  # jobs at once of wanted files, and of hinted ones

# A file fetched early: (size, mtime_ns, mode, raw digests, blocks), as its copy job saw
# it.
Fetched = tuple[int, int, int, bytes, int]


class _Scanned(NamedTuple):
    """One folder read: its regular files and folders (relative paths), its own mode and
    mtime, and whether it holds anything else (a link, a special file)."""

    files: list[str]
    dirs: list[str]
    mode: int
    mtime_ns: int
    other: bool


def _scan(root: str, rel: str) -> _Scanned:
    """``root/rel`` read: the entries' types from the directory itself (a stat only
    where the file system gives none), the folder's own mode and time from the open
    folder (on a network file system, from its open's reply: no round trip more)."""
    files, dirs, other = [], [], False
    fd = os.open(os.path.join(root, rel) if rel else root,
                 os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if rel else 0))
    try:
        st = os.fstat(fd)
        with os.scandir(fd) as it:
            for e in it:
                path = f"{rel}/{e.name}" if rel else e.name
                if e.is_dir(follow_symlinks=False):
                    dirs.append(path)
                elif e.is_file(follow_symlinks=False):
                    files.append(path)
                else:
                    other = True
    finally:
        os.close(fd)
    return _Scanned(files, dirs, stat.S_IMODE(st.st_mode), st.st_mtime_ns, other)


def walk_names(root: str | os.PathLike[str], threads: int = NAME_THREADS
               ) -> tuple[list[str], Listing | None]:  # fmt: skip
    """The paths of the regular files under ``root`` (relative, sorted): folders read
    ``threads`` at once, no file stat'ed (links and special files are not regular);
    and, where the tree holds only folders and regular files, its listing as the
    stager's walk makes it, but each file's size, blocks, mode and time unknown (0: a
    copy job learns them when it opens the file, CopyFiles' ``stat_at_open``), else
    None."""
    top, out = os.fspath(root), []
    dirs: list[tuple[bytes, int, int]] = []  # (path, mode, mtime_ns) of each folder
    plain = True
    with ThreadPoolExecutor(threads, thread_name_prefix="fastload-names") as pool:
        pending: set[Future[_Scanned]] = {pool.submit(_scan, top, "")}
        folder: dict[Future[_Scanned], str] = {}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                got = f.result()
                out.extend(got.files)
                plain = plain and not got.other
                rel = folder.pop(f, "")
                if rel:
                    dirs.append((os.fsencode(rel), got.mode, got.mtime_ns))
                for d in got.dirs:
                    sub = pool.submit(_scan, top, d)
                    folder[sub] = d
                    pending.add(sub)
    out.sort()
    return out, _unstated(out, dirs) if plain else None


def _unstated(files: list[str], dirs: list[tuple[bytes, int, int]]) -> Listing:
    """The listing of ``files`` (sizes, blocks, modes and times 0: unknown) and
    ``dirs``, in the byte order of their paths, as the stager's walk gives it."""
    rows = [(os.fsencode(p), FILE, 0, 0) for p in files]
    rows += [(p, DIR, mode, mtime) for p, mode, mtime in dirs]
    rows.sort(key=lambda r: r[0])
    blob = b"".join(r[0] for r in rows)
    ends = array("q", [0])
    ends.extend(accumulate(len(r[0]) for r in rows))
    zeros = array("q", bytes(8 * len(rows)))
    out = Listing(blob, ends, array("B", (r[1] for r in rows)), zeros, array("q", zeros),
                  array("I", (r[2] for r in rows)), array("q", (r[3] for r in rows)), {})
    out._sorted = True  # (each path once, in byte order)
    return out


def early_for(source: Any, dest: Any, req: StageRequest, cond: threading.Condition
              ) -> Early | None:  # fmt: skip
    """An :class:`Early` for a plain tree's stage (started), else None."""
    if not isinstance(source, LocalTree) or source.single or req.include or req.exclude:
        return None
    return Early(source, dest.root, req, cond)


class Early:
    """The names of the tree ``src`` and the files wanted before the plan (see the
    module's docstring); shares the schedule's ``cond`` (its changes wake readers)."""

    def __init__(self, source: LocalTree, root: Path, req: StageRequest,
                 cond: threading.Condition) -> None:  # fmt: skip
        self.source, self.src = source, source.src
        self.root, self.req, self.cond = root, req, cond
        self.names: list[str] | None = None  # once walked (None as well where it failed)
        # The walk's listing of a tree of folders and regular files (walk_names), sizes
        # unknown, till the plan takes it (take_listing); else None.
        self.listing: Listing | None = None
        self.walked = False
        self._queue: list[str] = []  # wanted, not yet looked at
        self._hints: deque[str] = deque()  # hinted, not yet looked at
        self._asked: set[str] = set()
        self._answers: dict[str, dict[str, Any]] = {}  # rel -> {"ok"} or {"error"}
        self._later: set[str] = set()  # not a regular file: answered by the plan
        self._fetched: dict[str, Fetched] = {}
        self._stop = False
        self._threads = [
            threading.Thread(target=self._walk, name="fastload-names", daemon=True),
            threading.Thread(target=self._serve, name="fastload-early", daemon=True),
            threading.Thread(target=self._serve, args=(True,), name="fastload-early-hints",
                             daemon=True),
        ]  # fmt: skip
        for t in self._threads:
            t.start()

    def _walk(self) -> None:
        listing = None
        try:
            got: list[str] | None
            got, listing = walk_names(self.src)
        except OSError:
            got = None  # the stager's own listing says what is wrong
        with self.cond:
            self.names, self.listing, self.walked = got, listing, True
            self.cond.notify_all()

    def take_listing(self) -> Listing | None:
        """The walk's listing (once walked; see :func:`walk_names`), given once."""
        with self.cond:
            while not self.walked and not self._stop:
                self.cond.wait()
            got, self.listing = self.listing, None
            return got

    def answer(self, rel: str) -> dict[str, Any] | None:
        """(Under the lock.) ``rel``'s answer, or None: not yet (asked for here)."""
        got = self._answers.get(rel)
        if got is not None or rel in self._later:
            return got
        if rel not in self._asked and not self._stop:
            self._asked.add(rel)
            self._queue.append(rel)
            self.cond.notify_all()
        return None

    def hint(self, rels: list[str]) -> None:
        """(Under the lock.) ``rels`` are read soon: fetched, after those wanted."""
        if not self._stop:
            self._hints.extend(rels)
            self.cond.notify_all()

    def stop(self) -> None:
        """Takes no more wants (the stage ended, or its plan begins)."""
        with self.cond:
            self._stop = True
            self.cond.notify_all()

    def close(self) -> dict[str, Fetched]:
        """Stops taking wants, waits for the files in flight, and returns the files
        fetched (the plan's now); wants not yet answered go to the plan."""
        self.stop()
        self._threads[1].join()
        self._threads[2].join()
        with self.cond:
            self.names = None  # the listing's now (a million paths need not stay twice)
            return dict(self._fetched)

    # --- the fetching thread --------------------------------------------------------

    def _serve(self, hinted: bool = False) -> None:
        """The wanted files' thread (or, ``hinted``, the hinted files'): batches taken as
        they come, JOBS_AT_ONCE of them fetched at once (a want asked while a job runs
        does not wait for it; hints keep the store busy while the stager lists)."""
        running = [0]

        def batch(rels: list[str], stats: ThreadPoolExecutor) -> None:
            set_poll_ms(POLL_MS, eager=True)
            try:
                self._batch(rels, hinted, stats)
            finally:
                with self.cond:
                    running[0] -= 1
                    self.cond.notify_all()

        with (
            ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="fastload-early") as stats,
            ThreadPoolExecutor(JOBS_AT_ONCE, thread_name_prefix="fastload-early-jobs") as jobs,
        ):
            while True:
                with self.cond:
                    while not self._stop and (
                        running[0] >= JOBS_AT_ONCE or not (self._hints if hinted else self._queue)
                    ):
                        self.cond.wait()
                    if self._stop:
                        return  # (the jobs in flight end first)
                    if hinted:
                        rels: list[str] = []
                        while self._hints and len(rels) < HINTS_AT_ONCE:
                            rel = self._hints.popleft()
                            if rel not in self._asked:
                                self._asked.add(rel)
                                rels.append(rel)
                    else:
                        rels, self._queue = self._queue, []
                    if not rels:
                        continue
                    running[0] += 1
                jobs.submit(batch, rels, stats)

    def _batch(self, rels: list[str], hinted: bool, stats: ThreadPoolExecutor) -> None:
        """``rels`` stat'ed (a path not in the source: its readers' error at once) and
        the regular files among them fetched."""
        sts = list(stats.map(self._lstat, rels))
        todo = []
        with self.cond:
            for rel, st in zip(rels, sts, strict=True):
                if isinstance(st, OSError) and hinted:
                    self._later.add(rel)  # the plan says what it is
                elif isinstance(st, OSError):
                    self._answers[rel] = {"error": encode_error(st)}
                elif not stat.S_ISREG(st.st_mode):
                    self._later.add(rel)  # a folder, a link: the plan's
                elif quick_same(self.root / rel, st.st_size, st.st_mtime_ns):
                    self._answers[rel] = {"ok": True}  # whole here already
                else:
                    todo.append((rel, st))
            self.cond.notify_all()
        for k in range(0, len(todo), FETCH_IN_FLIGHT):
            self._fetch(todo[k : k + FETCH_IN_FLIGHT], hinted)

    def _lstat(self, rel: str) -> os.stat_result | OSError:
        try:
            return os.lstat(self.src / rel)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                return FileNotFoundError(errno.ENOENT, f"'{rel}' is not in the source "
                                         f"'{self.src}'", str(self.root / rel))  # fmt: skip
            return e

    def _fetch(self, todo: list[tuple[str, os.stat_result]], hinted: bool = False) -> None:
        """A copy job for ``todo``'s files (as stat'ed): each answered as it lands."""
        paths = [os.fsencode(rel) for rel, _st in todo]
        try:
            for rel, _st in todo:
                os.makedirs(self.root / os.path.dirname(rel), exist_ok=True)
            job = _core.CopyJob(
                str(self.src), str(self.root),
                _core.CopyFiles(paths, paths, [st.st_size for _r, st in todo],
                                [st.st_blocks for _r, st in todo],
                                [stat.S_IMODE(st.st_mode) for _r, st in todo],
                                [st.st_mtime_ns for _r, st in todo]),
                self._options(len(todo)),
            )  # fmt: skip
        except OSError as e:
            self._failed(todo, e, hinted)
            return

        def on_done(batch: list[tuple[int, bytes]], final: bool) -> None:
            if batch:
                with self.cond:
                    for idx, digests in batch:
                        rel, st = todo[idx]
                        self._fetched[rel] = (st.st_size, st.st_mtime_ns,
                                              stat.S_IMODE(st.st_mode), digests,
                                              st.st_blocks)  # fmt: skip
                        self._answers[rel] = {"ok": True}
                    self.cond.notify_all()

        job.start()
        try:
            run_job(job, on_progress=None, base_bytes=0, base_files=0, total_bytes=0,
                    total_files=0, on_done=on_done)  # fmt: skip
        except Exception as e:
            self._failed(todo, e, hinted)

    def _options(self, files: int) -> _core.CopyOptions:
        """A job's options for ``files`` in flight (the tree's, made once per count)."""
        return self.source.copy_options(dataclasses.replace(self.req, workers=files), self.src)

    def _failed(self, todo: list[tuple[str, os.stat_result]], exc: Exception,
                hinted: bool = False) -> None:  # fmt: skip
        """A job's error: to the readers of the file it names (else of every file not
        fetched); the others go to the plan (all of them, for hinted files)."""
        with self.cond:
            left = [rel for rel, _st in todo if rel not in self._fetched]
            named = named_by(exc, left)
            if hinted:
                named, left = [], []
                self._later.update(r for r, _st in todo if r not in self._fetched)
            for rel in named or left:
                self._answers[rel] = {"error": encode_error(exc)}
            for rel in left:
                if rel not in self._answers:
                    self._later.add(rel)
            self.cond.notify_all()
