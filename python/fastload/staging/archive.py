"""Archive staging: stream a (compressed) tar, or a tar of tars, into a directory.

The archive is read once, in large positional reads kept in flight by a few threads
(on a striped network file system each is served in parallel; on a local disk, what is
not cached is read with O_DIRECT straight into the extractor's blocks), hashed on the
way (on a thread of its own) when a published checksum is given, and fed to the native
extractor, which decompresses on a thread of its own, decodes members as they arrive
and writes them with many writes in flight. Skipped members of an uncompressed archive
are seeked over, not read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .. import _core
from .._util import node_lock, write_json_atomic
from ..errors import ChecksumMismatchError, SourceChangedError, TarFormatError, stage_error
from .engine import resolve_engine
from .job import JOURNAL_EVERY, PROGRESS_EVERY, Progress, progress_callback, prove, say_waiting
from .readers import BLOCK, ArchiveSource, PyDecoder, StreamArchive
from .result import StageResult
from .state import (
    MANIFEST_VERSION,
    Journal,
    JournalFlusher,
    Records,
    boot_id,
    check_space,
    known_records,
    make_durable,
    mkdir_parent,
    named_os_errors,
    previous_stage,
    quick_same,
    reread,
    state_dir,
)

# Where GNU tar warns and goes on (a lone zero block, trailing garbage, an unknown type
# extracted as a file, ...), a warning on this logger names the archive and the offset or
# member; with logging unconfigured, Python prints it on stderr, as tar does.
log = logging.getLogger(__name__)

SUFFIXES = {
    ".tar": "none",
    ".tar.gz": "gzip",
    ".tgz": "gzip",
    ".tar.zst": "zstd",
    ".tar.zstd": "zstd",
    ".tzst": "zstd",
}


def archive_compression(path: Path) -> str | None:
    """'none', 'gzip' or 'zstd' when ``path`` is a tar archive, by content, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    return detect_compression(head, path.name)


def detect_compression(head: bytes, name: str) -> str | None:
    """'none', 'gzip' or 'zstd' when a file named ``name`` starting with ``head`` (its
    first 512 bytes) is a tar archive, else None."""
    # Content first: a gzip stream named .tar is still a gzip stream. A compressed file
    # without a tar name (data.gz) is not taken for an archive.
    kind = suffix_kind(name)
    if head[:2] == b"\x1f\x8b":
        return "gzip" if kind is not None else None
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd" if kind is not None else None
    if len(head) == 512 and head[257:262] == b"ustar":
        return "none"
    if kind == "none" and (len(head) == 512 or not head.strip(b"\0")):
        return "none"  # a v7 tar, or an empty archive: let the parser judge
    return None


