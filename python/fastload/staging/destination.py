"""The destination of a stage: one object owns the node lock, what an earlier stage left
(its manifest, read back where it was not flushed), the journal of this one, free space,
and the commit (the manifest written last, the journal dropped). Every source (a tree,
an object prefix, an archive) and fan-out go through it; the files it keeps are in
state.py."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import _core
from .._util import drop_lock, node_lock
from ..sources.objlist import compact_identity
from ..sources.retry import process_retries
from .columns import Entry, FileTable, Listing, Record
from .done import Done
from .job import JOURNAL_EVERY, Bar, prove, say_waiting
from .request import StageRequest
from .result import StageResult, StageStats
from .state import (
    MANIFEST_VERSION,
    Journal,
    JournalFlusher,
    Records,
    boot_id,
    check_space,
    known_records,
    known_table,
    make_durable,
    previous_stage,
    quick_same,
    read_manifest,
    reread,
    state_dir,
    trusted,
    write_manifest,
)

__all__ = ["Destination", "Entry", "Manifest", "recorded_kind", "run_locked", "stage_into"]


@dataclasses.dataclass
class Manifest:
    """What a complete stage writes beside its destination, last: ``manifest.json``, a
    header, and the files' table it names (columns.FileTable)."""

    source: str
    options: dict[str, Any]
    fingerprint: str
    kind: str  # "file" or "tree"
    chunk_size: int
    durable: bool
    engine: str
    files: Mapping[str, Record]  # a dict of records, a FileTable, or a stage's Done
    symlinks: dict[str, str] = dataclasses.field(default_factory=dict)
    dirs: list[str] = dataclasses.field(default_factory=list)
    archive: dict[str, Any] | None = None
    # An object prefix's: its files (a listing, sorted) and each one's identity, kept as
    # the tags of the table's rows.
    tags: tuple[Listing, Iterable[bytes]] | None = None

    def __post_init__(self) -> None:
        files = self.files
        table = files.table() if isinstance(files, Done) else FileTable.of(files)
        if self.tags is not None:
            listed, identities = self.tags
            table = table.tagged(listed, identities)
            self.tags = None
        self.files = table

    @property
    def table(self) -> FileTable:
        assert isinstance(self.files, FileTable)
        return self.files

    @property
    def bytes(self) -> int:
        return self.table.total_bytes

    def to_json(self) -> dict[str, Any]:
        """The header (the files are in :attr:`table`)."""
        out: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "complete": True,
            "source": self.source,
            "options": self.options,
            "fingerprint": self.fingerprint,
            "kind": self.kind,
        }
        if self.archive is not None:
            out["archive"] = self.archive
        out.update(
            chunk_size=self.chunk_size,
            digest="fl64",
            boot_id=boot_id(),
            durable=self.durable,
            files_count=len(self.files),
            bytes=self.bytes,
            engine=self.engine,
            created=time.time(),
        )
        out["symlinks"] = self.symlinks
        out["dirs"] = self.dirs
        return out


