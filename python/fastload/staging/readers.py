"""How an archive's bytes reach the extractor: read ahead in large positional reads
(O_DIRECT for what is not cached), mapped when it is cached, or decoded in Python (isal,
zstandard) when that is faster than the native decoder; and whether members are written
O_DIRECT.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Union

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..sources.objstore import ObjectInfo, ObjectStore
    from .stream import StreamArchive

from .. import _core
from ..errors import SourceChangedError, StageError, TarFormatError, stage_error
from .engine import network_fs

BLOCK = 8 << 20


# Reads in flight. Uncached, what counts is the bytes in flight: 4 x 8 MiB read the 4 GB
# benchmark archive in 3.7-3.8 s on this VM's disk, 8 x 8 MiB in 2.1-2.2 s (as fast as
# O_DIRECT; more is no faster). Cached, the count makes no difference.
_PREFETCH = 8
# On a network or FUSE file system the job reads an archive's blocks in stripes of this
# size, all in flight (8 blocks: 64 reads, a pread thread waiting for each).
_NET_STRIPE = 1 << 20
# Ranged GETs in flight for an archive in an object store (8 MiB each).
_REMOTE_PREFETCH = 8


# O_DIRECT reads need offsets, lengths and buffers aligned to the device's logical block
# (512 B or 4 KiB); the page covers both, and the job's read blocks are page-aligned.
_ALIGN = 4096


# Members at least this large are written O_DIRECT where the destination allows it.
_DIRECT_WRITE_MIN = 64 << 10


# An archive with this share of its bytes in the page cache counts as cached.
_CACHED_ENOUGH = 0.9


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


class Prefetcher(_Ahead):
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
        self._open(path)
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="fastload-read")
        self._hasher = hasher
        self._hash_pool = None
        if hasher is not None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="fastload-hash")
        self._hashing: Future[None] | None = None
        self._depth = depth
        self._queue: deque[tuple[int, int, int, memoryview, Future[int]]] = deque()
        self._next = 0
        self.read_seconds = 0.0  # in reads (a file's, or ranged GETs), summed over threads
        self._timing = threading.Lock()
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    def _open(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # before any read
        self._direct_fd = _open_direct(path) if self._block % _ALIGN == 0 else -1
        self._direct = self._direct_fd  # -1 once the file system refuses a direct read
        self.direct_reads = 0  # blocks read with O_DIRECT (for tests and reports)

    def _close_source(self) -> None:
        os.close(self._fd)
        if self._direct_fd >= 0:
            os.close(self._direct_fd)

    def _read(self, view: memoryview, n: int, off: int) -> int:
        if self._direct >= 0 and off % _ALIGN == 0:
            try:
                cached = _core.cached_bytes(self._fd, off, n) == n
            except OSError:
                cached = True  # cannot tell (mmap refused): read through the cache
            if not cached:
                return self._read_direct(view, n, off)
        return self._read_cached(view, 0, n, off)

    def _read_cached(self, view: memoryview, got: int, n: int, off: int) -> int:
        """Reads [off + got, off + n) into view[got:n] through the page cache; returns
        the bytes in the view (short only at the end of the file)."""
        while got < n:
            k = os.preadv(self._fd, [view[got:n]], off + got)
            if k == 0:
                break
            got += k
        return got

    def _timed_read(self, view: memoryview, n: int, off: int) -> int:
        t0 = time.monotonic()
        try:
            return self._read(view, n, off)
        finally:
            with self._timing:
                self.read_seconds += time.monotonic() - t0

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
            if k == 0:
                break  # the end of the file
            if got % _ALIGN:
                # Short off a block boundary: the end of the file, or a read cut short
                # (a signal, a device's limit). The rest, if any, through the cache: a
                # short read is the end of the file only where a buffered read says so.
                got = self._read_cached(view, got, n, off) if got < n else got
                break
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
                (self._next, n, b, view, self._pool.submit(self._timed_read, view, n, self._next))
            )
            self._next += n

    def __iter__(self) -> Iterator[tuple[int, int, int, memoryview]]:
        while self._queue:
            off, n, b, view, fut = self._queue.popleft()
            try:
                try:
                    got = fut.result()
                except StageError:
                    raise  # already names the source (an object store's errors do)
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
        self._close_source()


class RemotePrefetcher(Prefetcher):
    """A :class:`Prefetcher` over an object: each block is a ranged GET (``If-Match`` its
    ETag, so a replaced object fails instead of mixing two versions) copied into the
    job's block; ``depth`` GETs in flight, delivered in order. Memory stays at ``depth``
    blocks whatever the object's size."""

    def __init__(
        self,
        store: ObjectStore,
        info: ObjectInfo,
        job: _core.ExtractJob,
        depth: int = _REMOTE_PREFETCH,
        hasher: Any = None,
    ):
        self._store, self._info = store, info
        super().__init__(Path(info.key), info.size, job, depth, hasher)
        self._name = f"{store.scheme}://{store.bucket}/{store.prefix}"

    def _open(self, path: Path) -> None:
        pass

    def _close_source(self) -> None:
        pass

    def _read(self, view: memoryview, n: int, off: int) -> int:
        return self._store.read_into(self._info.key, off, view[:n], self._info.etag)


