"""Archive staging: stream a (compressed) tar, or a tar of tars, into a directory.

The archive is read once, in large positional reads kept in flight (a file by the
native extractor itself, through the I/O engine the engine rule gives its file system:
on a local disk what is not cached with O_DIRECT straight into its blocks, on a network
or FUSE one in stripes, many at once, so a striped file system serves them in parallel:
readers.NativeReader; else by a few Python threads), hashed on the way (on a thread of
its own) when a published checksum is given, and fed to the native extractor, which
decompresses on a thread of its own, decodes members as they arrive and writes them
with many writes in flight. Skipped members of an uncompressed archive are seeked over,
not read (unless a checksum needs them).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .. import _core
from .._util import selected
from ..errors import (
    ChecksumMismatchError,
    SourceChangedError,
    StageError,
    TarFormatError,
    stage_error,
)
from .destination import Destination, Manifest
from .engine import resolve_engine
from .job import PROGRESS_EVERY, in_flight, progress_callback
from .readers import BLOCK, ArchiveSource, NativeReader, PyDecoder
from .request import StageRequest
from .result import StageResult
from .state import JournalFlusher, Record, Records

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
    if not head:
        return None  # an empty file is no archive (GNU tar: "does not look like a tar archive")
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



def _say_left(e: BaseException, files: int, dst: Path, trusted: bool) -> None:
    """Adds to a failed extraction's message what it left in ``dst`` (no manifest: not
    a complete stage) and what the next stage into ``dst`` does with it."""
    if not files or not isinstance(e, (TarFormatError, StageError)):
        return
    if trusted:
        then = ("the next stage of this archive into it keeps those whose member is "
                "unchanged and extracts the rest")  # fmt: skip
    else:
        then = ("they are not trusted: the next stage of this archive into it extracts "
                "every member again, over them")  # fmt: skip
    note = (f"; {files} files extracted before the error are left in '{dst}' (no "
            f"manifest: not a complete stage); {then}")  # fmt: skip
    at = 1 if isinstance(e, StageError) and len(e.args) >= 2 else 0
    if len(e.args) > at and isinstance(e.args[at], str):
        e.args = (*e.args[:at], e.args[at] + note, *e.args[at + 1:])

class Archive:
    """A tar archive extracted into the destination as it is read (:class:`Source`):
    ``data`` gives its bytes (readers.LocalArchive, RemoteArchive, StreamArchive, or
    fan-out's exchange) and its name, the path or URL the manifest records."""

    def __init__(self, data: Any, compression: str, options: dict[str, Any]) -> None:
        self.data: ArchiveSource = data
        self.compression = compression
        self.name: str = data.name
        self.options = options
        self.label = Path(data.name).name

    def with_data(self, data: Any) -> Archive:
        """The same archive, its bytes from ``data`` (fan-out's exchange)."""
        return Archive(data, self.compression, self.options)

    def fingerprint(self, req: StageRequest) -> str:
        """Changes with the archive (its name, size and time or ETag) and the options."""
        options = {**self.options, "chunk": req.stripe, "checksum": req.checksum}
        h = hashlib.sha256()
        h.update(
            repr((*self.data.identity, sorted(options.items()))).encode(
                "utf-8", "surrogateescape"
            )
        )
        return h.hexdigest()

    def is_complete(self, req: StageRequest, dest: Destination) -> bool:
        """Whether ``dest`` holds this archive extracted (a stream is never known to be:
        nothing tells its content before it is read)."""
        return (
            not self.data.stream
            and dest.is_complete(self.fingerprint(req))
            and dest.path.is_dir()
        )

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        """Extracts the archive into ``dest`` (under its lock), with a progress bar or
        callback over the archive's bytes (0 where unknown)."""
        if self.is_complete(req, dest):
            assert dest.old is not None
            return dest.skipped(dest.old["files_count"], dest.old["bytes"])
        on_progress, bar = progress_callback(
            req.progress, f"extract {self.label}", self.data.size, 0
        )
        try:
            return _Extraction(self, req, dest, on_progress).run()
        finally:
            if bar is not None:
                bar.close()


class _TimedFeeds:
    """The extraction job, with the time spent in its ``feed*`` and ``finish`` calls
    summed (``seconds``, stage stats' write time of an archive: the extractor parsing
    the blocks and handing members to its writer threads, waiting for them when they
    lag behind); everything else passes through."""

    def __init__(self, job: Any) -> None:
        self._job, self.seconds = job, 0.0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._job, name)
        if name not in ("feed", "feed_block", "feed_mapped", "finish"):
            return fn

        def timed(*args: Any) -> Any:
            t0 = time.monotonic()
            try:
                return fn(*args)
            finally:
                self.seconds += time.monotonic() - t0

        return timed