class Destination:
    """``path`` (a directory, or a file's final path when ``single``) and what fastload
    keeps beside it. Use :meth:`locked` around everything a stage does; it reads the
    earlier manifest (:attr:`old`). A source then asks :meth:`is_complete` for its
    fingerprint, :meth:`resume` for what is already in place, checks space, and
    :meth:`begin` / :meth:`commit` the journal and the manifest."""

    def __init__(self, path: Path, req: StageRequest, *, single: bool = False) -> None:
        self.path = path
        self.root = path.parent if single else path  # where the files are
        self.single = single
        self.req = req
        # Seconds per phase of the stage (listing, planning, and the copy's busy time
        # reading, writing and opening/closing), for stage(stats=True).
        self.timings: dict[str, float] = {}
        self.old: dict[str, Any] | None = None
        self.journal = Journal(path, req.stripe, durable=req.sync)
        # A stage in the background (background.py): the caller holds the node lock
        # already, and the tree pipeline copies through its schedule (schedule.py).
        self.lock_held = False
        self.scheduler: Any = None

    # --- the lock and the earlier stage -----------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[Destination]:
        """The node lock (other processes of the node wait, saying so when progress is
        shown); :attr:`old` is the earlier manifest as a stage may use it."""
        held = contextlib.nullcontext() if self.lock_held else node_lock(
            self.path, on_wait=say_waiting if self.req.progress else None)  # fmt: skip
        with held:
            self.reload()
            yield self

    def reload(self) -> None:
        """Reads what an earlier (or fan-out's) run left: the manifest, and the journal
        anew."""
        self.old = previous_stage(self.path)
        self.journal = Journal(self.path, self.req.stripe, durable=self.req.sync)

    def holds(self, source: str, options: dict[str, Any]) -> bool:
        """Whether a complete, trusted stage of this very request is here (what
        ``check_source=False`` returns without looking at the source)."""
        old = self.old
        return bool(
            old is not None
            and old.get("complete")
            and not old.get("damaged")
            and old.get("source") == source
            and old.get("options") == options
            and os.path.lexists(self.path)
            and trusted(old)
        )

    def prove(self, records: Records) -> Records:
        """The records whose files read back whole (see :func:`job.prove`)."""
        r = self.req
        return prove(self.root, records, r.engine, r.workers, r.stripe)

    def is_complete(self, fingerprint: str) -> bool:
        """Whether the earlier stage is complete for ``fingerprint``. An earlier stage
        written on another boot without a flush keeps only what reads back whole."""
        self.old, whole = reread(self.root, self.path, self.old, fingerprint, self.prove)
        old = self.old
        return bool(
            whole
            and old is not None
            and old.get("complete")
            and old.get("fingerprint") == fingerprint
            and os.path.lexists(self.path)
        )

    def known(self) -> Records:
        """Files already whole at their final paths with their recorded size and time:
        from the interrupted run's journal, then the earlier complete manifest (a stage
        after the source changed redoes only the changes)."""
        found = known_records(self.journal, self.old, self.req.stripe, self.prove)
        return {p: r for p, r in found.items() if quick_same(self.root / p, r.size, r.mtime_ns)}

    def known_table(self) -> FileTable:
        """:meth:`known` as a table, the files not yet checked in place (the caller
        checks those it plans to take)."""
        return known_table(self.journal, self.old, self.req.stripe, self.prove)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the time the block takes to ``timings[phase]``."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add_time(phase, time.monotonic() - t0)

    def add_time(self, phase: str, seconds: float) -> None:
        self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    def skipped(self, files: int, nbytes: int) -> StageResult:
        """The result of a stage that had nothing to do (flushed now with ``sync``)."""
        assert self.old is not None
        make_durable(self.path, self.old, self.req.sync)
        return StageResult(self.path, files, nbytes, time.monotonic() - self.req.t0, "none", True)

    # --- writing ---------------------------------------------------------------------

    def check_space(self, needed: int) -> None:
        check_space(self.path.parent, needed, self.path)

    def drop_stale(self, wanted: Listing | Iterable[str]) -> None:
        """Removes the files an earlier complete stage put here that the source no longer
        has (``wanted``: the source's listing, or its paths)."""
        if self.old is None or not self.old.get("complete") or self.single:
            return
        old: FileTable = self.old["files"]
        if isinstance(wanted, Listing) and wanted.is_sorted():
            stale = bytearray(b"\1") * len(old)
            for r in old.matches(wanted.path_bytes()):
                if r >= 0:
                    stale[r] = 0
        else:
            if isinstance(wanted, Listing):
                wanted = map(os.fsdecode, wanted.path_bytes())
            keep = set(wanted)
            stale = bytearray(p not in keep for p in old)
        root = os.fsencode(self.root) + b"/"
        for i, path in enumerate(old.path_bytes()):
            if stale[i]:
                with contextlib.suppress(OSError):
                    os.unlink(root + path)

    def begin(self, done: Mapping[str, Record]) -> JournalFlusher:
        """Starts this run's journal holding ``done``; finished files go to the flusher
        returned (closed by the caller)."""
        self.journal.open(done)
        return JournalFlusher(self.journal, str(self.root), JOURNAL_EVERY)

    def commit(self, manifest: Manifest) -> None:
        """Marks the stage complete: flushes with ``sync``, writes the manifest, drops the
        journal."""
        if self.req.sync:
            _core.syncfs(str(self.root))
        write_manifest(self.path, manifest.to_json(), manifest.table)
        self.journal.remove()

    def remove_if_empty(self) -> None:
        """Removes the destination directory this stage created if nothing is in it, and
        its state beside it unless a journal records finished files (a resume's)."""
        with contextlib.nullcontext() if self.lock_held else node_lock(self.path):
            with contextlib.suppress(OSError):
                if not self.single and self.path.is_dir() and not any(self.path.iterdir()):
                    self.path.rmdir()
            if os.path.lexists(self.path) or self.journal.has_records():
                return
            state = state_dir(self.path)
            self.journal.remove()
            with contextlib.suppress(OSError):
                state.rmdir()
            if not os.path.lexists(state):  # nothing of this run is left: nor its lock
                drop_lock(self.path)

    def result(self, m: Manifest, copied_files: int, copied_bytes: int) -> StageResult:
        return StageResult(
            self.path, len(m.files), m.bytes, time.monotonic() - self.req.t0, m.engine, False,
            copied_files, copied_bytes,
        )  # fmt: skip


