"""Staging a tree: a directory (or one file) on a file system, and the pipeline every
tree-shaped source shares (:func:`run_plan`: an object prefix is one too).

List the source in parallel; skip if a complete manifest matches; take what an interrupted
run finished from the journal; check free space; run the native copier (many files in
flight, big files in stripes, digests on the way), journalling completed files; then set
directory metadata, create symlinks and write the manifest (the Destination's commit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import stat
from array import array
from collections.abc import Callable
from itertools import compress
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import ChecksumMismatchError, stage_error
from .columns import Entry, FileTable, Listing, Record
from .destination import Destination, Manifest
from .done import Done
from .engine import LatencyProbe, network_fs, resolve_engine
from .job import (
    DIR,
    FILE,
    LINK,
    ProgressCallback,
    copy_options,
    digest_local,
    in_flight,
    progress_callback,
    run_job,
    runs_background,
)
from .request import StageRequest
from .result import StageResult
from .state import (
    JournalFlusher,
    JournalRecord,
    ensure_writable,
    named_os_errors,
    quick_same,
    state_dir,
)


def tree_fingerprint(src: str, entries: Listing, options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([src, options, "columns"], sort_keys=True).encode())
    entries.digest_into(h)
    return h.hexdigest()


@dataclasses.dataclass
class TreePlan:
    """What a stage of a tree-shaped source has to do: its listing (``files``, the
    regular ones, and ``entries``, the rest: directories and links, so no file is held
    twice), what is already in place (``done``) and what is not (``todo``: indices into
    ``files``). ``complete``: a complete manifest matches, nothing to do."""

    entries: Listing
    files: Listing
    fingerprint: str
    complete: bool
    done: Done
    todo: array[int]
    # The files' size, blocks, mode and time are not in the listing yet (a listing of
    # names: LocalTree.plan): each is learned as it is copied (CopyFiles' stat_at_open),
    # and the fingerprint is made once all are (LocalTree.fingerprint).
    stat_at_open: bool = False

    @property
    def total_bytes(self) -> int:
        return self.files.total_bytes


def space_needed(plan: TreePlan, dst_parent: Path) -> int:
    """Bytes (in whole blocks of ``dst_parent``'s file system) the files to do take (0
    where their sizes are not known yet: a write that finds the disk full fails the
    stage with NotEnoughSpaceError)."""
    bsize = os.statvfs(dst_parent).f_frsize or 4096
    sizes, blocks = plan.files.size, plan.files.blocks
    needed = 0
    for i in plan.todo:
        size, alloc = sizes[i], blocks[i] * 512
        needed += -(-(alloc if alloc < size else size) // bsize) * bsize
    return needed


def make_dirs(plan: TreePlan, dest: Destination) -> None:
    """Directories first, writable for us; their own modes and times are set at the end."""
    with named_os_errors("cannot create directory: "):
        if not dest.single:
            dest.root.mkdir(exist_ok=True)
            ensure_writable(dest.root)
        for e in plan.entries.of_kind(DIR):
            d = dest.root / e.path
            d.mkdir(exist_ok=True)
            ensure_writable(d)


def plan_against(
    dest: Destination,
    entries: Listing | list[Entry],
    fingerprint: str,
    same: Callable[[int, Record], bool] | None = None,
    files: Listing | None = None,
) -> TreePlan:
    """``entries`` against what ``dest`` holds (under its lock): complete, or what is
    done (a known record of the same size and time that ``same`` accepts, given the
    file's row among the files of ``entries``; by default one of the same mode, still in
    place) and what is to do. With ``files``, those are the files and ``entries`` the
    folders and links alone (no listing of both is made)."""
    if files is None:
        listing = entries if isinstance(entries, Listing) else Listing.of(entries)
        files = listing.of_kind(FILE)
        listing = listing.of_kind(DIR, LINK)  # the caller's listing is freed when it drops it
    else:
        listing = entries if isinstance(entries, Listing) else Listing.of(entries)
    if dest.is_complete(fingerprint):
        assert dest.old is not None
        old: FileTable = dest.old["files"]
        return TreePlan(listing, files, fingerprint, True, Done(files, old, _rows_in(old, files)),
                        array("q"))  # fmt: skip
    known = dest.known_table()
    rows = _rows_in(known, files)
    root = os.fsencode(dest.root) + b"/"
    path = files.paths
    for i, r in enumerate(rows):
        if r < 0:
            continue
        size, mtime = files.size[i], files.mtime_ns[i]
        ok = known.size[r] == size and known.mtime_ns[r] == mtime and (
            files.mode[i] == known.mode[r] if same is None else same(i, known.record(r))
        )
        if ok:
            try:
                st = os.lstat(root + bytes(path[files.offsets[i] : files.offsets[i + 1]]))
            except OSError:
                ok = False
            else:
                ok = stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_mtime_ns == mtime
        if not ok:
            rows[i] = -1
    todo = array("q", (i for i, r in enumerate(rows) if r < 0))
    return TreePlan(listing, files, fingerprint, False, Done(files, known, rows), todo)


def _raw(col: Any) -> memoryview:
    """The column's bytes, not copied (memoryviews of the format "B" compare bytewise)."""
    mv = memoryview(col)
    return mv if mv.format == "B" else mv.cast("B")


