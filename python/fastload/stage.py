"""stage(): copy a file or a tree to node-local disk, fast, resumably, once per node.

The flow (see DESIGN.md): take the node lock beside the destination; list the source in
parallel; return at once if a complete manifest matches it; work out what a previous,
interrupted run already finished (the journal); check free space; run the native copier
(many files in flight, big files in stripes, digests on the way), journalling completed
files; then set directory metadata, create symlinks and write the manifest, atomically.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Literal, Union

from . import _core
from ._archive import archive_compression, parse_checksum, stage_archive
from ._engine import resolve_engine
from ._state import (
    MANIFEST_VERSION,
    Journal,
    JournalFlusher,
    Records,
    boot_id,
    known_records,
    node_lock,
    read_manifest,
    reread,
    state_dir,
    trusted,
    write_json_atomic,
)
from .errors import ChecksumMismatchError, NotEnoughSpaceError, StageError, stage_error

__all__ = ["StageResult", "VerifyResult", "available_engines", "stage", "verify"]

PathLike = Union[str, "os.PathLike[str]"]
Patterns = Union[str, Sequence[str], None]
ProgressCallback = Callable[[int, int, int, int], None]
Progress = Union[bool, ProgressCallback, None]

DEFAULT_STRIPE = 16 << 20
DEFAULT_FILES_IN_FLIGHT = 64
DEFAULT_BIG_BUFFERS = 8
_POLL_MS = 100
_PROGRESS_EVERY = 0.25  # seconds between progress callbacks
_JOURNAL_EVERY = 1.0  # seconds between journal flushes (each costs a syncfs)

_FILE, _DIR, _LINK = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StageResult:
    """What stage() did."""

    path: Path
    """The staged file or tree."""
    files: int
    """Files in the staged set."""
    bytes: int
    """Bytes in the staged set."""
    seconds: float
    engine: str
    """The I/O backend that ran: ``"uring"`` or ``"pread"`` (``"none"`` when skipped)."""
    skipped: bool
    """True when a complete copy of the unchanged source was already there."""
    copied_files: int = 0
    """Files this call copied (fewer than ``files`` after a resume)."""
    copied_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What verify() found."""

    path: Path
    files: int
    bytes: int
    mismatched: list[str]
    """Files whose content (or size) differs from the manifest, relative to ``path``."""
    missing: list[str]
    """Files (or symlinks) of the manifest that are gone."""

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.missing


def available_engines() -> list[str]:
    """The I/O backends that work here, best first."""
    return ["uring", "pread"] if _core.uring_available() else ["pread"]


def _patterns(p: Patterns) -> list[str]:
    if p is None:
        return []
    if isinstance(p, (str, os.PathLike)):
        return [os.fspath(p)]
    return [os.fspath(x) for x in p]


def _fingerprint(src: str, entries: list[tuple[Any, ...]], options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([src, options], sort_keys=True).encode())
    for e in entries:
        h.update(repr(e).encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    return h.hexdigest()


@contextlib.contextmanager
def _named_os_errors(what: str = "") -> Iterator[None]:
    """Turns an OSError that the native core did not already name into a StageError that
    keeps errno and names the path (``what`` says what was being done)."""
    try:
        yield
    except StageError:
        raise
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO, f"{what}{e.strerror or e}: '{e.filename}'", e.filename
        ) from e


def _mkdir_parent(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO,
            f"cannot create destination directory '{path}': {e.strerror}",
            str(path),
        ) from None