class MappedReader(_Ahead):
    """The archive mapped into the job (``ExtractJob.map_source``) instead of read: the
    job writes members straight from the mapping, so the bytes of a cached archive are
    copied once, by the buffered write, or not at all, by an O_DIRECT one (a read into a
    block copies them out of the cache first: on a small node, the CPU the extraction
    needs). Iterates like :class:`Prefetcher`, yielding ``(offset, n, -1, None)``: the
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


class NativeReader:
    """The archive read by the extraction job itself (``ExtractJob.read_source``, issue
    33): one native call for the whole file, the GIL released, instead of a Python loop
    per block. The job reads it in its own blocks through the I/O engine the engine rule
    gives the archive's file system (io_uring, or the pread pool on a network or FUSE
    one: a thread waiting for each read, ``depth`` at once), O_DIRECT for blocks not in
    the page cache where the file system allows it (as :class:`Prefetcher`:
    :func:`_open_direct`), seeking over skipped members. Owns its descriptors:
    ``close()`` closes them.

    With ``hasher`` (a published checksum), every block goes to ``hasher.update``, in
    order, on a thread of the job's while it is fed (hashlib releases the GIL): no
    second read, nothing seeked over. For an archive the job is fed as it is (a Python
    decoder keeps :class:`Prefetcher`)."""

    def __init__(
        self, path: Path, size: int, job: _core.ExtractJob, depth: int = 0, hasher: Any = None
    ):
        self._size, self._job, self._name = size, job, str(path)
        self._depth = depth or _PREFETCH
        self._hasher = hasher
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        with contextlib.suppress(OSError):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._direct_fd = _open_direct(path) if job.block_size % _ALIGN == 0 else -1
        self.bytes_read = self.blocks = self.direct_reads = 0
        # Stage stats: the job's time waiting for its reads, and feeding the extractor;
        # the feeding's wait for the hasher; the reads' backend ("uring" or "pread").
        self.read_seconds = self.feed_seconds = self.hash_wait_seconds = 0.0
        self.engine = ""
        self.stripe = read_stripe(path)

    def run(self, tick: Callable[[int], None] | None) -> None:
        """Reads, hashes and feeds the whole archive; ``tick(offset)`` on this thread
        between blocks, at most every 100 ms (the journal, progress; Ctrl-C raises from
        it)."""
        update = None if self._hasher is None else self._hasher.update
        (self.bytes_read, self.blocks, self.direct_reads, self.read_seconds,
         self.feed_seconds, self.hash_wait_seconds, self.engine) = self._job.read_source(
            self._fd, self._direct_fd, self._size, self._depth, tick,
            where=self._name, hash=update, stripe=self.stripe,
        )  # fmt: skip

    def close(self) -> None:
        os.close(self._fd)
        if self._direct_fd >= 0:
            os.close(self._direct_fd)


def read_stripe(path: Path) -> int:
    """The stripe the job reads an archive at ``path`` in (0: whole blocks): 1 MiB on
    a network or FUSE file system, where many requests in flight cover the latency.
    ``FASTLOAD_READ_STRIPE`` overrides (bytes; 0: whole blocks)."""
    value = os.environ.get("FASTLOAD_READ_STRIPE", "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError(f"FASTLOAD_READ_STRIPE={value!r}: not a number of bytes") from None
    return _NET_STRIPE if network_fs(path) is True else 0


def native_reads() -> bool:
    """Whether a local archive is read by the job itself (:class:`NativeReader`).
    ``FASTLOAD_NATIVE_READS=0``: by :class:`Prefetcher` instead (the Python read-ahead,
    kept for comparison and for archives that need it)."""
    return os.environ.get("FASTLOAD_NATIVE_READS", "1").strip() != "0"


def mapped_reads(src: Path, cached: float) -> bool:
    """Whether to map the (uncompressed) archive rather than read it: when it is in the
    page cache (``cached``: the share of its bytes), on a local file system. An archive
    that must come from the disk is better read O_DIRECT (:class:`Prefetcher`), which
    does not fill the cache with it. ``FASTLOAD_MAPPED_READS`` overrides: ``0`` never,
    ``1`` always."""
    value = os.environ.get("FASTLOAD_MAPPED_READS", "").strip()
    if value in ("0", "1"):
        return value == "1"
    return network_fs(src) is False and cached >= _CACHED_ENOUGH


def cached_share(src: Path, size: int) -> float:
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


def direct_write_min(src: Path, dst: Path, cached: float) -> int:
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


class PyDecoder:
    """Decodes with Python decompression objects (zlib's interface) as the native decoder
    does: across concatenated gzip members or zstd frames (one object each), skipping
    zero padding after a gzip member; a corrupt stream, or one that ends inside a member
    or frame, is a TarFormatError naming the archive."""

    def __init__(self, new: Callable[[], Any], kind: str, src: str | Path) -> None:
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


class LocalArchive:
    """An archive file on a local or network file system, as the extraction reads it."""

    stream = False

    def __init__(self, path: Path) -> None:
        self.path, self.name = path, str(path)
        st = os.stat(path)
        self.size, self._mtime_ns = st.st_size, st.st_mtime_ns
        self.identity: tuple[str, int, Any] = (self.name, st.st_size, st.st_mtime_ns)
        self.cached = cached_share(path, self.size)

    def reader(
        self, job: _core.ExtractJob, hasher: Any, can_seek: bool, raw: bool = True
    ) -> Prefetcher | MappedReader | NativeReader:
        """Mapped when cached (:func:`mapped_reads`: a local file system, no hasher);
        else read by the job itself when it is fed the file's bytes as they are
        (``raw``: a tar, or one the job decodes natively), on any file system, hashed
        on the way with ``hasher``; else (a Python decoder takes the bytes, or
        ``FASTLOAD_NATIVE_READS=0``) the Python read-ahead."""
        if can_seek and mapped_reads(self.path, self.cached):
            with contextlib.suppress(OSError):  # a file system that cannot map it: read it
                return MappedReader(self.path, self.size, job)
        if raw and native_reads():
            return NativeReader(self.path, self.size, job, hasher=hasher)
        return Prefetcher(self.path, self.size, job, hasher=hasher)

    def direct_write_min(self, dst: Path) -> int:
        return direct_write_min(self.path, dst, self.cached)

    def changed(self) -> bool:
        st = os.stat(self.path)
        return (st.st_size, st.st_mtime_ns) != (self.size, self._mtime_ns)


class RemoteArchive:
    """An archive object in an object store: read in ranged GETs, never copied to disk."""

    stream = False

    def __init__(self, store: ObjectStore, info: ObjectInfo) -> None:
        self._store, self._info = store, info
        self.name = store.url
        self.size = info.size
        self.identity: tuple[str, int, Any] = (self.name, info.size, info.identity)
        self.cached = 0.0

    def reader(
        self, job: _core.ExtractJob, hasher: Any, can_seek: bool, raw: bool = True
    ) -> RemotePrefetcher:
        return RemotePrefetcher(self._store, self._info, job, hasher=hasher)

    def read_into(self, view: memoryview, offset: int) -> int:
        """One ranged GET (``If-Match`` the listed ETag) into ``view``."""
        return self._store.read_into(self._info.key, offset, view, self._info.etag)

    def direct_write_min(self, dst: Path) -> int:
        # The archive does not come from the destination's disk: direct writes compete
        # with no reads there.
        return _DIRECT_WRITE_MIN

    def changed(self) -> bool:
        try:
            return self._store.head(self._info.key).identity != self._info.identity
        except FileNotFoundError:
            return True


ArchiveSource = Union[LocalArchive, RemoteArchive, "StreamArchive"]