class _Extraction:
    """One run of the native extractor over an archive's bytes, journalled."""

    def __init__(
        self,
        archive: Archive,
        req: StageRequest,
        dest: Destination,
        on_progress: Callable[[int, int, int, int], None] | None,
    ) -> None:
        self.archive, self.req, self.dest, self.on_progress = archive, req, dest, on_progress
        self.done: Records = dest.known()
        self.before = set(self.done)  # complete before this run (hard links included)
        self.reused: set[str] = set()
        self.seen: set[str] = set()
        self.written: set[str] = set()  # members this run wrote
        self.copied_files = self.copied_bytes = 0

    def _collect(self, job: Any, flusher: JournalFlusher) -> None:
        for line in job.take_warnings():
            log.warning("%s", line)
        self.reused.update(job.take_reused())
        batch = []
        for path, size, mode, mtime, digests, adopted in job.take_done():
            rec = Record(size, mtime, mode, digests.hex())
            self.done[path] = rec
            self.seen.add(path)
            batch.append((path, *rec))
            if not adopted:
                self.written.add(path)
                self.copied_files += 1
                self.copied_bytes += size
        flusher.add(batch)
        if self.dest.scheduler is not None and batch:  # in the background: readers wait
            self.dest.scheduler.extracted([b[0] for b in batch])

    def run(self) -> StageResult:
        archive, req, dest = self.archive, self.req, self.dest
        data, compression = archive.data, archive.compression
        # The archive's size bounds what an uncompressed one can hold; compressed data is
        # at least as large once extracted, so this check can only under-estimate.
        dest.check_space(max(0, data.size - sum(r.size for r in self.done.values())))
        try:
            dest.path.mkdir(exist_ok=True)
        except OSError as e:
            raise stage_error(
                e.errno or errno.EIO, f"cannot create '{dest.path}': {e.strerror}", str(dest.path)
            ) from None
        flusher = dest.begin(self.done)
        if dest.scheduler is not None:  # in the background: members come in archive order
            dest.scheduler.extracting(list(self.done), data.size)
        new_pydecomp = python_decompressor(compression)
        pydecomp = PyDecoder(new_pydecomp, compression, data.name) if new_pydecomp else None
        hasher = hashlib.new(req.checksum[0]) if req.checksum else None
        can_seek = compression == "none" and hasher is None and not data.stream
        flight = in_flight(req.workers, dest.path)
        journal = dest.journal
        resolve_engine(req.engine)  # a malformed FASTLOAD_ENGINE: a ValueError naming it
        options = _core.ExtractOptions(
            compression="none" if pydecomp else compression,
            nested=req.nested,
            include=list(req.include),
            exclude=list(req.exclude),
            complete={p: (r.size, r.mtime_ns) for p, r in self.done.items()},
            # The engine only writes the members (a prefetching thread reads the archive):
            # its rule looks at the destination, so an archive on NFS or Lustre is still
            # written through io_uring.
            engine=req.engine,
            engine_path=dest.path,
            threads=flight.threads,
            files_in_flight=flight.files,
            chunk_size=req.stripe,
            adopt_existing=journal.found and journal.same_boot,
            direct_write_min=data.direct_write_min(dest.path),
        )
        job = _core.ExtractJob(str(dest.path), data.name, options)
        feeds = _TimedFeeds(job)
        reader: Any = None
        try:
            reader = data.reader(job, hasher, can_seek, raw=pydecomp is None)
            self._feed(feeds, reader, pydecomp, can_seek, flusher)
        except BaseException as e:
            job.abort()
            with contextlib.suppress(Exception):
                self._collect(job, flusher)
            with contextlib.suppress(Exception):
                flusher.close()
            trusted = not (compression != "none" and isinstance(e, TarFormatError))
            if not trusted:
                # A corrupt compressed stream shows at the end of its gzip member or zstd
                # frame (their checksums), or earlier as a tar error: what was extracted
                # before may hold corrupt data, so a later run must not trust any of it.
                journal.remove()
            else:
                journal.close()
            _say_left(e, len(self.done), dest.path, trusted)
            raise
        finally:
            if reader is not None:
                reader.close()
            dest.add_time("reading", getattr(reader, "read_seconds", 0.0))
            dest.add_time("writing", feeds.seconds + getattr(reader, "feed_seconds", 0.0))
        self._check_source(hasher)
        journal.close()
        return self._commit(job)

    def _feed(
        self, job: Any, reader: Any, pydecomp: PyDecoder | None, can_seek: bool,
        flusher: JournalFlusher,
    ) -> None:  # fmt: skip
        size = self.archive.data.size
        already = len(self.done)
        last_report, last_fed = 0.0, 0

        def tick(fed: int) -> None:
            """Between blocks (and while a read is waited for): the journal, and
            progress over the archive's bytes read so far (what a Python decoder feeds
            the job is its output, larger), when they moved."""
            nonlocal last_report, last_fed
            self._collect(job, flusher)
            if self.dest.scheduler is not None:
                self.dest.scheduler.streamed(fed)
            now = time.monotonic()
            if (self.on_progress is not None and fed > last_fed
                    and now - last_report >= PROGRESS_EVERY):
                last_report, last_fed = now, fed
                self.on_progress(fed, size, already + self.copied_files, 0)

        if isinstance(reader, NativeReader):
            reader.run(tick)  # the whole archive, read and fed by the job, GIL released
        else:
            self._feed_blocks(job, reader, pydecomp, can_seek, tick)
        job.finish()
        self._collect(job, flusher)
        flusher.close()

    def _feed_blocks(
        self, job: Any, reader: Any, pydecomp: PyDecoder | None, can_seek: bool,
        tick: Callable[[int], None],
    ) -> None:  # fmt: skip
        """Feeds the blocks a Python reader yields (Prefetcher, MappedReader, ...)."""
        decode_pool = ThreadPoolExecutor(1, thread_name_prefix="fastload-decode")
        ready = b""
        try:
            for off, n, b, block in reader:
                if block is None:  # mapped
                    job.feed_mapped(off, n)
                elif pydecomp is not None:
                    # Block k decodes on a thread of its own while block k-1's output is
                    # parsed and written (both release the GIL), as the native decoder
                    # overlaps the parser; block k's buffer is reused once this iteration
                    # ends, so its decoding ends within it.
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
                tick(off + n)
            if ready:
                job.feed(ready)
            if pydecomp is not None:
                tail = pydecomp.finish()
                if tail:
                    job.feed(tail)
        finally:
            decode_pool.shutdown(wait=True)  # before the reader recycles the block it decodes

    def _check_source(self, hasher: Any) -> None:
        data, checksum, journal = self.archive.data, self.req.checksum, self.dest.journal
        if data.changed():
            journal.remove()
            raise SourceChangedError(
                errno.EIO,
                f"source file changed: '{data.name}' was modified while it was being "
                "extracted; stage again to pick up the new content",
            )
        if hasher is not None and checksum is not None and hasher.hexdigest() != checksum[1]:
            journal.remove()  # nothing extracted from a corrupt archive may be trusted later
            exc = ChecksumMismatchError(
                errno.EIO,
                f"checksum mismatch for '{data.name}': expected {checksum[0]}:{checksum[1]}, "
                f"got {checksum[0]}:{hasher.hexdigest()}; the extracted data is not marked "
                "complete",
            )
            exc.filename = data.name
            raise exc

    def _commit(self, job: Any) -> StageResult:
        archive, req, dest = self.archive, self.req, self.dest
        size = archive.data.size  # a stream's, known once read
        links = job.links()
        dirs = job.dirs()
        # A file whose path is now a directory was replaced by a later directory member
        # (a file is never written over a directory this run made).
        made = set(dirs)
        done = {p: r for p, r in self.done.items()
                if (p in self.reused or p in self.seen) and p not in made}
        if req.include and not req.allow_empty and not (done or links) and not any(
            selected(d, list(req.include), []) for d in dirs if d.strip("./")
        ):
            dest.journal.remove()
            for d in sorted(dirs, key=lambda d: d.count("/"), reverse=True):
                with contextlib.suppress(OSError):  # the empty folders of members left out
                    (dest.path / d).rmdir()
            raise req.nothing_selected(archive.name)
        for path, target, hard in links:
            if hard and target in done:
                done[path] = done[target]
                # Counted as the regular file it is: copied, unless it was already in place
                # and its target was not rewritten (the link is made again either way).
                if path not in self.before or target in self.written:
                    self.copied_files += 1
                    self.copied_bytes += done[path].size
        if self.on_progress is not None:
            self.on_progress(size, size, len(done), len(done))
        checksum = req.checksum
        manifest = Manifest(
            source=archive.data.name, options=archive.options,
            fingerprint=archive.fingerprint(req), kind="tree", chunk_size=req.stripe,
            durable=req.sync, engine=str(job.engine), files=done,
            symlinks={p: t for p, t, hard in links if not hard}, dirs=dirs,
            archive={
                "compression": archive.compression,
                "nested": req.nested,
                "size": size,
                "identity": str(archive.data.identity[2]),
                "checksum": f"{checksum[0]}:{checksum[1]}" if checksum else None,
            },
        )  # fmt: skip
        dest.commit(manifest)
        return dest.result(manifest, self.copied_files, self.copied_bytes)