def suffix_kind(name: str | Path) -> str | None:
    """The compression a file's name promises ('none' for .tar), or None."""
    low = (name.name if isinstance(name, Path) else name).lower()
    for suffix, kind in sorted(SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if low.endswith(suffix):
            return kind
    return None


def not_an_archive(where: str, name: str, head: bytes) -> OSError:
    """The error for a file whose name says tar archive and whose content does not (an
    HTML error page saved as data.tar.gz, a truncated download)."""
    kind = suffix_kind(name)
    what = "a tar archive" if kind == "none" else f"a {kind}-compressed tar archive"
    start = head[:16]
    looks = "empty" if not head else f"it starts with {start!r}"
    if head.lstrip()[:1] == b"<":
        looks += " (an HTML or XML page?)"
    return stage_error(
        errno.EINVAL,
        f"'{where}' is named like {what} but is not one: {looks}; pass unpack=False "
        "to copy it as a file",
        where,
    )


def python_decompressor(compression: str) -> Callable[[], Any] | None:
    """A faster (isal) or a fallback (zstandard) decoder run in Python, if one is needed:
    what makes its decompression object."""
    if compression == "gzip":
        try:
            from isal import isal_zlib  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            return None  # zlib in the native core
        return lambda: isal_zlib.decompressobj(wbits=31)
    if compression == "zstd" and not _core.zstd_available():
        try:
            import zstandard  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            raise stage_error(
                errno.ENOSYS,
                "cannot read .tar.zst archives here: neither libzstd.so.1 nor "
                "the 'zstandard' package is installed (pip install zstandard)",
            ) from None
        return lambda: zstandard.ZstdDecompressor().decompressobj()
    return None


def archive_fingerprint(identity: tuple[str, int, Any], options: dict[str, Any]) -> str:
    """Changes with the archive (its name, size and time or ETag) and the options."""
    h = hashlib.sha256()
    h.update(
        repr((*identity, sorted(options.items()))).encode(
            "utf-8", "surrogateescape"
        )
    )
    return h.hexdigest()


def extract(
    source: ArchiveSource,
    dst: Path,
    *,
    label: str,
    total: int,
    compression: str,
    nested: bool,
    options: dict[str, Any],
    old: dict[str, Any] | None,
    checksum: tuple[str, str] | None,
    engine: str,
    progress: Any,
    workers: int | None,
    stripe: int,
    sync: bool,
    t0: float,
) -> StageResult:
    """:func:`stage_archive` with a progress bar (``label``, ``total`` bytes of the
    archive, 0 where unknown) or callback, as a StageResult (under the node lock)."""
    on_progress, bar = progress_callback(progress, label, total, 0)
    try:
        r = stage_archive(
            source, dst, compression=compression, nested=nested, options=options, old=old,
            checksum=checksum, engine=engine, on_progress=on_progress, workers=workers,
            stripe=stripe, sync=sync, t0=t0,
        )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    return StageResult(
        dst, r["files"], r["bytes"], time.monotonic() - t0, r["engine"], r["skipped"],
        r["copied_files"], r["copied_bytes"],
    )  # fmt: skip


def stage_archive(
    source: ArchiveSource,
    dst: Path,
    *,
    compression: str,
    nested: bool,
    options: dict[str, Any],
    old: dict[str, Any] | None,
    checksum: tuple[str, str] | None,
    engine: str,
    on_progress: Callable[[int, int, int, int], None] | None,
    workers: int | None,
    stripe: int,
    sync: bool,
    t0: float,
) -> dict[str, Any]:
    """Extracts the archive ``source`` (a file, or an object in a store) into ``dst``
    (under the node lock). Returns the summary the caller turns into a StageResult."""

    def proven(records: Records) -> Records:
        return prove(dst, records, engine, workers, stripe)

    src, size = source.name, source.size
    fingerprint = archive_fingerprint(
        source.identity, {**options, "chunk": stripe, "checksum": checksum}
    )
    # Written on an earlier boot without a flush: only what reads back whole counts.
    old, whole = reread(dst, dst, old, fingerprint, proven)
    if (
        whole
        and not source.stream  # nothing tells a stream's content before it is read
        and old is not None
        and old.get("complete")
        and old.get("fingerprint") == fingerprint
        and dst.is_dir()
    ):
        make_durable(dst, old, sync)
        return {
            "skipped": True,
            "files": old["files_count"],
            "bytes": old["bytes"],
            "engine": "none",
            "copied_files": 0,
            "copied_bytes": 0,
        }

    journal = Journal(dst, stripe, durable=sync)
    known = known_records(journal, old, stripe, proven)
    done: dict[str, tuple[int, int, int, str]] = {
        p: rec for p, rec in known.items() if quick_same(dst / p, rec[0], rec[1])
    }
    # The archive's size bounds what an uncompressed one can hold; compressed data is
    # at least as large once extracted, so this check can only under-estimate.
    check_space(dst.parent, max(0, size - sum(r[0] for r in done.values())), dst)
    try:
        dst.mkdir(exist_ok=True)
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO, f"cannot create '{dst}': {e.strerror}", str(dst)
        ) from None
    journal.open(done)

    new_pydecomp = python_decompressor(compression)
    pydecomp = PyDecoder(new_pydecomp, compression, src) if new_pydecomp else None
    hasher = hashlib.new(checksum[0]) if checksum else None
    can_seek = compression == "none" and hasher is None and not source.stream
    files_in_flight = max(1, workers or 64)
    job = _core.ExtractJob(
        str(dst),
        src,
        "none" if pydecomp else compression,
        nested,
        options["include"],
        options["exclude"],
        {p: (r[0], r[1]) for p, r in done.items()},
        # The engine only writes the members (a prefetching thread reads the archive):
        # chosen for the destination, so an archive on NFS or Lustre is still written
        # through io_uring.
        resolve_engine(engine, dst),
        min(64, max(4, files_in_flight // 2)),
        files_in_flight,
        stripe,
        journal.found and journal.same_boot,
        direct_write_min=source.direct_write_min(dst),
    )
    already = len(done)
    before = set(done)  # complete before this run (hard links included, as recorded)
    reused: set[str] = set()
    seen: set[str] = set()
    written: set[str] = set()  # members this run wrote
    copied = {"files": 0, "bytes": 0}
    flusher = JournalFlusher(journal, str(dst), JOURNAL_EVERY)

    def collect(final: bool) -> None:
        for line in job.take_warnings():
            log.warning("%s", line)
        reused.update(job.take_reused())
        batch = []
        for path, size, mode, mtime, digests, adopted in job.take_done():
            rec = (size, mtime, mode, digests.hex())
            done[path] = rec
            seen.add(path)
            batch.append((path, *rec))
            if not adopted:
                written.add(path)
                copied["files"] += 1
                copied["bytes"] += size
        flusher.add(batch)

    reader = source.reader(job, hasher, can_seek)
    decode_pool = ThreadPoolExecutor(1, thread_name_prefix="fastload-decode")
    ready = b""
    last_report = 0.0
    try:
        for off, n, b, block in reader:
            if block is None:  # mapped
                job.feed_mapped(off, n)
            elif pydecomp is not None:
                # Block k decodes on a thread of its own while block k-1's output is parsed
                # and written (both release the GIL), as the native decoder overlaps the
                # parser; block k's buffer is reused once this iteration ends, so its
                # decoding ends within it.
                decoding = decode_pool.submit(pydecomp.decode, block)
                if ready:
                    job.feed(ready)
                ready = decoding.result()
            else:
                job.feed_block(b, n)
            if can_seek:
                skip = job.skippable()
                if skip >= BLOCK:
                    job.skipped(skip)
                    reader.seek(off + n + skip)
            collect(False)
            now = time.monotonic()
            if on_progress is not None and now - last_report >= PROGRESS_EVERY:
                last_report = now
                # Bytes of the archive read so far (what a Python decoder feeds the job
                # is its output, larger than the archive).
                on_progress(off + n, size, already + copied["files"], 0)
        if ready:
            job.feed(ready)
        if pydecomp is not None:
            tail = pydecomp.finish()
            if tail:
                job.feed(tail)
        job.finish()
        collect(True)
        flusher.close()
    except BaseException as e:
        job.abort()
        with contextlib.suppress(Exception):
            collect(True)
        with contextlib.suppress(Exception):
            flusher.close()
        if compression != "none" and isinstance(e, TarFormatError):
            # A corrupt compressed stream shows at the end of its gzip member or zstd frame
            # (their checksums), or earlier as a tar error: what was extracted before may
            # hold corrupt data, so a later run must not trust (or adopt) any of it.
            journal.remove()
        else:
            journal.close()
        raise
    finally:
        decode_pool.shutdown(wait=True)  # before the reader recycles the block it decodes
        reader.close()
    size = max(size, source.size)  # a stream's, known once read
    if source.changed():
        journal.remove()
        raise SourceChangedError(
            errno.EIO,
            f"source file changed: '{src}' was modified while it was being "
            "extracted; stage again to pick up the new content",
        )
    if hasher is not None and hasher.hexdigest() != checksum[1]:  # type: ignore[index]
        journal.remove()  # nothing extracted from a corrupt archive may be trusted later
        exc = ChecksumMismatchError(
            errno.EIO,
            f"checksum mismatch for '{src}': expected {checksum[0]}:{checksum[1]}, "  # type: ignore[index]
            f"got {checksum[0]}:{hasher.hexdigest()}; the extracted data is not marked "  # type: ignore[index]
            "complete",
        )
        exc.filename = src
        raise exc
    journal.close()

    done = {p: r for p, r in done.items() if p in reused or p in seen}
    links = job.links()
    for path, target, hard in links:
        if hard and target in done:
            done[path] = done[target]
            # Counted as the regular file it is: copied, unless it was already in place
            # and its target was not rewritten (the link is made again either way).
            if path not in before or target in written:
                copied["files"] += 1
                copied["bytes"] += done[path][0]
    total_bytes = sum(r[0] for r in done.values())
    if on_progress is not None:
        on_progress(size, size, len(done), len(done))
    if sync:
        _core.syncfs(str(dst))
    manifest = {
        "version": MANIFEST_VERSION,
        "complete": True,
        "source": src,
        "options": options,
        "fingerprint": fingerprint,
        "kind": "tree",
        "archive": {
            "compression": compression,
            "nested": nested,
            "size": size,
            "identity": str(source.identity[2]),
            "checksum": f"{checksum[0]}:{checksum[1]}" if checksum else None,
        },
        "chunk_size": stripe,
        "digest": "fl64",
        "boot_id": boot_id(),
        "durable": sync,
        "files_count": len(done),
        "bytes": total_bytes,
        "engine": job.engine,
        "created": time.time(),
        "files": {p: list(done[p]) for p in sorted(done)},
        "symlinks": {p: t for p, t, hard in links if not hard},
        "dirs": job.dirs(),
    }
    write_json_atomic(state_dir(dst) / "manifest.json", manifest)
    journal.remove()
    return {
        "skipped": False,
        "files": len(done),
        "bytes": total_bytes,
        "engine": job.engine,
        "copied_files": copied["files"],
        "copied_bytes": copied["bytes"],
    }



# Compressed formats a stream may be in that are not read here, by magic bytes.
_OTHER_MAGIC = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x04\x22\x4d\x18": "lz4"}


def is_stream(src: object) -> bool:
    """Whether stage()'s ``src`` is a stream: ``"-"`` (stdin), a file descriptor, or a
    binary file object."""
    return (
        (isinstance(src, str) and src == "-")
        or (isinstance(src, int) and not isinstance(src, bool))
        or callable(getattr(src, "readinto", None))
        or callable(getattr(src, "read", None))
    )


def stream_compression(head: bytes, name: str) -> str:
    """'gzip', 'zstd' or 'none' for a stream starting with ``head``, by its magic bytes
    alone (a stream has no file name); the tar parser judges what is not compressed."""
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd"
    for magic, kind in _OTHER_MAGIC.items():
        if head.startswith(magic):
            raise stage_error(
                errno.EINVAL,
                f"'{name}' is {kind}-compressed: only gzip and zstd streams are read; "
                f"decompress it first (... | {kind} -dc | fastload stage - DST)",
                name,
            )
    return "none"


def stage_stream(
    src: object,
    dst: str | os.PathLike[str],
    *,
    include: list[str],
    exclude: list[str],
    engine: str,
    progress: Progress,
    workers: int | None,
    stripe: int,
    unpack: object,
    checksum: tuple[str, str] | None,
    sync: bool,
    t0: float,
) -> StageResult:
    """stage() of a tar stream (:class:`StreamArchive`): stdin, a pipe, a file object;
    plain, gzip or zstd by its first bytes; read once, in order, never seeked."""
    if unpack is False:
        raise stage_error(
            errno.EINVAL,
            "a stream can only be extracted as a tar archive: unpack=False needs a file",
        )
    dst_abs = Path(os.path.abspath(os.fspath(dst)))
    if dst_abs.exists() and not dst_abs.is_dir():
        raise stage_error(
            errno.ENOTDIR, f"destination '{dst}' exists and is not a directory", str(dst)
        )
    mkdir_parent(dst_abs.parent)
    with named_os_errors():
        source = StreamArchive(src)
        if not source.head:
            # GNU tar refuses it too: a download that failed (curl -f ... |) gives an
            # empty stream, which must not pass for an empty archive.
            raise stage_error(
                errno.EINVAL,
                f"'{source.name}' is empty: no tar archive came through it",
                source.name,
            )
        compression = stream_compression(source.head, source.name)
        options: dict[str, Any] = {
            "include": include,
            "exclude": exclude,
            "file": True,
            "stream": True,
            "unpack": "nested" if unpack == "nested" else True,
        }
        with node_lock(dst_abs, on_wait=say_waiting if progress else None):
            old = previous_stage(dst_abs)
            return extract(
                source, dst_abs, label=f"extract {source.name}", total=0,
                compression=compression, nested=unpack == "nested", options=options, old=old,
                checksum=checksum, engine=engine, progress=progress, workers=workers,
                stripe=stripe, sync=sync, t0=t0,
            )  # fmt: skip