def _check_space(dst_parent: Path, needed: int, target: Path) -> None:
    st = os.statvfs(dst_parent)
    free = st.f_bavail * st.f_frsize
    if needed > free:
        raise NotEnoughSpaceError(
            f"not enough space to stage into '{target}': need {_human(needed)}, "
            f"{_human(free)} free on its file system",
            path=str(target),
            needed=needed,
            free=free,
        )


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def _quick_same(path: Path, size: int, mtime_ns: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size and st.st_mtime_ns == mtime_ns


class _Bar:
    """A progress bar (tqdm) driven by the native counters."""

    def __init__(self, desc: str, total: int, initial: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total,
            initial=initial,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=desc,
            dynamic_ncols=True,
            smoothing=0.1,
        )

    def __call__(
        self, bytes_done: int, bytes_total: int, files_done: int, files_total: int
    ) -> None:
        self._bar.n = bytes_done
        self._bar.set_postfix_str(f"{files_done}/{files_total} files", refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


def _progress_callback(
    progress: Progress, desc: str, total: int, initial: int
) -> tuple[ProgressCallback | None, _Bar | None]:
    if progress is True:
        bar = _Bar(desc, total, initial)
        return bar, bar
    if callable(progress):
        return progress, None
    return None, None


def _run_job(
    job: Any,
    *,
    on_progress: ProgressCallback | None,
    base_bytes: int,
    base_files: int,
    total_bytes: int,
    total_files: int,
    on_done: Callable[[list[tuple[int, bytes]], bool], None],
) -> None:
    """Runs a started CopyJob to its end: progress, journal, Ctrl-C, errors."""
    last = 0.0

    def report() -> None:
        if on_progress is not None:
            on_progress(
                base_bytes + job.bytes_done, total_bytes, base_files + job.files_done, total_files
            )

    try:
        while not job.wait(_POLL_MS):
            now = time.monotonic()
            on_done(job.take_done(), False)
            if now - last >= _PROGRESS_EVERY:
                last = now
                report()
    except BaseException:
        # Ctrl-C (or an error in a callback): stop the native job, keep what finished.
        job.cancel()
        while not job.wait(_POLL_MS):
            pass
        on_done(job.take_done(), True)
        raise
    on_done(job.take_done(), True)
    job.rethrow()
    report()


def _job_kwargs(
    engine: str, workers: int | None, stripe_size: int, src: Path | None = None
) -> dict[str, Any]:
    files_in_flight = max(1, workers or DEFAULT_FILES_IN_FLIGHT)
    big = DEFAULT_BIG_BUFFERS
    return {
        "engine": resolve_engine(engine, src),
        "depth": 2 * files_in_flight + big + 8,
        "threads": min(max(4, files_in_flight // 2), 64),
        "files_in_flight": files_in_flight,
        "stripe_size": stripe_size,
        "big_buffers": big,
    }


def stage(
    src: PathLike,
    dst: PathLike,
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    engine: str = "auto",
    progress: Progress = None,
    workers: int | None = None,
    stripe_size: int | None = None,
    on_special: Literal["error", "skip"] = "error",
    check_source: bool = True,
    unpack: bool | Literal["auto", "nested"] = "auto",
    checksum: str | None = None,
    sync: bool = False,
) -> StageResult:
    """Copies a file or a directory tree to ``dst`` (node-local disk), fast and resumably,
    or extracts a tar archive (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.zst``) into ``dst``.

    A directory's contents land in ``dst`` (like ``cp -r src/. dst``). A file lands at
    ``dst``, or inside it if ``dst`` is an existing directory. An archive's members land
    in the directory ``dst``.

    Args:
        unpack: for a tar archive, ``"auto"``/``True`` extracts it in one streaming pass
            (``True`` also insists that ``src`` is one), ``"nested"`` also extracts
            members that are tars (``n01440764.tar`` -> ``dst/n01440764/...``) from the
            same stream, ``False`` copies the archive file as it is.
        checksum: ``"sha256:<hex>"`` or ``"md5:<hex>"`` of the archive (or file), checked
            in the same pass; a mismatch raises :class:`ChecksumMismatchError` and the
            output is not marked complete.
        include, exclude: glob patterns on paths relative to ``src`` (``*`` also matches
            ``/``; a pattern without ``/`` also matches the base name).
        engine: ``"auto"`` (io_uring, else a pool of pread threads), ``"uring"`` or
            ``"pread"``; ``FASTLOAD_ENGINE`` overrides ``"auto"``.
        progress: ``True`` for a progress bar, or ``cb(bytes_done, bytes_total,
            files_done, files_total)`` called a few times a second.
        workers: files in flight at once (default 64).
        stripe_size: bytes per stripe of a big file, and per digest chunk (default 16 MiB).
        on_special: what to do with devices, FIFOs, sockets and symlinks leaving the
            tree: ``"error"`` (default) or ``"skip"``.
        check_source: list the source again to see whether it changed since the last
            complete stage (default). ``False`` trusts a complete manifest for this source.
        sync: flush the staged data to disk before returning. By default ``stage()``
            returns once every file is whole in the page cache, as ``cp``, ``tar`` and
            ``rsync`` do, and the disk catches up while the job starts (a node's
            ``$SLURM_TMPDIR`` does not outlive the job anyway). The manifest records the
            boot: after a reboot (a power loss may have cut the writeback), the next
            ``stage()`` reads the files back and checks their digests before trusting
            them, and redoes only those that differ.

    Returns:
        A :class:`StageResult`; ``skipped`` is True when nothing had to be copied.

    Raises:
        FileNotFoundError: the source is missing (also a :class:`StageError`).
        NotEnoughSpaceError: the destination cannot hold the data (checked first).
        SourceChangedError: a file changed while it was copied.
        UnsupportedFileError: a special file or an escaping symlink, unless skipped.
        StageError: any other failure, naming the path; the destination stays resumable.
    """
    t0 = time.monotonic()
    if unpack not in (True, False, "auto", "nested"):
        raise ValueError(f"unpack must be True, False, 'auto' or 'nested', not {unpack!r}")
    algo_hex = parse_checksum(checksum)
    if on_special not in ("error", "skip"):
        raise ValueError(f"on_special must be 'error' or 'skip', not {on_special!r}")
    stripe = int(stripe_size or DEFAULT_STRIPE)
    if not 4096 <= stripe <= 1 << 30 or stripe % 4096:
        raise ValueError(
            f"stripe_size must be a multiple of 4096 between 4 KiB and 1 GiB, not {stripe}"
        )
    src_path = Path(os.fspath(src))
    dst_path = Path(os.fspath(dst))
    if not os.path.lexists(src_path):
        raise stage_error(errno.ENOENT, f"source '{src_path}' does not exist", str(src_path))
    src_abs = Path(os.path.realpath(src_path))
    is_file = src_abs.is_file()
    if not is_file and not src_abs.is_dir():
        raise stage_error(
            errno.EINVAL, f"source '{src_path}' is not a regular file or a directory", str(src_path)
        )
    compression = archive_compression(src_abs) if is_file and unpack is not False else None
    if unpack in (True, "nested") and compression is None:
        raise stage_error(
            errno.EINVAL,
            f"'{src_path}' is not a tar archive (.tar, .tar.gz, .tgz, .tar.zst); "
            "pass unpack=False to copy it as a file",
            str(src_path),
        )
    if not is_file and algo_hex is not None:
        raise ValueError("checksum= applies to a file or an archive, not to a directory")
    if is_file and compression is None and dst_path.is_dir():
        dst_path = dst_path / src_abs.name
    dst_abs = Path(os.path.abspath(dst_path))
    dst_real = Path(os.path.realpath(dst_abs.parent)) / dst_abs.name
    if dst_real == src_abs or src_abs in dst_real.parents:
        raise stage_error(
            errno.EINVAL,
            f"destination '{dst_path}' is inside the source '{src_path}'",
            str(dst_path),
        )
    if (not is_file or compression) and dst_abs.exists() and not dst_abs.is_dir():
        raise stage_error(
            errno.ENOTDIR, f"destination '{dst_path}' exists and is not a directory", str(dst_path)
        )
    _mkdir_parent(dst_abs.parent)
    options: dict[str, Any] = {
        "include": _patterns(include),
        "exclude": _patterns(exclude),
        "on_special": on_special,
        "file": is_file,
    }
    if compression is not None:
        options["unpack"] = "nested" if unpack == "nested" else True

    with _named_os_errors():
        return _stage_with_lock(
            src_abs,
            dst_abs,
            is_file,
            options,
            engine,
            progress,
            workers,
            stripe,
            check_source,
            t0,
            compression,
            algo_hex,
            sync,
        )


def _stage_with_lock(
    src_abs: Path,
    dst_abs: Path,
    is_file: bool,
    options: dict[str, Any],
    engine: str,
    progress: Progress,
    workers: int | None,
    stripe: int,
    check_source: bool,
    t0: float,
    compression: str | None,
    checksum: tuple[str, str] | None,
    sync: bool,
) -> StageResult:
    with node_lock(dst_abs):
        old = read_manifest(dst_abs)
        same_request = (
            old is not None
            and old.get("complete")
            and old.get("source") == str(src_abs)
            and old.get("options") == options
            and os.path.lexists(dst_abs)
            and trusted(old)
        )
        if same_request and not check_source:
            assert old is not None
            _make_durable(dst_abs, old, sync)
            return StageResult(
                dst_abs, old["files_count"], old["bytes"], time.monotonic() - t0, "none", True
            )
        if compression is not None:
            return _stage_archive_locked(
                src_abs,
                dst_abs,
                compression,
                options,
                old,
                engine,
                progress,
                workers,
                stripe,
                checksum,
                t0,
                sync,
            )
        result = _stage_locked(
            src_abs, dst_abs, is_file, options, old, engine, progress, workers, stripe, t0, sync
        )
        if checksum is not None:
            _check_file_checksum(result.path, src_abs, checksum)
        return result


def _check_file_checksum(copy: Path, src: Path, checksum: tuple[str, str]) -> None:
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


def _stage_archive_locked(
    src_abs: Path,
    dst_abs: Path,
    compression: str,
    options: dict[str, Any],
    old: dict[str, Any] | None,
    engine: str,
    progress: Progress,
    workers: int | None,
    stripe: int,
    checksum: tuple[str, str] | None,
    t0: float,
    sync: bool,
) -> StageResult:
    size = os.stat(src_abs).st_size
    on_progress, bar = _progress_callback(progress, f"extract {src_abs.name}", size, 0)
    try:
        r = stage_archive(
            src_abs,
            dst_abs,
            compression=compression,
            nested=options.get("unpack") == "nested",
            options=options,
            old=old,
            checksum=checksum,
            engine=engine,
            on_progress=on_progress,
            workers=workers,
            stripe=stripe,
            quick_same=_quick_same,
            check_space=_check_space,
            prove=lambda records: _prove(dst_abs, records, engine, workers, stripe),
            make_durable=lambda old: _make_durable(dst_abs, old, sync),
            sync=sync,
            t0=t0,
        )
    finally:
        if bar is not None:
            bar.close()
    return StageResult(
        dst_abs,
        r["files"],
        r["bytes"],
        time.monotonic() - t0,
        r["engine"],
        r["skipped"],
        r["copied_files"],
        r["copied_bytes"],
    )


def _stage_locked(
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
) -> StageResult:
    threads = min(64, max(8, (workers or DEFAULT_FILES_IN_FLIGHT)))
    if is_file:
        src_root, dst_root = src_abs.parent, dst_abs.parent
        tree = _core.stat_file(str(src_root), src_abs.name)
        entries = [(dst_abs.name, *e[1:]) for e in tree.entries()]
        src_names = [src_abs.name]
    else:
        src_root, dst_root = src_abs, dst_abs
        tree = _core.walk(
            str(src_abs),
            options["include"],
            options["exclude"],
            options["on_special"] == "skip",
            threads,
        )
        entries = tree.entries()
        src_names = [e[0] for e in entries if e[1] == _FILE]
    if options["include"] and not is_file:
        # With include patterns, keep only the directories leading to something taken.
        keep: set[str] = set()
        for e in entries:
            if e[1] != _DIR:
                parts = e[0].split("/")[:-1]
                keep.update("/".join(parts[: k + 1]) for k in range(len(parts)))
        entries = [e for e in entries if e[1] != _DIR or e[0] in keep]
    fingerprint = _fingerprint(str(src_abs), entries, {**options, "chunk": stripe})
    files = [e for e in entries if e[1] == _FILE]
    total_bytes = sum(e[2] for e in files)

    def prove(records: Records) -> Records:
        return _prove(dst_root, records, engine, workers, stripe)

    # Written on an earlier boot without a flush: only what reads back whole counts.
    old, whole = reread(dst_root, dst_abs, old, fingerprint, prove)
    if (
        whole
        and old is not None
        and old.get("complete")
        and old.get("fingerprint") == fingerprint
        and os.path.lexists(dst_abs)
    ):
        _make_durable(dst_abs, old, sync)
        return StageResult(dst_abs, len(files), total_bytes, time.monotonic() - t0, "none", True)

    # What is already in place: from the interrupted run's journal, or from the previous
    # complete manifest (a re-stage after the source changed copies only the changes).
    journal = Journal(dst_abs, stripe, durable=sync)
    known = known_records(journal, old, stripe, prove)
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
            and _quick_same(dst_root / path, size, mtime)
        ):
            done[path] = rec
        else:
            todo.append(i)
    # Files an interrupted run renamed into place but had not journalled yet: whole, as
    # long as the machine did not reboot since; their digests are read back locally.
    if journal.found and journal.same_boot and todo:
        rehash = [i for i in todo if _quick_same(dst_root / files[i][0], files[i][2], files[i][5])]
        if rehash:
            done.update(
                _digest_local(dst_root, [files[i] for i in rehash], engine, workers, stripe)
            )
            todo = [i for i in todo if files[i][0] not in done]
    done_bytes = sum(r[0] for r in done.values())

    # Files a previous stage put here that the source no longer has.
    if old is not None and old.get("complete"):
        wanted = {e[0] for e in entries}
        for p in old.get("files", {}):
            if p not in wanted:
                with contextlib.suppress(OSError):
                    (dst_root / p).unlink()

    st_parent = os.statvfs(dst_abs.parent)
    bsize = st_parent.f_frsize or 4096
    needed = 0
    for i in todo:
        size, blocks = files[i][2], files[i][3]
        alloc = min(size, blocks * 512) if blocks * 512 < size else size
        needed += -(-alloc // bsize) * bsize
    _check_space(dst_abs.parent, needed, dst_abs)

    # Directories first, writable for us; their own modes and times are set at the end.
    dirs = [e for e in entries if e[1] == _DIR]
    with _named_os_errors("cannot create directory: "):
        if not is_file:
            dst_abs.mkdir(exist_ok=True)
            _ensure_writable(dst_abs)
        for e in dirs:
            d = dst_root / e[0]
            d.mkdir(exist_ok=True)
            _ensure_writable(d)

    journal.open(done)
    on_progress, bar = _progress_callback(
        progress, f"stage {src_abs.name}", total_bytes, done_bytes
    )
    copied_files = copied_bytes = 0
    flusher = JournalFlusher(journal, str(dst_root), _JOURNAL_EVERY)
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
                **_job_kwargs(engine, workers, stripe, src_root),
            )
            job.start()
            engine_name = job.engine
            _run_job(
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
        _finish_tree(src_abs, dst_abs, dst_root, entries, is_file)
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
        "symlinks": {e[0]: e[6] for e in entries if e[1] == _LINK},
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


def _prove(
    root: Path,
    records: dict[str, tuple[int, int, int, str]],
    engine: str,
    workers: int | None,
    stripe: int,
) -> dict[str, tuple[int, int, int, str]]:
    """The records (path -> size, mtime_ns, mode, digests) whose files, read back from
    ``root``, still have their size, time and digests: what a manifest or journal written
    on an earlier boot without a flush may take as done."""
    entries = [
        (p, _FILE, r[0], (r[0] + 511) // 512, r[2], r[1])
        for p, r in records.items()
        if _quick_same(root / p, r[0], r[1])
    ]
    got = _digest_local(root, entries, engine, workers, stripe) if entries else {}
    return {p: records[p] for p, rec in got.items() if rec[3] == records[p][3]}


def _make_durable(dst: Path, manifest: dict[str, Any], sync: bool) -> None:
    """With ``sync``, flushes a complete stage that was not, and says so in its manifest."""
    if sync and not manifest.get("durable", True):
        root = dst.parent if manifest.get("kind") == "file" else dst
        _core.syncfs(str(root))
        write_json_atomic(state_dir(dst) / "manifest.json", {**manifest, "durable": True})


def _digest_local(
    root: Path, entries: list[tuple[Any, ...]], engine: str, workers: int | None, stripe: int
) -> dict[str, tuple[int, int, int, str]]:
    """Reads files already in the destination and returns their journal records."""
    job = _core.CopyJob(
        str(root),
        "",
        [e[0] for e in entries],
        None,
        [e[2] for e in entries],
        [e[3] for e in entries],
        [e[4] for e in entries],
        [e[5] for e in entries],
        **_job_kwargs(engine, workers, stripe),
    )
    out: dict[str, tuple[int, int, int, str]] = {}

    def on_done(batch: list[tuple[int, bytes]], final: bool) -> None:
        for idx, digests in batch:
            e = entries[idx]
            out[e[0]] = (e[2], e[5], e[4], digests.hex())

    job.start()
    _run_job(
        job,
        on_progress=None,
        base_bytes=0,
        base_files=0,
        total_bytes=0,
        total_files=0,
        on_done=on_done,
    )
    return out


def _ensure_writable(d: Path) -> None:
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise stage_error(errno.ENOTDIR, f"'{d}' exists and is not a directory", str(d))
    if st.st_mode & 0o700 != 0o700:
        os.chmod(d, stat.S_IMODE(st.st_mode) | 0o700)


def _finish_tree(
    src_abs: Path, dst_abs: Path, dst_root: Path, entries: list[tuple[Any, ...]], is_file: bool
) -> None:
    """Symlinks, then directory modes and times, deepest first (so setting a directory's
    time is not undone by creating something inside it)."""
    with _named_os_errors("cannot finish staging: "):
        for e in entries:
            if e[1] != _LINK:
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
            (e for e in entries if e[1] == _DIR), key=lambda e: e[0].count("/"), reverse=True
        )
        for e in dirs:
            d = dst_root / e[0]
            os.chmod(d, e[4])
            os.utime(d, ns=(e[5], e[5]))
        st = os.stat(src_abs)
        os.chmod(dst_abs, stat.S_IMODE(st.st_mode))
        os.utime(dst_abs, ns=(st.st_mtime_ns, st.st_mtime_ns))


def verify(
    dst: PathLike, *, engine: str = "auto", workers: int | None = None, progress: Progress = None
) -> VerifyResult:
    """Re-reads a staged file or tree and compares every chunk with its manifest.

    Returns a :class:`VerifyResult` naming every file that differs or is missing.
    Raises ``FileNotFoundError`` (a :class:`StageError`) when ``dst`` was never staged.
    """
    dst_abs = Path(os.path.abspath(os.fspath(dst)))
    manifest = read_manifest(dst_abs)
    if manifest is None or not manifest.get("complete"):
        raise stage_error(
            errno.ENOENT,
            f"'{dst}' has no fastload manifest: it was not staged "
            "by fastload, or its staging did not finish",
            str(dst),
        )
    root = dst_abs.parent if manifest["kind"] == "file" else dst_abs
    stripe = int(manifest["chunk_size"])
    mismatched: list[str] = []
    missing: list[str] = []
    names: list[str] = []
    expected: list[str] = []
    sizes: list[int] = []
    for p, (size, _mtime, _mode, digests) in manifest["files"].items():
        try:
            st = os.lstat(root / p)
        except FileNotFoundError:
            missing.append(p)
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            mismatched.append(p)
            continue
        names.append(p)
        expected.append(digests)
        sizes.append(size)
    for p, target in manifest.get("symlinks", {}).items():
        link = root / p
        if not os.path.lexists(link):
            missing.append(p)
        elif not os.path.islink(link) or os.readlink(link) != target:
            mismatched.append(p)
    total = sum(sizes)
    if names:
        job = _core.CopyJob(
            str(root),
            "",
            names,
            None,
            sizes,
            [(s + 511) // 512 for s in sizes],
            [0o644] * len(names),
            [0] * len(names),
            **_job_kwargs(engine, workers, stripe),
        )
        on_progress, bar = _progress_callback(progress, f"verify {dst_abs.name}", total, 0)

        def on_done(batch: list[tuple[int, bytes]], final: bool) -> None:
            for idx, digests in batch:
                if digests.hex() != expected[idx]:
                    mismatched.append(names[idx])

        job.start()
        try:
            _run_job(
                job,
                on_progress=on_progress,
                base_bytes=0,
                base_files=0,
                total_bytes=total,
                total_files=len(names),
                on_done=on_done,
            )
        finally:
            if bar is not None:
                bar.close()
    return VerifyResult(
        dst_abs, len(manifest["files"]), int(manifest["bytes"]), sorted(mismatched), sorted(missing)
    )
