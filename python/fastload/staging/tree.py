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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import ChecksumMismatchError, stage_error
from .destination import Destination, Entry, Manifest
from .job import (
    DEFAULT_FILES_IN_FLIGHT,
    DIR,
    FILE,
    LINK,
    ProgressCallback,
    copy_options,
    digest_local,
    progress_callback,
    run_job,
)
from .request import StageRequest
from .result import StageResult
from .state import (
    JournalFlusher,
    Record,
    Records,
    ensure_writable,
    named_os_errors,
    quick_same,
    state_dir,
)


def tree_fingerprint(src: str, entries: list[Entry], options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([src, options], sort_keys=True).encode())
    for e in entries:
        h.update(repr(tuple(e)).encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    return h.hexdigest()


@dataclasses.dataclass
class TreePlan:
    """What a stage of a tree-shaped source has to do: its listing (``entries``, and
    ``files``, the regular ones), what is already in place (``done``: path -> record)
    and what is not (``todo``: indices into ``files``). ``complete``: a complete
    manifest matches, nothing to do."""

    entries: list[Entry]
    files: list[Entry]
    fingerprint: str
    complete: bool
    done: Records
    todo: list[int]

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files)


def space_needed(plan: TreePlan, dst_parent: Path) -> int:
    """Bytes (in whole blocks of ``dst_parent``'s file system) the files to do take."""
    bsize = os.statvfs(dst_parent).f_frsize or 4096
    needed = 0
    for i in plan.todo:
        size, blocks = plan.files[i].size, plan.files[i].blocks
        alloc = min(size, blocks * 512) if blocks * 512 < size else size
        needed += -(-alloc // bsize) * bsize
    return needed


def make_dirs(plan: TreePlan, dest: Destination) -> None:
    """Directories first, writable for us; their own modes and times are set at the end."""
    with named_os_errors("cannot create directory: "):
        if not dest.single:
            dest.root.mkdir(exist_ok=True)
            ensure_writable(dest.root)
        for e in plan.entries:
            if e.kind == DIR:
                d = dest.root / e.path
                d.mkdir(exist_ok=True)
                ensure_writable(d)


def plan_against(
    dest: Destination,
    entries: list[Entry],
    fingerprint: str,
    same: Callable[[Entry, Record], bool],
) -> TreePlan:
    """``entries`` against what ``dest`` holds (under its lock): complete, or what is
    done (a known record ``same`` accepts) and what is to do."""
    files = [e for e in entries if e.kind == FILE]
    if dest.is_complete(fingerprint):
        assert dest.old is not None
        held = {e.path: Record(*dest.old["files"][e.path]) for e in files
                if e.path in dest.old["files"]}  # fmt: skip
        return TreePlan(entries, files, fingerprint, True, held, [])
    known = dest.known()
    done: Records = {}
    todo: list[int] = []
    for i, e in enumerate(files):
        rec = known.get(e.path)
        if rec is not None and rec.size == e.size and rec.mtime_ns == e.mtime_ns and same(e, rec):
            done[e.path] = rec
        else:
            todo.append(i)
    return TreePlan(entries, files, fingerprint, False, done, todo)


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
    dest.drop_stale(e.path for e in plan.entries)
    dest.check_space(space_needed(plan, dest.path.parent))
    make_dirs(plan, dest)
    done: Records = dict(plan.done)
    done_bytes = sum(r.size for r in done.values())
    on_progress, bar = progress_callback(
        req.progress, f"stage {source.label}", plan.total_bytes, done_bytes
    )
    flusher = dest.begin(done)
    try:
        engine, copied_files, copied_bytes = source.transfer(
            req, dest, plan, done, flusher, on_progress
        )
        flusher.close()
        source.finish(plan, dest)
    finally:
        with contextlib.suppress(Exception):
            flusher.close()  # after an error: keep what finished, report the first error
        dest.journal.close()
        if bar is not None:
            bar.close()
    manifest = Manifest(
        source=source.name, options=source.options, fingerprint=plan.fingerprint,
        kind="file" if dest.single else "tree", chunk_size=req.stripe, durable=req.sync,
        engine=engine, files=done,
        symlinks={e.path: e.target for e in plan.entries if e.kind == LINK},
        dirs=[e.path for e in plan.entries if e.kind == DIR], **source.extra(plan),
    )  # fmt: skip
    dest.commit(manifest)
    return dest.result(manifest, copied_files, copied_bytes)


class LocalTree:
    """A directory, or one file (``single``), on a file system (:class:`Source`)."""

    def __init__(self, src: Path, req: StageRequest, *, single: bool) -> None:
        self.src = src  # absolute, symbolic links resolved
        self.single = single
        self.name = str(src)
        self.label = src.name
        self.options: dict[str, Any] = {
            **req.selection(), "on_special": req.on_special, "file": single,
        }  # fmt: skip

    def listing(self, req: StageRequest) -> list[Entry]:
        """The source's entries, the subset filter applied; for a file, its one entry."""
        threads = min(64, max(8, (req.workers or DEFAULT_FILES_IN_FLIGHT)))
        if self.single:
            return [Entry(*e) for e in _core.stat_file(str(self.src.parent),
                                                       self.src.name).entries()]  # fmt: skip
        raw = _core.walk(
            str(self.src), list(req.include), list(req.exclude), req.on_special == "skip", threads
        ).entries()
        entries = [Entry(*e) for e in raw]
        if req.include:
            # With include patterns, keep only the directories leading to something taken.
            keep: set[str] = set()
            for e in entries:
                if e.kind != DIR:
                    parts = e.path.split("/")[:-1]
                    keep.update("/".join(parts[: k + 1]) for k in range(len(parts)))
            entries = [e for e in entries if e.kind != DIR or e.path in keep]
            if not entries and not req.allow_empty:
                raise req.nothing_selected(self.name)
        return entries

    def source_path(self, e: Entry) -> Path:
        """Where the file of listing entry ``e`` is read from."""
        return self.src if self.single else self.src / e.path

    def plan(self, req: StageRequest, dest: Destination, listing: Any = None) -> TreePlan:
        """Lists the source (or takes ``listing``) and works out what is already in place
        (under the destination's lock)."""
        listed = listing if listing is not None else self.listing(req)
        entries = [e._replace(path=dest.path.name) for e in listed] if self.single else listed
        fp = tree_fingerprint(self.name, entries, {**self.options, "chunk": req.stripe})
        plan = plan_against(dest, entries, fp, lambda e, rec: rec.mode == e.mode)
        journal = dest.journal
        # Files an interrupted run renamed into place but had not journalled yet: whole, as
        # long as the machine did not reboot since; their digests are read back locally.
        if not plan.complete and journal.found and journal.same_boot and plan.todo:
            files = plan.files
            rehash = [i for i in plan.todo
                      if quick_same(dest.root / files[i].path, files[i].size, files[i].mtime_ns)]
            if rehash:
                plan.done.update(digest_local(
                    dest.root, [files[i] for i in rehash], req.engine, req.workers, req.stripe
                ))  # fmt: skip
                plan.todo = [i for i in plan.todo if files[i].path not in plan.done]
        return plan

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        return run_plan(self, req, dest, self.plan(req, dest, listing))

    def transfer(
        self,
        req: StageRequest,
        dest: Destination,
        plan: TreePlan,
        done: Records,
        flusher: JournalFlusher,
        on_progress: ProgressCallback | None,
    ) -> tuple[str, int, int]:
        files, todo = plan.files, plan.todo
        copied = [0, 0]

        def on_done(batch: list[tuple[int, bytes]], final: bool) -> None:
            records = []
            for idx, digests in batch:
                e = files[todo[idx]]
                rec = Record(e.size, e.mtime_ns, e.mode, digests.hex())
                done[e.path] = rec
                records.append((e.path, *rec))
                copied[0] += 1
                copied[1] += e.size
            flusher.add(records)

        if not todo:
            if on_progress is not None:
                on_progress(plan.total_bytes, plan.total_bytes, len(files), len(files))
            return "none", 0, 0
        root = self.src.parent if self.single else self.src
        job = _core.CopyJob(
            str(root),
            str(dest.root),
            _core.CopyFiles(
                [self.src.name] if self.single else [files[i].path for i in todo],
                [files[i].path for i in todo],
                [files[i].size for i in todo],
                [files[i].blocks for i in todo],
                [files[i].mode for i in todo],
                [files[i].mtime_ns for i in todo],
            ),
            copy_options(req.engine, req.workers, req.stripe, root),
        )
        job.start()
        run_job(
            job,
            on_progress=on_progress,
            base_bytes=sum(r.size for r in plan.done.values()),
            base_files=len(plan.done),
            total_bytes=plan.total_bytes,
            total_files=len(files),
            on_done=on_done,
        )
        return str(job.engine), copied[0], copied[1]

    def finish(self, plan: TreePlan, dest: Destination) -> None:
        """Symlinks, then directory modes and times, deepest first (so setting a
        directory's time is not undone by creating something inside it)."""
        with named_os_errors("cannot finish staging: "):
            for e in plan.entries:
                if e.kind == LINK:
                    _place_link(dest.root / e.path, e)
            if self.single:
                return
            dirs = sorted(
                (e for e in plan.entries if e.kind == DIR),
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