def run_locked(dest: Destination, source: Any, listing: Any = None) -> StageResult:
    """The stage under the lock (held by the caller): what ``check_source=False`` trusts
    returns at once, everything else is the source's."""
    req = dest.req
    if not req.check_source and dest.holds(source.name, source.options):
        assert dest.old is not None
        return dest.skipped(int(dest.old["files_count"]), int(dest.old["bytes"]))
    result: StageResult = source.run(req, dest, listing)
    return result


def stage_into(dest: Destination, source: Any, retried: Mapping[str, int] | None = None,
               fanned: Callable[[Any, Destination], StageResult] | None = None
               ) -> StageResult:  # fmt: skip
    """Open the destination, lock, run the source (or, where ``fanned`` is given, that
    runner: the stage fanned out over the job's nodes, which takes its own locks; its
    caller, staging/api.py, imports fanout/: nothing here imports above itself). A
    stage that fails before it wrote anything leaves no empty destination behind. With
    ``stats`` the result says where the time went (:class:`StageStats`): the lock wait,
    CPU time, bytes and files done over time, from the progress callback, and the
    object-store requests this process retried since ``retried`` (the counts by reason
    when the source was opened; else from now)."""
    existed = os.path.lexists(dest.path)
    req = dest.req
    t0, usage = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
    if retried is None:
        retried = process_retries().snapshot()
    samples: list[tuple[float, int, int]] = []
    marks = {"locked": t0}
    if req.stats:
        shown = req.progress
        bar: list[Bar] = []

        def sample(bytes_done: int, bytes_total: int, files_done: int, files_total: int
                   ) -> None:  # fmt: skip
            samples.append((time.monotonic() - t0, bytes_done, files_done))
            if callable(shown):
                shown(bytes_done, bytes_total, files_done, files_total)
            elif shown:
                if not bar:
                    bar.append(Bar(f"stage {source.label}", bytes_total, bytes_done))
                bar[0](bytes_done, bytes_total, files_done, files_total)

        sampled = dataclasses.replace(req, progress=sample)

    def stats(result: StageResult) -> StageResult:
        for b in bar if req.stats else []:
            b.close()
        if not req.stats:
            return result
        now, end = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF)
        first = samples[0][0] + t0 if samples else now
        last = samples[-1][0] + t0 if samples else now
        phase = dest.timings.get
        now_retried = process_retries().snapshot()
        since = retried or {}
        reasons = {k: n - since.get(k, 0) for k, n in now_retried.items()
                   if n > since.get(k, 0)}  # fmt: skip
        return dataclasses.replace(result, stats=StageStats(
            seconds=now - t0, lock_wait_seconds=marks["locked"] - t0,
            setup_seconds=first - marks["locked"], copy_seconds=last - first,
            cpu_user_seconds=end.ru_utime - usage.ru_utime,
            cpu_system_seconds=end.ru_stime - usage.ru_stime, samples=samples,
            listing_seconds=phase("listing", 0.0), planning_seconds=phase("planning", 0.0),
            read_busy_seconds=phase("reading", 0.0), write_busy_seconds=phase("writing", 0.0),
            meta_busy_seconds=phase("metadata", 0.0),
            retries=sum(reasons.values()), retry_reasons=reasons,
        ))  # fmt: skip

    try:
        if fanned is not None:
            if req.stats:
                dest.req = sampled
            return stats(fanned(source, dest))
        with dest.locked():
            marks["locked"] = time.monotonic()
            if req.stats:
                dest.req = sampled
            return stats(run_locked(dest, source))
    except BaseException:
        if not existed:
            dest.remove_if_empty()
        raise
    finally:
        dest.req = req


def recorded_kind(dst: Path, name: str, url: str, identity: str) -> str | None:
    """What a complete earlier stage of this very object (same URL and ETag) into ``dst``
    (or ``dst/name``) found it to be: its compression (an archive), ``""`` (a file), or
    None (unknown): an unchanged object is not fetched again to look at its head."""
    for candidate in (dst, dst / name):
        m = read_manifest(Path(os.path.abspath(candidate)))
        if m is None or not m.get("complete") or m.get("damaged") or m.get("source") != url:
            continue
        archive = m.get("archive")
        if archive is not None and archive.get("identity") == str(identity):
            return str(archive["compression"])
        if m.get("kind") == "file" and _identity(m, candidate.name, identity):
            return ""
    return None


def _identity(manifest: dict[str, Any], name: str, identity: str) -> bool:
    """Whether an object prefix's manifest records ``identity`` for ``name``: its table's
    tag (a manifest of an older version: its ``objects``)."""
    if "objects" in manifest:
        return bool(manifest["objects"].get(name) == identity)
    table: FileTable = manifest["files"]
    row = table.find(name)
    return row >= 0 and table.tag(row) == compact_identity(identity)
