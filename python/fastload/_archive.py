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
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from typing_extensions import Buffer

from . import _core
from ._engine import network_fs, resolve_engine
from ._state import (
    MANIFEST_VERSION,
    Journal,
    JournalFlusher,
    Records,
    boot_id,
    known_records,
    reread,
    state_dir,
    write_json_atomic,
)
from .errors import ChecksumMismatchError, SourceChangedError, TarFormatError, stage_error

_BLOCK = 8 << 20
# Reads in flight. Uncached, what counts is the bytes in flight: 4 x 8 MiB read the 4 GB
# benchmark archive in 3.7-3.8 s on this VM's disk, 8 x 8 MiB in 2.1-2.2 s (as fast as
# O_DIRECT; more is no faster). Cached, the count makes no difference.
_PREFETCH = 8
# O_DIRECT reads need offsets, lengths and buffers aligned to the device's logical block
# (512 B or 4 KiB); the page covers both, and the job's read blocks are page-aligned.
_ALIGN = 4096
# Members at least this large are written O_DIRECT where the destination allows it.
_DIRECT_WRITE_MIN = 64 << 10
# An archive with this share of its bytes in the page cache counts as cached.
_CACHED_ENOUGH = 0.9
_SUFFIXES = {
    ".tar": "none",
    ".tar.gz": "gzip",
    ".tgz": "gzip",
    ".tar.zst": "zstd",
    ".tar.zstd": "zstd",
    ".tzst": "zstd",
}
_PROGRESS_EVERY = 0.25
_JOURNAL_EVERY = 1.0