def _rows_in(table: FileTable, files: Listing) -> array[int]:
    """Each file's row in ``table``, or -1."""
    if not len(table):
        return array("q", [-1]) * len(files)
    if len(table) == len(files) and _raw(table.offsets) == _raw(files.offsets) and _raw(
        table.paths
    ) == _raw(files.paths):
        return array("q", range(len(files)))  # the same paths (an unchanged tree's)
    if files.is_sorted():
        return table.matches(files.path_bytes())
    return array("q", (table.find(p) for p in files.path_bytes()))


def run_plan(source: Any, req: StageRequest, dest: Destination, plan: TreePlan) -> StageResult:
    """The tree pipeline after planning: drop what the source no longer has, check
    space, make the directories, ``source.transfer`` the files to do (it adds each
    finished one's record to ``done`` and the journal, and returns the engine's name and
    the files and bytes it copied), ``source.finish`` (links, directory times), commit."""
    if plan.complete:
        result = dest.skipped(len(plan.files), plan.total_bytes)
    else:
        result = _run(source, req, dest, plan)
    if req.checksum is not None:
        check_file_checksum(result.path, source.name, req.checksum)
    return result


def _run(source: Any, req: StageRequest, dest: Destination, plan: TreePlan) -> StageResult:
    dest.drop_stale(plan.files)  # an old file where the source now has a folder goes too
    dest.check_space(space_needed(plan, dest.path.parent))
    make_dirs(plan, dest)
    done = plan.done
    done_bytes = done.total_bytes
    on_progress, bar = progress_callback(
        req.progress, f"stage {source.label}",
        None if plan.stat_at_open else plan.total_bytes, done_bytes,
    )  # fmt: skip
    flusher = dest.begin(done)
    ok = False
    try:
        engine, copied_files, copied_bytes = "none", 0, 0
        # A source with a ``batch`` transfers that many files at a time: what the copier
        # holds per file (and the lists it is made from) stays bounded on huge trees.
        step = getattr(source, "batch", 0) or max(1, len(plan.todo))
        if dest.scheduler is not None:  # a stage in the background: readers' files first
            engine, copied_files, copied_bytes = dest.scheduler.transfer(
                source, req, dest, plan, done, flusher, on_progress)  # fmt: skip
        else:
            for k in range(0, max(1, len(plan.todo)), step):
                part = dataclasses.replace(plan, todo=plan.todo[k : k + step])
                used, files, nbytes = source.transfer(req, dest, part, done, flusher,
                                                      on_progress)  # fmt: skip
                engine = used if used != "none" else engine
                copied_files, copied_bytes = copied_files + files, copied_bytes + nbytes
        flusher.close()
        source.finish(plan, dest)
        if plan.stat_at_open:  # every file's size and time known now
            plan.fingerprint = source.fingerprint(plan, req)
        ok = True
    finally:
        with contextlib.suppress(Exception):
            flusher.close()  # after an error: keep what finished, report the first error
        if ok:
            dest.journal.close()
        else:  # (its error, a full disk's too, would hide the first)
            with contextlib.suppress(OSError):
                dest.journal.close()
        if bar is not None:
            bar.close()
    manifest = Manifest(
        source=source.name, options=source.options, fingerprint=plan.fingerprint,
        kind="file" if dest.single else "tree", chunk_size=req.stripe, durable=req.sync,
        engine=engine, files=done,
        symlinks={plan.entries.path(i): t for i, t in sorted(plan.entries.targets.items())},
        dirs=[e.path for e in plan.entries.of_kind(DIR)], **source.extra(plan),
    )  # fmt: skip
    dest.commit(manifest)
    return dest.result(manifest, copied_files, copied_bytes)


