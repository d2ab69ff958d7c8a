"""The tree pipeline: copy a file or a directory tree into a destination.

List the source in parallel; skip if a complete manifest matches; take what an interrupted
run finished from the journal; check free space; run the native copier (many files in
flight, big files in stripes, digests on the way), journalling completed files; then set
directory metadata, create symlinks and write the manifest, atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from .. import _core
from .._util import write_json_atomic
from ..errors import ChecksumMismatchError, stage_error
from .job import (
    DEFAULT_FILES_IN_FLIGHT,
    DIR,
    FILE,
    JOURNAL_EVERY,
    LINK,
    Progress,
    digest_local,
    job_kwargs,
    progress_callback,
    prove,
    run_job,
)
from .result import StageResult
from .state import (
    MANIFEST_VERSION,
    Journal,
    JournalFlusher,
    Records,
    boot_id,
    check_space,
    ensure_writable,
    known_records,
    make_durable,
    named_os_errors,
    quick_same,
    reread,
    state_dir,
)


def tree_fingerprint(src: str, entries: list[tuple[Any, ...]], options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([src, options], sort_keys=True).encode())
    for e in entries:
        h.update(repr(e).encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    return h.hexdigest()


@dataclasses.dataclass
class TreePlan:
    """What a stage of a tree (or a file) has to do: the source's listing, what is
    already in place (``done``: path -> journal record) and what is not (``todo``:
    indices into ``files``). ``complete``: a complete manifest matches, nothing to do."""

    src_root: Path
    dst_root: Path
    entries: list[tuple[Any, ...]]
    files: list[tuple[Any, ...]]
    src_names: list[str]
    fingerprint: str
    old: dict[str, Any] | None
    complete: bool
    done: dict[str, tuple[int, int, int, str]]
    todo: list[int]
    journal: Journal

    @property
    def total_bytes(self) -> int:
        return sum(e[2] for e in self.files)


def list_tree(
    src_abs: Path, is_file: bool, options: dict[str, Any], workers: int | None
) -> list[tuple[Any, ...]]:
    """The source's entries (path, kind, size, blocks, mode, mtime_ns, link target), the
    subset filter applied; for a file, its one entry."""
    threads = min(64, max(8, (workers or DEFAULT_FILES_IN_FLIGHT)))
    if is_file:
        return _core.stat_file(str(src_abs.parent), src_abs.name).entries()
    entries = _core.walk(
        str(src_abs),
        options["include"],
        options["exclude"],
        options["on_special"] == "skip",
        threads,
    ).entries()
    if options["include"]:
        # With include patterns, keep only the directories leading to something taken.
        keep: set[str] = set()
        for e in entries:
            if e[1] != DIR:
                parts = e[0].split("/")[:-1]
                keep.update("/".join(parts[: k + 1]) for k in range(len(parts)))
        entries = [e for e in entries if e[1] != DIR or e[0] in keep]
    return entries


def plan_tree(
    src_abs: Path,
    dst_abs: Path,
    is_file: bool,
    options: dict[str, Any],
    old: dict[str, Any] | None,
    engine: str,
    workers: int | None,
    stripe: int,
    listing: list[tuple[Any, ...]] | None = None,
) -> TreePlan:
    """Lists the source (or takes ``listing``, from :func:`list_tree`) and works out what
    is already in place (under the node lock)."""
    listed = listing if listing is not None else list_tree(src_abs, is_file, options, workers)
    if is_file:
        src_root, dst_root = src_abs.parent, dst_abs.parent
        entries = [(dst_abs.name, *e[1:]) for e in listed]
        src_names = [src_abs.name]
    else:
        src_root, dst_root = src_abs, dst_abs
        entries = list(listed)
        src_names = [e[0] for e in entries if e[1] == FILE]
    fingerprint = tree_fingerprint(str(src_abs), entries, {**options, "chunk": stripe})
    files = [e for e in entries if e[1] == FILE]

    def proven(records: Records) -> Records:
        return prove(dst_root, records, engine, workers, stripe)

    # Written on an earlier boot without a flush: only what reads back whole counts.
    old, whole = reread(dst_root, dst_abs, old, fingerprint, proven)
    journal = Journal(dst_abs, stripe)
    if (
        whole
        and old is not None
        and old.get("complete")
        and old.get("fingerprint") == fingerprint
        and os.path.lexists(dst_abs)
    ):
        held = {e[0]: tuple(old["files"][e[0]]) for e in files if e[0] in old["files"]}
        return TreePlan(
            src_root, dst_root, entries, files, src_names, fingerprint, old,
            complete=True, done=held, todo=[], journal=journal,
        )  # fmt: skip

    # What is already in place: from the interrupted run's journal, or from the previous
    # complete manifest (a re-stage after the source changed copies only the changes).
    known = known_records(journal, old, stripe, proven)
    done: dict[str, tuple[int, int, int, str]] = {}
    todo: list[int] = []
    for i, e in enumerate(files):
        path, _, size, _, mode, mtime = e[0], e[1], e[2], e[3], e[4], e[5]
        rec = known.get(path)
        if (
            rec is not None
            and rec[0] == size
            and rec[1] == mtime
            and rec[2] == mode
            and quick_same(dst_root / path, size, mtime)
        ):
            done[path] = rec
        else:
            todo.append(i)
    # Files an interrupted run renamed into place but had not journalled yet: whole, as
    # long as the machine did not reboot since; their digests are read back locally.
    if journal.found and journal.same_boot and todo:
        rehash = [i for i in todo if quick_same(dst_root / files[i][0], files[i][2], files[i][5])]
        if rehash:
            done.update(
                digest_local(dst_root, [files[i] for i in rehash], engine, workers, stripe)
            )
            todo = [i for i in todo if files[i][0] not in done]
    return TreePlan(
        src_root, dst_root, entries, files, src_names, fingerprint, old,
        complete=False, done=done, todo=todo, journal=journal,
    )  # fmt: skip


def space_needed(plan: TreePlan, dst_parent: Path) -> int:
    """Bytes (in whole blocks of ``dst_parent``'s file system) the files to do take."""
    bsize = os.statvfs(dst_parent).f_frsize or 4096
    needed = 0
    for i in plan.todo:
        size, blocks = plan.files[i][2], plan.files[i][3]
        alloc = min(size, blocks * 512) if blocks * 512 < size else size
        needed += -(-alloc // bsize) * bsize
    return needed


def make_dirs(plan: TreePlan, dst_abs: Path, is_file: bool) -> None:
    """Directories first, writable for us; their own modes and times are set at the end."""
    with named_os_errors("cannot create directory: "):
        if not is_file:
            dst_abs.mkdir(exist_ok=True)
            ensure_writable(dst_abs)
        for e in plan.entries:
            if e[1] == DIR:
                d = plan.dst_root / e[0]
                d.mkdir(exist_ok=True)
                ensure_writable(d)


def stage_tree(
    src_abs: Path,
    dst_abs: Path,
    is_file: bool,
    options: dict[str, Any],
    old: dict[str, Any] | None,
    engine: str,
    progress: Progress,
    workers: int | None,
    stripe: int,
    t0: float,
    sync: bool,
    listing: list[tuple[Any, ...]] | None = None,
) -> StageResult:
    plan = plan_tree(src_abs, dst_abs, is_file, options, old, engine, workers, stripe, listing)
    src_root, dst_root, entries, files = plan.src_root, plan.dst_root, plan.entries, plan.files
    src_names, fingerprint, total_bytes = plan.src_names, plan.fingerprint, plan.total_bytes
    old, done, todo = plan.old, plan.done, plan.todo
    if plan.complete:
        assert old is not None
        make_durable(dst_abs, old, sync)
        return StageResult(dst_abs, len(files), total_bytes, time.monotonic() - t0, "none", True)
    journal = plan.journal
    journal.durable = sync
    done_bytes = sum(r[0] for r in done.values())

    # Files a previous stage put here that the source no longer has.
    if old is not None and old.get("complete"):
        wanted = {e[0] for e in entries}
        for p in old.get("files", {}):
            if p not in wanted:
                with contextlib.suppress(OSError):
                    (dst_root / p).unlink()

    check_space(dst_abs.parent, space_needed(plan, dst_abs.parent), dst_abs)
    make_dirs(plan, dst_abs, is_file)
    dirs = [e for e in entries if e[1] == DIR]

    journal.open(done)
    on_progress, bar = progress_callback(
        progress, f"stage {src_abs.name}", total_bytes, done_bytes
    )
    copied_files = copied_bytes = 0
    flusher = JournalFlusher(journal, str(dst_root), JOURNAL_EVERY)
    engine_name = "none"

    def on_done(batch: list[tuple[int, bytes]], final: bool) -> None:
        nonlocal copied_files, copied_bytes
        records = []
        for idx, digests in batch:
            e = files[todo[idx]]
            rec = (e[2], e[5], e[4], digests.hex())
            done[e[0]] = rec
            records.append((e[0], *rec))
            copied_files += 1
            copied_bytes += e[2]
        flusher.add(records)

    try:
        if todo:
            job = _core.CopyJob(
                str(src_root),
                str(dst_root),
                [src_names[i] for i in todo] if not is_file else src_names,
                [files[i][0] for i in todo],
                [files[i][2] for i in todo],
                [files[i][3] for i in todo],
                [files[i][4] for i in todo],
                [files[i][5] for i in todo],
                **job_kwargs(engine, workers, stripe, src_root),
            )
            job.start()
            engine_name = job.engine
            run_job(
                job,
                on_progress=on_progress,
                base_bytes=done_bytes,
                base_files=len(done),
                total_bytes=total_bytes,
                total_files=len(files),
                on_done=on_done,
            )
        elif on_progress is not None:
            on_progress(total_bytes, total_bytes, len(files), len(files))
        flusher.close()
        finish_tree(src_abs, dst_abs, dst_root, entries, is_file)
        if sync:
            _core.syncfs(str(dst_root))
    finally:
        with contextlib.suppress(Exception):
            flusher.close()  # after an error: keep what finished, report the first error
        journal.close()
        if bar is not None:
            bar.close()

    manifest = {
        "version": MANIFEST_VERSION,
        "complete": True,
        "source": str(src_abs),
        "options": options,
        "fingerprint": fingerprint,
        "kind": "file" if is_file else "tree",
        "chunk_size": stripe,
        "digest": "fl64",
        "boot_id": boot_id(),
        "durable": sync,
        "files_count": len(files),
        "bytes": total_bytes,
        "engine": engine_name,
        "created": time.time(),
        "files": {p: list(done[p]) for p in sorted(done)},
        "symlinks": {e[0]: e[6] for e in entries if e[1] == LINK},
        "dirs": [e[0] for e in dirs],
    }
    write_json_atomic(state_dir(dst_abs) / "manifest.json", manifest)
    journal.remove()
    return StageResult(
        dst_abs,
        len(files),
        total_bytes,
        time.monotonic() - t0,
        engine_name,
        False,
        copied_files,
        copied_bytes,
    )


def finish_tree(
    src_abs: Path, dst_abs: Path, dst_root: Path, entries: list[tuple[Any, ...]], is_file: bool
) -> None:
    """Symlinks, then directory modes and times, deepest first (so setting a directory's
    time is not undone by creating something inside it)."""
    with named_os_errors("cannot finish staging: "):
        for e in entries:
            if e[1] != LINK:
                continue
            link = dst_root / e[0]
            target = e[6]
            if os.path.islink(link) and os.readlink(link) == target:
                pass
            else:
                if os.path.lexists(link):
                    if os.path.isdir(link) and not os.path.islink(link):
                        raise stage_error(
                            errno.EISDIR,
                            f"cannot replace directory '{link}' with a symbolic link",
                            str(link),
                        )
                    link.unlink()
                os.symlink(target, link)
            os.utime(link, ns=(e[5], e[5]), follow_symlinks=False)
        if is_file:
            return
        dirs = sorted(
            (e for e in entries if e[1] == DIR), key=lambda e: e[0].count("/"), reverse=True
        )
        for e in dirs:
            d = dst_root / e[0]
            os.chmod(d, e[4])
            os.utime(d, ns=(e[5], e[5]))
        st = os.stat(src_abs)
        os.chmod(dst_abs, stat.S_IMODE(st.st_mode))
        os.utime(dst_abs, ns=(st.st_mtime_ns, st.st_mtime_ns))


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