def archive_compression(path: Path) -> str | None:
    """'none', 'gzip' or 'zstd' when ``path`` is a tar archive, by content, else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return None
    # Content first: a gzip stream named .tar is still a gzip stream. A compressed file
    # without a tar name (data.gz) is not taken for an archive.
    if head[:2] == b"\x1f\x8b":
        return "gzip" if _suffix_kind(path) is not None else None
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd" if _suffix_kind(path) is not None else None
    if len(head) == 512 and head[257:262] == b"ustar":
        return "none"
    if _suffix_kind(path) == "none" and (len(head) == 512 or not head.strip(b"\0")):
        return "none"  # a v7 tar, or an empty archive: let the parser judge
    return None


def _suffix_kind(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, kind in sorted(_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if name.endswith(suffix):
            return kind
    return None


def parse_checksum(checksum: str | None) -> tuple[str, str] | None:
    if checksum is None:
        return None
    algo, sep, hexdigest = checksum.partition(":")
    algo = algo.lower()
    if not sep or algo not in ("md5", "sha1", "sha256", "sha512") or not hexdigest:
        raise ValueError(f"checksum must look like 'sha256:<hex>' or 'md5:<hex>', not {checksum!r}")
    return algo, hexdigest.lower()


def _settle(fut: Future[Any]) -> None:
    """Cancels ``fut``, or waits for it if it already runs (its error is not ours to
    raise: the reader is being reset or closed)."""
    if not fut.cancel():
        with contextlib.suppress(Exception):
            fut.result()


class _Ahead:
    """What both archive readers share: work queued ``depth`` blocks ahead of the
    consumer, dropped (``_drain``) and queued again from a new offset on ``seek``."""

    _next: int

    def _fill(self) -> None:
        raise NotImplementedError

    def _drain(self) -> None:
        raise NotImplementedError

    def seek(self, offset: int) -> None:
        self._drain()
        self._next = offset
        self._fill()


class _Prefetcher(_Ahead):
    """Positional reads of a file, ``depth`` blocks in flight, delivered in order. Owns
    its descriptors: ``close()`` closes them.

    The blocks are the extraction job's own read blocks (``job.lend()``): the job writes
    members' data straight from them, so the data is copied by the read and by the
    write, never in between. A block is handed to the consumer as ``(offset, index,
    view)``; it is released to the job when the consumer asks for the next one, and the
    job reuses it once the writes from it are done.

    With ``hasher``, every block is also hashed, in order, on a thread of its own while
    the consumer works on it (hashlib releases the GIL): a published checksum costs no
    time on the thread that feeds the extraction.

    Where the file can also be opened ``O_DIRECT`` (:func:`_open_direct`), a block whose
    bytes are not all in the page cache is read that way: the disk writes straight into the
    block, with no copy through the page cache (CPU the extraction needs on a small
    node) and without filling the cache with an archive that is read once, which would
    push out the extracted files the job is about to read. Cached blocks are still
    copied out of the cache. Blocks start at aligned offsets (after a seek, one short
    block realigns them).
    """

    def __init__(
        self,
        path: Path,
        size: int,
        job: _core.ExtractJob,
        depth: int = _PREFETCH,
        hasher: Any = None,
    ):
        self._size, self._name, self._job = size, str(path), job
        self._block = job.block_size
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # before any read
        self._direct_fd = _open_direct(path) if self._block % _ALIGN == 0 else -1
        self._direct = self._direct_fd  # -1 once the file system refuses a direct read
        self.direct_reads = 0  # blocks read with O_DIRECT (for tests and reports)
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="fastload-read")
        self._hasher = hasher
        self._hash_pool = None
        if hasher is not None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="fastload-hash")
        self._hashing: Future[None] | None = None
        self._depth = depth
        self._queue: deque[tuple[int, int, int, memoryview, Future[int]]] = deque()
        self._next = 0
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    def _read(self, view: memoryview, n: int, off: int) -> int:
        if self._direct >= 0 and off % _ALIGN == 0:
            try:
                cached = _core.cached_bytes(self._fd, off, n) == n
            except OSError:
                cached = True  # cannot tell (mmap refused): read through the cache
            if not cached:
                return self._read_direct(view, n, off)
        got = 0
        while got < n:
            k = os.preadv(self._fd, [view[got:n]], off + got)
            if k == 0:
                break
            got += k
        return got

    def _read_direct(self, view: memoryview, n: int, off: int) -> int:
        """Reads [off, off + n) with O_DIRECT: whole aligned blocks (the last rounded up,
        which the block has room for; the file's end makes it short)."""
        want = -(-n // _ALIGN) * _ALIGN
        got = 0
        while got < n:
            try:
                k = os.preadv(self._direct, [view[got:want]], off + got)
            except OSError as e:
                if e.errno != errno.EINVAL or got:
                    raise
                # The file system refuses this alignment after all: buffered from here.
                self._direct = -1
                return self._read(view, n, off)
            got += k
            if k == 0 or got % _ALIGN:
                break  # the end of the file
        self.direct_reads += 1
        return min(got, n)

    def _fill(self) -> None:
        while len(self._queue) < self._depth and self._next < self._size:
            # Waits (reaping the job's writes) only when nothing else is being read.
            lent = self._job.lend(not self._queue)
            if lent is None:
                return
            b, buf = lent
            view = memoryview(buf)
            # After a seek to an unaligned offset, a short block up to the next aligned
            # one (read through the cache), so the blocks after it can be read direct.
            n = self._block if self._next % _ALIGN == 0 else _ALIGN - self._next % _ALIGN
            n = min(n, self._size - self._next)
            self._queue.append(
                (self._next, n, b, view, self._pool.submit(self._read, view, n, self._next))
            )
            self._next += n

    def __iter__(self) -> Iterator[tuple[int, int, int, memoryview]]:
        while self._queue:
            off, n, b, view, fut = self._queue.popleft()
            try:
                try:
                    got = fut.result()
                except OSError as e:
                    raise stage_error(
                        e.errno or errno.EIO, f"read '{self._name}': {e.strerror}", self._name
                    ) from None
                if got != n:
                    raise SourceChangedError(
                        errno.EIO,
                        f"source file changed: '{self._name}' is shorter than when "
                        "staging began; stage again to pick up the new content",
                    )
                self._fill()
                data = view[:n]
                if self._hash_pool is not None:
                    self._hashing = self._hash_pool.submit(self._hasher.update, data)
                yield off, n, b, data
                self._wait_hash()
            finally:
                self._job.release(b)  # the consumer and the hasher are done with it
            self._fill()

    def _wait_hash(self) -> None:
        hashing, self._hashing = self._hashing, None
        if hashing is not None:
            hashing.result()

    def _drain(self) -> None:
        for _, _, b, _, fut in self._queue:
            _settle(fut)  # still reading into the block: wait before giving it back
            self._job.release(b)
        self._queue.clear()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._wait_hash()  # still hashing a block the consumer gave up on
        self._drain()
        self._pool.shutdown(wait=True)
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=True)
        os.close(self._fd)
        if self._direct_fd >= 0:
            os.close(self._direct_fd)


class _MappedReader(_Ahead):
    """The archive mapped into the job (``ExtractJob.map_source``) instead of read: the
    job writes members straight from the mapping, so the bytes of a cached archive are
    copied once, by the buffered write, or not at all, by an O_DIRECT one (a read into a
    block copies them out of the cache first: on a small node, the CPU the extraction
    needs). Iterates like :class:`_Prefetcher`, yielding ``(offset, n, -1, None)``: the
    consumer feeds ``job.feed_mapped(offset, n)``.

    A thread of its own maps ``depth`` blocks ahead in (``job.populate``), so the
    consumer takes no page faults, and reads what is not cached. A file found shorter
    than when mapped raises SourceChangedError, here or from the job."""

    def __init__(self, path: Path, size: int, job: _core.ExtractJob, depth: int = _PREFETCH):
        self._size, self._job, self._depth = size, job, depth
        self._block = job.block_size
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            job.map_source(fd, size)
        finally:
            os.close(fd)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastload-map")
        self._queue: deque[tuple[int, int, Future[None]]] = deque()
        self._next = 0
        self._fill()

    def _fill(self) -> None:
        while len(self._queue) < self._depth and self._next < self._size:
            n = min(self._block, self._size - self._next)
            populated = self._pool.submit(self._job.populate, self._next, n)
            self._queue.append((self._next, n, populated))
            self._next += n

    def __iter__(self) -> Iterator[tuple[int, int, int, memoryview | None]]:
        while self._queue:
            off, n, fut = self._queue.popleft()
            fut.result()
            self._fill()
            yield off, n, -1, None

    def _drain(self) -> None:
        for _, _, fut in self._queue:
            _settle(fut)
        self._queue.clear()

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)