class LocalTree:
    """A directory, or one file (``single``), on a file system (:class:`Source`)."""

    batch = 16384  # files per copy job (run_plan): what one holds per file is ~250 bytes
    lands_once = True  # each file lands once, whole, at its final name (Schedule.opened)

    def __init__(self, src: Path, req: StageRequest, *, single: bool) -> None:
        self.src = src  # absolute, symbolic links resolved
        self.single = single
        self.name = str(src)
        self.label = src.name
        self.options: dict[str, Any] = {
            **req.selection(), "on_special": req.on_special, "file": single,
        }  # fmt: skip
        self._probe: LatencyProbe | None = None
        self._names: Listing | None = None  # the names' listing a plan was made from
        self._latency: tuple[float | None] | None = None  # (seconds,) once measured
        # Copy jobs' options by (engine, workers, stripe), the engine's rule applied once:
        # a stage in the background runs a job per few files (each look at the source's
        # file system is a round trip on a network one).
        self._copy_options: dict[tuple[str, int | None, int, bool], _core.CopyOptions] = {}

    def _measure(self, req: StageRequest) -> None:
        """Starts measuring the source's request latency (engine.LatencyProbe), once,
        and only where it sets the files in flight: a network or FUSE file system, no
        ``workers``."""
        if self._probe is None and self._latency is None:
            if not req.workers and network_fs(self.src):
                self._probe = LatencyProbe(self.src)
            else:
                self._latency = (None,)

    def latency(self, req: StageRequest) -> float | None:
        """The source's request latency, measured once (see :meth:`_measure`)."""
        if self._latency is None:
            self._measure(req)
            if self._probe is not None:
                self._latency = (self._probe.result(),)
        return self._latency[0] if self._latency is not None else None

    def listing(self, req: StageRequest) -> Listing:
        """The source's entries, the subset filter applied; for a file, its one entry.
        The latency is measured meanwhile, for the copy; the walk's threads follow the
        unmeasured rule."""
        self._measure(req)
        flight = in_flight(req.workers, self.src)
        threads = min(64, max(8, flight.files))
        if self.single:
            return Listing.of(_core.stat_file(str(self.src.parent), self.src.name).entries())
        entries = Listing.from_walk(
            _core.walk_columns(
                str(self.src), list(req.include), list(req.exclude), req.on_special == "skip",
                threads,
            )
        )  # fmt: skip
        if req.include:
            # With include patterns, keep only the directories leading to something taken.
            keep: set[str] = set()
            for e in entries:
                if e.kind != DIR:
                    parts = e.path.split("/")[:-1]
                    keep.update("/".join(parts[: k + 1]) for k in range(len(parts)))
            entries = entries.take(
                array("q", (i for i, e in enumerate(entries) if e.kind != DIR or e.path in keep))
            )
            if not len(entries) and not req.allow_empty:
                raise req.nothing_selected(self.name)
        return entries

    def source_path(self, e: Entry) -> Path:
        """Where the file of listing entry ``e`` is read from."""
        return self.src if self.single else self.src / e.path

    def plan(self, req: StageRequest, dest: Destination, listing: Any = None) -> TreePlan:
        """Lists the source (or takes ``listing``) and works out what is already in place
        (under the destination's lock). A fresh stage in the background of a tree of
        folders and regular files takes the names its schedule walked (no stat per file:
        on a network file system, a round trip each, which the stage's start would wait
        for and the files readers want would queue behind): its files' sizes and times
        are learned as they are copied."""
        with dest.timed("listing"):
            names = None
            if listing is None and dest.scheduler is not None and not self.single:
                names = dest.scheduler.names_listing()
            if names is not None:
                self._names = names  # (its files' rows filled in at the end: fingerprint)
                self._measure(req)
                with dest.timed("planning"):
                    return self._plan(req, dest, names, stat_at_open=True)
            listed = listing if listing is not None else self.listing(req)
        with dest.timed("planning"):
            return self._plan(req, dest, listed)

    def fingerprint(self, plan: TreePlan, req: StageRequest) -> str:
        """The fingerprint of the names' listing ``plan`` was made from, its files' rows
        filled in from ``plan.files`` (as copied): the one a walk of the same tree gives
        (tree_fingerprint)."""
        whole = self._names
        assert whole is not None
        at = list(compress(range(len(whole)), (k == FILE for k in whole.kind)))
        for name in ("size", "blocks", "mode", "mtime_ns"):
            col, got = getattr(whole, name), getattr(plan.files, name)
            for i, v in zip(at, got, strict=True):
                col[i] = v
        return tree_fingerprint(self.name, whole, {**self.options, "chunk": req.stripe})

    def _plan(self, req: StageRequest, dest: Destination, listed: Any,
              stat_at_open: bool = False) -> TreePlan:  # fmt: skip
        if not isinstance(listed, Listing):
            listed = Listing.of(listed)
        entries = listed.with_paths([dest.path.name] * len(listed)) if self.single else listed
        # (unknown sizes: a fingerprint no manifest has, made again at the end)
        fp = "" if stat_at_open else tree_fingerprint(self.name, entries,
                                                      {**self.options, "chunk": req.stripe})
        plan = plan_against(dest, entries, fp)
        plan.stat_at_open = stat_at_open
        journal = dest.journal
        # Files an interrupted run put in place (linked or renamed) but had not journalled
        # yet: whole, as long as the machine did not reboot since; their digests are read
        # back locally.
        if not plan.complete and journal.found and journal.same_boot and plan.todo:
            files = plan.files
            rehash = [i for i in plan.todo
                      if quick_same(dest.root / files[i].path, files[i].size, files[i].mtime_ns)]
            if rehash:
                got = digest_local(
                    dest.root, [files[i] for i in rehash], req.engine, req.workers, req.stripe
                )
                for i in rehash:
                    rec = got.get(files[i].path)
                    if rec is not None:
                        plan.done.set(i, rec)
                plan.todo = array("q", (i for i in plan.todo if not plan.done.is_done(i)))
        return plan

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        return run_plan(self, req, dest, self.plan(req, dest, listing))

    def transfer(
        self,
        req: StageRequest,
        dest: Destination,
        plan: TreePlan,
        done: Done,
        flusher: JournalFlusher,
        on_progress: ProgressCallback | None,
    ) -> tuple[str, int, int]:
        files, todo = plan.files, plan.todo
        copied = [0, 0]
        # The files to do, as columns: per file only its path is made into an object
        # (once for the job's lists, once for its journal record), no Entry; the record
        # keeps the path's bytes and the raw digests (no decoding, no hex).
        sub = files.take(todo) if len(todo) != len(files) else files
        size, mtime, mode = sub.size, sub.mtime_ns, sub.mode
        blob, ends = sub.paths, sub.offsets

        learn = plan.stat_at_open

        def on_done(batch: list[tuple[int, bytes]], final: bool) -> None:
            if not batch:
                return
            records: list[JournalRecord] = []
            add, nbytes = records.append, 0
            for idx, digests in batch:
                if learn:  # the listing's row gets what the copy found
                    n, blk, md, mt = job.task_meta(idx)
                    row = todo[idx]
                    files.size[row], files.blocks[row] = n, blk
                    files.mode[row], files.mtime_ns[row] = md, mt
                    add((blob[ends[idx] : ends[idx + 1]], n, mt, md, digests))
                else:
                    n = size[idx]
                    add((blob[ends[idx] : ends[idx + 1]], n, mtime[idx], mode[idx], digests))
                nbytes += n
            done.set_listed([todo[idx] for idx, _d in batch], [d for _i, d in batch])
            copied[0] += len(batch)
            copied[1] += nbytes
            flusher.add(records)

        if not todo:
            if on_progress is not None:
                on_progress(plan.total_bytes, plan.total_bytes, len(files), len(files))
            return "none", 0, 0
        root = self.src.parent if self.single else self.src
        paths = list(sub.path_bytes())
        job = _core.CopyJob(
            str(root),
            str(dest.root),
            _core.CopyFiles(
                [os.fsencode(self.src.name)] if self.single else paths,
                paths,
                size,
                sub.blocks,
                mode,
                mtime,
                stat_at_open=learn,
            ),
            self.copy_options(req, root),
        )
        job.start()
        run_job(
            job,
            on_progress=on_progress,
            base_bytes=plan.done.total_bytes,
            base_files=len(plan.done),
            total_bytes=plan.total_bytes,
            total_files=len(files),
            on_done=on_done,
        )
        dest.add_time("reading", job.read_seconds)
        dest.add_time("writing", job.write_seconds)
        dest.add_time("metadata", job.meta_seconds)
        return str(job.engine), copied[0], copied[1]

    def copy_options(self, req: StageRequest, root: Path) -> _core.CopyOptions:
        """A copy job's options for ``req`` (see job.copy_options), made once per stage;
        on a thread of a stage in the background's own order (job.set_background),
        its threads run at nice 19."""
        background = runs_background()
        key = (req.engine, req.workers, req.stripe, background)
        got = self._copy_options.get(key)
        if got is None:
            engine = resolve_engine(req.engine, root)
            # (given workers, the latency is not the rule's: not waited for)
            latency = None if req.workers else self.latency(req)
            got = copy_options(engine, req.workers, req.stripe, root, latency)
            got.lowest_priority = background
            self._copy_options[key] = got
        return got

    def finish(self, plan: TreePlan, dest: Destination) -> None:
        """Symlinks, then directory modes and times, deepest first (so setting a
        directory's time is not undone by creating something inside it)."""
        with named_os_errors("cannot finish staging: "):
            for i in sorted(plan.entries.targets):
                e = plan.entries[i]
                _place_link(dest.root / e.path, e)
            if self.single:
                return
            dirs = sorted(
                plan.entries.of_kind(DIR),
                key=lambda e: e.path.count("/"),
                reverse=True,
            )
            for e in dirs:
                d = dest.root / e.path
                os.chmod(d, e.mode)
                os.utime(d, ns=(e.mtime_ns, e.mtime_ns))
            st = os.stat(self.src)
            os.chmod(dest.root, stat.S_IMODE(st.st_mode))
            os.utime(dest.root, ns=(st.st_mtime_ns, st.st_mtime_ns))

    def extra(self, plan: TreePlan) -> dict[str, Any]:
        return {}


def _place_link(link: Path, e: Entry) -> None:
    if not (os.path.islink(link) and os.readlink(link) == e.target):
        if os.path.lexists(link):
            if os.path.isdir(link) and not os.path.islink(link):
                raise stage_error(
                    errno.EISDIR, f"cannot replace directory '{link}' with a symbolic link",
                    str(link),
                )  # fmt: skip
            link.unlink()
        os.symlink(e.target, link)
    os.utime(link, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)


def check_file_checksum(copy: Path, src: str | Path, checksum: tuple[str, str]) -> None:
    """Hashes the staged copy of a file (local, fast) against its published checksum."""
    h = hashlib.new(checksum[0])
    with open(copy, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    if h.hexdigest() != checksum[1]:
        # Not complete: the manifest goes, so the next call copies again.
        with contextlib.suppress(FileNotFoundError):
            (state_dir(copy) / "manifest.json").unlink()
        exc = ChecksumMismatchError(
            errno.EIO,
            f"checksum mismatch for '{src}': expected {checksum[0]}:{checksum[1]}, "
            f"got {checksum[0]}:{h.hexdigest()}",
        )
        exc.filename = str(src)
        raise exc
