"""What a stage in the background knows, and how it serves readers first (issue 49).

:class:`Schedule` is shared by the stager's threads: the stage itself, the threads
fetching files readers asked for, and the channel's threads answering readers. Before
the plan exists (the stager lists the source), a plain tree's names and the files
readers want come from early.py. A tree-shaped source (a tree, an object prefix) runs
its plan through :meth:`Schedule.transfer` (the hook of tree.run_plan where
``dest.scheduler`` is set): the files fetched early are journalled and taken out of
it; the files to do go in small chunks, each a ``source.transfer`` of as many files as
it keeps in flight, spread over the listing (:func:`_spread`), CHUNKS_AT_ONCE at once;
beside them, readers' jobs fetch the files readers asked for that no chunk has taken
yet, a job for all those asked at once, started at once (READERS_JOBS at a time),
through the same ``transfer`` (same engine, digests, journal); while they run, the
chunks keep less in flight. A file is taken once, by a chunk or by a readers' job
(``claimed``), so the store serves it once; each reaches its readers as it lands (the
jobs' on_done, every READERS_POLL_MS). A file a readers' job could not fetch goes back
to the plan, and whatever is still not done when the chunks end is done last by the
stage itself, whose errors are a plain stage's. A reader's hints (``ahead``: the files
it reads next, as a sampler knows them) go before the plan's order in the chunks, after
the files readers wait for: the stage follows a shuffled loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import threading
import time
from array import array
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from ..errors import stage_error
from .channel import named_by
from .columns import Listing
from .done import Done, LockedDone
from .early import Fetched, early_for
from .job import ProgressCallback, in_flight, set_background, set_poll_ms
from .request import StageRequest
from .result import StageResult
from .serving import Served
from .state import JournalFlusher

__all__ = ["BACKGROUND_NICE", "CHUNKS_AT_ONCE", "CHUNK_BYTES", "CHUNK_MIN", "Schedule", "yield_cpu"]

# The plan runs in chunks, CHUNKS_AT_ONCE at once, each keeping its share of the depth
# of a plain stage in flight (job.in_flight; CHUNK_MIN files at least). While readers
# wait for files (or did within CALM_S), a chunk is as many files as it keeps in flight:
# a reader's file a chunk has taken is already being fetched, and the chunks keep at
# most half the depth in flight beside the readers' jobs (fewer requests queued before
# a reader's: on netsim at 2 ms, 20,000 files, a batch of 32 random files waited 43 ms
# on average against 130 ms with the plan at full depth beside it). Otherwise (no
# reader, or a sampler's hints keep the stage ahead of the loop) a chunk is
# CHUNK_CALM files: each chunk is a copy job, and at 32 files a job (625 of them) the
# stage in the background took 8.96 s against 7.09 s for stage() on netsim at 2 ms,
# 7.35 s at 256 files a job. A hint then waits at most for a chunk to end (about a
# third of a second there), well inside the sampler's window.
CHUNK_MIN = 8
CHUNK_CALM = 256
CALM_S = 0.5
CHUNKS_AT_ONCE = 4
CHUNK_BYTES = 256 << 20
SLOT_POLL_S = 0.005  # how soon a chunk starts once readers' jobs leave room
READERS_IN_FLIGHT = 64  # files in flight of a readers' job at most
READERS_JOBS = 4  # readers' jobs at once
READERS_POLL_MS = 10  # how soon a file a job finished reaches its readers
BACKGROUND_NICE = 10  # how much nicer the chunks' threads run (yield_cpu)


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


class Schedule(Served):
    """The state of one stage in the background (``dst``): ``state`` is "starting"
    (listing, planning: no plan yet), "copying", "done" or "failed"."""

    # --- the stage's side --------------------------------------------------------------

    def opened(self, source: Any, dest: Any, req: StageRequest, fresh: bool = False) -> None:
        """The source is open: a plain tree's names are walked and its wanted files
        fetched until the plan begins (early.py). Returns once the names are (the
        stager's own walk then finds the folders looked up: on a file system that looks
        names up one at a time in a folder, as FUSE may, the two walks at once would
        take turns). ``fresh``: the destination held nothing when the stage began; for
        a source whose files each land once, whole, at their final names (a tree, an
        object prefix: ``lands_once``; not an archive, whose members may repeat), a
        file there is then whole and final, and readers read it without asking."""
        with self.cond:
            self._nested = bool(req.nested)
            self.present_whole = (fresh and not req.nested
                                  and bool(getattr(source, "lands_once", False)))  # fmt: skip
            if self.state == "starting":
                self._early = early_for(source, dest, req, self.cond)
            while self._early is not None and not self._early.walked and not self.cancelled:
                self.cond.wait()

    def names_listing(self) -> Listing | None:
        """The plan's listing where it needs no stat per file: a fresh stage of a plain
        tree of folders and regular files (early.walk_names' listing, its files' sizes
        learned as they are copied: tree.LocalTree.plan); else None (the stager walks
        the source, a stat per file)."""
        early = self._early
        if early is None or not self.present_whole:
            return None
        return early.take_listing()

    def inner(self, folder: str | None, done: bool = False) -> None:
        """unpack="nested": the inner archive extracted into ``folder`` is next
        (``done``: its stage has ended, its files are whole); ``folder`` None: the
        outer source has named all of them."""
        with self.cond:
            if folder is None:
                self._inner_all = True
            else:
                self._inner.add(folder)
                if done:
                    self._inner_done.add(folder)
            self.cond.notify_all()

    def finish(self, result: StageResult) -> None:
        self._stop_early()
        with self.cond:
            self.state, self.result = "done", result
            self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        self._stop_early()
        with self.cond:
            self.state, self.error = "failed", exc
            self.cond.notify_all()

    def cancel(self) -> None:
        self._stop_early()
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()

    def _stop_early(self) -> None:
        if self._early is not None:
            self._early.stop()

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
        fetched = self._early.close() if self._early is not None else {}
        counts: list[Any] = ["none", 0, 0]
        with self.cond:
            self._files, self._done = files, done
            self._sizes_known = not plan.stat_at_open
            self._others = {plan.entries.path(i) for i in range(len(plan.entries))}
            self._claimed = bytearray(len(files))
            self._hinted = bytearray(len(files))
            if fetched:
                plan = dataclasses.replace(plan, todo=self._adopt(fetched, done, flusher,
                                                                  plan.todo, counts))  # fmt: skip
            self.state = "copying"
            self._queue_ahead(self._hints_early)
            self._hints_early = []
            self.cond.notify_all()
        if hasattr(source, "latency"):
            source.latency(req)  # measured once, before two threads may ask for it
        shared = dataclasses.replace(plan, done=LockedDone(done, self.cond))
        readers = threading.Thread(
            target=self._serve_readers, args=(source, req, dest, shared, flusher, counts),
            name="fastload-readers-first", daemon=True,
        )  # fmt: skip
        stop = [False]
        self._stop_readers = stop
        readers.start()

        def progress() -> None:
            if on_progress is not None:
                with self.cond:  # (bytes_total 0: not known till the files are copied)
                    on_progress(done.total_bytes, files.total_bytes if self._sizes_known
                                else 0, len(done), len(files))  # fmt: skip

        depth = _depth(source, req)
        at_once = min(CHUNKS_AT_ONCE, depth)
        per = depth // at_once  # files in flight of a chunk
        chunk = max(CHUNK_MIN, per)
        per_chunk = dataclasses.replace(req, workers=per)

        def slots() -> int:
            """How many chunks may run now (a read of two counters)."""
            if not self._reading and not self._asked:
                return at_once
            return max(0, (depth // 2 - self._reading) // per)

        def run(rows: list[int], sub: StageRequest = per_chunk) -> None:
            set_poll_ms(READERS_POLL_MS)
            part = dataclasses.replace(shared, todo=array("q", rows))
            used, n, nbytes = source.transfer(sub, dest, part, shared.done, flusher, None)
            with self.cond:
                counts[0] = used if used != "none" else counts[0]
                counts[1] += n
                counts[2] += nbytes
            progress()

        try:
            with ThreadPoolExecutor(at_once, thread_name_prefix="fastload-chunk",
                                    initializer=yield_cpu) as pool:  # fmt: skip
                running: set[Future[None]] = set()
                todo, k = _spread(plan.todo, chunk), 0
                while True:
                    # A slot first, then the rows (rows taken early would wait,
                    # unreachable by the readers' jobs).
                    while len(running) >= slots():
                        if running:
                            finished, running = wait(running, timeout=SLOT_POLL_S,
                                                     return_when=FIRST_COMPLETED)  # fmt: skip
                            for f in finished:
                                f.result()  # a chunk's error: the stage's
                        else:
                            with self.cond:
                                self._check_cancelled()
                                self.cond.wait(SLOT_POLL_S)
                    rows: list[int] = []
                    with self.cond:
                        self._check_cancelled()
                        size, nbytes = files.size, 0
                        calm = not (self._reading or self._asked) and (
                            time.monotonic() - self._last_ask > CALM_S)  # fmt: skip
                        limit = max(chunk, CHUNK_CALM) if calm else chunk
                        while len(rows) < limit and nbytes < CHUNK_BYTES:
                            if self._ahead:  # hinted: before the plan's order
                                i = self._ahead.popleft()
                            elif k < len(todo):
                                i = todo[k]
                                k += 1
                            else:
                                break
                            if not self._claimed[i] and not done.is_done(i):
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

    def _adopt(self, fetched: dict[str, Fetched], done: Done, flusher: JournalFlusher,
               todo: array[int], counts: list[Any]) -> array[int]:  # fmt: skip
        """(Under the lock.) The files fetched before the plan (early.py), still as the
        listing has them: journalled and done here; the plan's files to do without
        them."""
        files, records = self._files, []
        rows: dict[int, bytes] = {}  # adopted: row -> its digests
        assert files is not None
        for rel, (size, mtime, mode, digests, blocks) in fetched.items():
            i = self._row(rel)
            if i is None or done.is_done(i):
                continue
            if not self._sizes_known:  # the listing learns them from the copy
                files.size[i], files.mtime_ns[i], files.mode[i] = size, mtime, mode
                files.blocks[i] = blocks
            elif (files.size[i], files.mtime_ns[i], files.mode[i]) != (size, mtime, mode):
                continue  # changed since: the plan's copy is the stage's
            records.append((os.fsencode(rel), size, mtime, mode, digests))
            rows[i] = digests
            counts[1] += 1
            counts[2] += size
        done.set_listed(list(rows), list(rows.values()))
        flusher.add(records)
        return array("q", (i for i in todo if i not in rows)) if rows else todo

    def _serve_readers(self, source: Any, req: StageRequest, dest: Any, plan: Any,
                       flusher: JournalFlusher, counts: list[Any]) -> None:  # fmt: skip
        """The readers' jobs: the files asked for and not yet taken, all at once, in a
        job started as soon as they are asked (READERS_JOBS at once: a batch asked
        while another's job runs does not wait for it)."""
        stop = self._stop_readers
        running = [0]

        def job(rows: list[int]) -> None:
            set_poll_ms(READERS_POLL_MS, eager=True)  # each file to its readers as it lands
            sub = dataclasses.replace(req, workers=min(len(rows), READERS_IN_FLIGHT))
            part = dataclasses.replace(plan, todo=array("q", rows))
            try:
                used, n, nbytes = source.transfer(sub, dest, part, plan.done, flusher, None)
                with self.cond:
                    counts[0] = used if used != "none" else counts[0]
                    counts[1] += n
                    counts[2] += nbytes
            except Exception as e:
                self._readers_failed(rows, e)
            finally:
                with self.cond:
                    running[0] -= 1
                    self._reading -= len(rows)
                    self.cond.notify_all()

        with ThreadPoolExecutor(READERS_JOBS, thread_name_prefix="fastload-readers") as pool:
            while True:
                with self.cond:
                    while (not self._asked or running[0] >= READERS_JOBS) and not (
                            stop[0] or self.cancelled):  # fmt: skip
                        self.cond.wait()
                    if stop[0] or self.cancelled:
                        return  # (the pool's jobs end first)
                    rows = sorted({i for i in self._asked if not self._claimed[i]})
                    self._asked.clear()
                    for i in rows:
                        self._claimed[i] = 1
                    if rows:
                        running[0] += 1
                        self._reading += len(rows)
                if rows:
                    pool.submit(job, rows)

    def _readers_failed(self, rows: list[int], exc: Exception) -> None:
        """A readers' job failed: its error goes to the readers of the file it names
        (of every file of the job where it names none); the files not done go back to
        the plan (the stage does them, or fails as a plain stage would)."""
        files = self._files
        assert files is not None and self._done is not None
        with self.cond:
            left = [i for i in rows if not self._done.is_done(i)]
            by_path = {files.path(i): i for i in left}
            named = [by_path[rel] for rel in named_by(exc, list(by_path))]
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


def yield_cpu() -> None:
    """(Each chunk thread's start.) This thread runs BACKGROUND_NICE steps nicer than
    the process (nice(2), at most 19), and the copy jobs it makes run their threads at
    nice 19 (job.set_background, CopyOptions.lowest_priority): the stage's own order,
    beside a training loop, takes the CPU the loop leaves, and a thread of the loop
    that wakes preempts it. On 2 cores, netsim at 2 ms, 20,000 files: the loop's steps
    took 2-5 ms longer each while the stage ran at the loop's priority; the sampler's
    epoch took 8.2-8.6 s with the copy threads at nice +10, 7.6-7.7 s at nice 19
    (three runs each, interleaved; SCHED_IDLE: 7.5-8.2 s, and it stalls the stage
    outright while any other thread of the node wants the CPU). This thread itself is
    only +10: it takes the interpreter's lock, which the loop's threads wait for. The
    readers' jobs (files a reader waits for) keep the process's priority."""
    set_background()
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        want = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + BACKGROUND_NICE)
        if os.getpriority(os.PRIO_PROCESS, tid) < want:
            os.setpriority(os.PRIO_PROCESS, tid, want)


def _spread(todo: array[int], chunk: int) -> array[int]:
    """``todo`` in the order the chunks take it: each run of ``chunk`` rows spread over
    the whole listing (every (n / chunk)-th row), not a run of neighbours. Neighbours
    share a folder, and a file system may look names up one at a time in a folder (FUSE
    without parallel lookups; a directory's lock on a server): a chunk's files in one
    folder would take turns, and so would a reader's file in that folder."""
    stride = -(-len(todo) // chunk) if todo else 1
    out = array("q")
    for r in range(stride):
        out.extend(todo[r::stride])
    return out