def _mapped_reads(src: Path, cached: float) -> bool:
    """Whether to map the (uncompressed) archive rather than read it: when it is in the
    page cache (``cached``: the share of its bytes), on a local file system. An archive
    that must come from the disk is better read O_DIRECT (:class:`_Prefetcher`), which
    does not fill the cache with it. ``FASTLOAD_MAPPED_READS`` overrides: ``0`` never,
    ``1`` always."""
    value = os.environ.get("FASTLOAD_MAPPED_READS", "").strip()
    if value in ("0", "1"):
        return value == "1"
    return network_fs(src) is False and cached >= _CACHED_ENOUGH


def _cached_share(src: Path, size: int) -> float:
    """The share of ``src``'s bytes in the page cache (0 when it cannot tell)."""
    if not size:
        return 0.0
    try:
        fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _core.cached_bytes(fd, 0, size) / size
        finally:
            os.close(fd)
    except OSError:
        return 0.0


def _open_direct(src: Path) -> int:
    """``src`` opened for O_DIRECT reads, or -1 where they are not used: on network and
    FUSE file systems (where O_DIRECT bypasses the client's cache and read-ahead, or is
    refused), where the file system refuses it, or with ``FASTLOAD_DIRECT_READS=0``."""
    if os.environ.get("FASTLOAD_DIRECT_READS", "1") == "0" or not hasattr(os, "O_DIRECT"):
        return -1
    if network_fs(src) is not False:
        return -1
    try:
        return os.open(src, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1


def _direct_write_min(src: Path, dst: Path, cached: float) -> int:
    """The smallest member the extractor writes O_DIRECT (0: none).

    Direct writes go to the disk as the members arrive, where buffered writes return
    once the data is in the page cache and leave its writeback for later. They pay when
    the archive is read without touching the destination's disk: from another device
    (network storage, another disk, tmpfs) or from the page cache. Then the disk is
    otherwise idle, nothing is left to write back, and the copy into the cache is saved
    (on this machine: 3.9 vs 4.2 s to return, 4.4 vs 5.2 s to disk, from tmpfs). An
    archive read from the same disk, uncached, would have the writes compete with its
    reads: they go through the cache (5.4 vs 3.6 s to return here).

    ``FASTLOAD_DIRECT_WRITES`` overrides: ``0`` never, ``1`` always, a number of bytes
    always, from members that large (the default threshold is 64 KiB)."""
    value = os.environ.get("FASTLOAD_DIRECT_WRITES", "").strip()
    if value == "1":
        return _DIRECT_WRITE_MIN
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            pass
    try:
        if os.stat(src).st_dev != os.stat(dst).st_dev:
            return _DIRECT_WRITE_MIN
    except OSError:
        return 0
    return _DIRECT_WRITE_MIN if cached >= _CACHED_ENOUGH else 0


def _python_decompressor(compression: str) -> Callable[[], Any] | None:
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


class _PyDecoder:
    """Decodes with Python decompression objects (zlib's interface) as the native decoder
    does: across concatenated gzip members or zstd frames (one object each), skipping
    zero padding after a gzip member; a corrupt stream, or one that ends inside a member
    or frame, is a TarFormatError naming the archive."""

    def __init__(self, new: Callable[[], Any], kind: str, src: Path) -> None:
        self._new, self._kind, self._src = new, kind, src
        self._d = new()
        self._ended = False  # after a member's end, before the next one starts

    def _corrupt(self, what: str) -> TarFormatError:
        exc = TarFormatError(f"decompress '{self._src}': {what}")
        exc.path = str(self._src)  # type: ignore[attr-defined]
        return exc

    def decode(self, data: Buffer) -> bytes:
        out = []
        try:
            while True:
                if self._ended:
                    if self._kind == "gzip":
                        data = bytes(data).lstrip(b"\0")  # padding (or the next member)
                    if not len(memoryview(data)):
                        break
                    self._d = self._new()
                    self._ended = False
                out.append(self._d.decompress(data))
                # Objects without eof (old zstandard) decode one frame, as they always did.
                if not getattr(self._d, "eof", False):
                    break
                self._ended = True
                data = self._d.unused_data
        except Exception as e:  # zlib.error, zstandard.ZstdError
            raise self._corrupt(f"corrupt {self._kind} data ({e})") from None
        return b"".join(out)

    def finish(self) -> bytes:
        """The rest of the output, once the input has ended."""
        if self._ended:
            return b""
        flush = getattr(self._d, "flush", None)
        tail: bytes = flush() if flush is not None else b""
        if hasattr(self._d, "eof") and not self._d.eof:
            raise self._corrupt(f"truncated {self._kind} stream")
        return tail


def archive_fingerprint(src: Path, st: os.stat_result, options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(
        repr((str(src), st.st_size, st.st_mtime_ns, sorted(options.items()))).encode(
            "utf-8", "surrogateescape"
        )
    )
    return h.hexdigest()


def stage_archive(
    src: Path,
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
    quick_same: Callable[[Path, int, int], bool],
    check_space: Callable[[Path, int, Path], None],
    prove: Callable[[Records], Records],
    make_durable: Callable[[dict[str, Any]], None],
    sync: bool,
    t0: float,
) -> dict[str, Any]:
    """Extracts ``src`` into ``dst`` (under the node lock). Returns the summary the
    caller turns into a StageResult. ``prove`` reads records' files (in ``dst``) back and
    keeps those still whole (for a manifest or journal of an earlier boot that was not
    flushed); ``make_durable`` flushes a complete stage that was not, with ``sync``."""
    st = os.stat(src)
    fingerprint = archive_fingerprint(src, st, {**options, "chunk": stripe, "checksum": checksum})
    # Written on an earlier boot without a flush: only what reads back whole counts.
    old, whole = reread(dst, dst, old, fingerprint, prove)
    if (
        whole
        and old is not None
        and old.get("complete")
        and old.get("fingerprint") == fingerprint
        and dst.is_dir()
    ):
        make_durable(old)
        return {
            "skipped": True,
            "files": old["files_count"],
            "bytes": old["bytes"],
            "engine": "none",
            "copied_files": 0,
            "copied_bytes": 0,
        }

    journal = Journal(dst, stripe, durable=sync)
    known = known_records(journal, old, stripe, prove)
    done: dict[str, tuple[int, int, int, str]] = {
        p: rec for p, rec in known.items() if quick_same(dst / p, rec[0], rec[1])
    }
    # The archive's size bounds what an uncompressed one can hold; compressed data is
    # at least as large once extracted, so this check can only under-estimate.
    check_space(dst.parent, max(0, st.st_size - sum(r[0] for r in done.values())), dst)
    try:
        dst.mkdir(exist_ok=True)
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO, f"cannot create '{dst}': {e.strerror}", str(dst)
        ) from None
    journal.open(done)

    new_pydecomp = _python_decompressor(compression)
    pydecomp = _PyDecoder(new_pydecomp, compression, src) if new_pydecomp else None
    hasher = hashlib.new(checksum[0]) if checksum else None
    can_seek = compression == "none" and hasher is None
    cached = _cached_share(src, st.st_size)
    files_in_flight = max(1, workers or 64)
    job = _core.ExtractJob(
        str(dst),
        str(src),
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
        direct_write_min=_direct_write_min(src, dst, cached),
    )
    already = len(done)
    reused: set[str] = set()
    seen: set[str] = set()
    copied = {"files": 0, "bytes": 0}
    flusher = JournalFlusher(journal, str(dst), _JOURNAL_EVERY)

    def collect(final: bool) -> None:
        reused.update(job.take_reused())
        batch = []
        for path, size, mode, mtime, digests, adopted in job.take_done():
            rec = (size, mtime, mode, digests.hex())
            done[path] = rec
            seen.add(path)
            batch.append((path, *rec))
            if not adopted:
                copied["files"] += 1
                copied["bytes"] += size
        flusher.add(batch)

    reader: _Prefetcher | _MappedReader | None = None
    if can_seek and _mapped_reads(src, cached):
        with contextlib.suppress(OSError):  # a file system that cannot map it: read it
            reader = _MappedReader(src, st.st_size, job)
    if reader is None:
        reader = _Prefetcher(src, st.st_size, job, hasher=hasher)
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
                if skip >= _BLOCK:
                    job.skipped(skip)
                    reader.seek(off + n + skip)
            collect(False)
            now = time.monotonic()
            if on_progress is not None and now - last_report >= _PROGRESS_EVERY:
                last_report = now
                # Bytes of the archive read so far (what a Python decoder feeds the job
                # is its output, larger than the archive).
                on_progress(off + n, st.st_size, already + copied["files"], 0)
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
    st2 = os.stat(src)
    if (st2.st_size, st2.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
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
        exc.filename = str(src)
        raise exc
    journal.close()

    done = {p: r for p, r in done.items() if p in reused or p in seen}
    links = job.links()
    for path, target, hard in links:
        if hard and target in done:
            done[path] = done[target]
    total_bytes = sum(r[0] for r in done.values())
    if on_progress is not None:
        on_progress(st.st_size, st.st_size, len(done), len(done))
    if sync:
        _core.syncfs(str(dst))
    manifest = {
        "version": MANIFEST_VERSION,
        "complete": True,
        "source": str(src),
        "options": options,
        "fingerprint": fingerprint,
        "kind": "tree",
        "archive": {
            "compression": compression,
            "nested": nested,
            "size": st.st_size,
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
