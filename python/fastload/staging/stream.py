"""Tar streams: an archive read once, in order, from stdin, a pipe or a binary file
object (:class:`StreamArchive`, read ahead by :class:`StreamReader`), and the Archive
source stage() makes of one (:func:`open_stream`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import stat
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import stage_error
from .archive import Archive
from .readers import Prefetcher, direct_write_min
from .request import StageRequest

# Compressed formats a stream may be in that are not read here, by magic bytes.
_OTHER_MAGIC = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x04\x22\x4d\x18": "lz4"}


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


class StreamReader(Prefetcher):
    """A :class:`Prefetcher` over a stream (a pipe, stdin, any binary file object): the
    same lent blocks, filled in order by one thread of its own (a stream has no
    positions: one read at a time), ``depth`` blocks ahead of the consumer so that the
    writer of a pipe rarely waits. The first bytes, already read to tell the compression
    (``head``), come first. Ends at the stream's end; never seeks."""

    def __init__(self, source: StreamArchive, job: _core.ExtractJob, depth: int = 4,
                 hasher: Any = None):
        self._source, self._ready = source, False
        super().__init__(Path(source.name), 1 << 62, job, depth, hasher)
        self._pool.shutdown(wait=True)  # the parent's; reads must run one at a time
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastload-stream")
        self._ready = True
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    def _open(self, path: Path) -> None:
        self._direct_fd = self._direct = -1
        self.direct_reads = 0

    def _close_source(self) -> None:
        pass

    def _fill(self) -> None:
        if self._ready:  # not from Prefetcher.__init__, whose pool reads in parallel
            super()._fill()

    def _read(self, view: memoryview, n: int, off: int) -> int:
        return self._source.read_into(view[:n])

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
                if got < n:
                    self._size = off + got  # the end of the stream: nothing more to queue
                else:
                    self._fill()
                if not got:
                    continue
                data = view[:got]
                if self._hasher is not None:
                    self._hasher.update(data)
                yield off, got, b, data
            finally:
                self._job.release(b)
            self._fill()


class StreamArchive:
    """An archive read once, in order, from a stream: stdin (``"-"``), a pipe's file
    descriptor, or any binary file object (``sys.stdin.buffer``, ``io.BufferedReader``,
    a socket's ``makefile("rb")``). Its compression is told by its first bytes.

    Nothing identifies a stream's content before it is read, so a complete manifest of
    an earlier stage never makes this one return at once: the stream is read again, and
    members already in the destination with the size and mtime the manifest (or the
    journal of an interrupted run) records are skipped, not rewritten (re-extracting
    what is not done). Its identity in the manifest is ``(name, 0, "stream")``."""

    stream = True

    def __init__(self, src: Any) -> None:
        self._fd = -1
        self._file: Any = None
        if src == "-":
            src = sys.stdin.buffer
        if isinstance(src, int):
            self._fd, self.name = src, f"<fd {src}>"
        elif isinstance(src, io.TextIOBase):
            raise TypeError(
                "a tar stream is read as bytes: pass a binary file object "
                "(sys.stdin.buffer, open(path, 'rb')), not a text one"
            )
        else:
            self._file = src
            name = getattr(src, "name", None)
            if src is sys.stdin.buffer or name == "<stdin>" or name == 0:
                self.name = "<stdin>"
            elif isinstance(name, str):
                self.name = name
            elif isinstance(name, int):
                self.name = f"<fd {name}>"
            else:
                self.name = f"<{type(src).__name__}>"
        self.size = 0  # bytes read so far; unknown before the end
        self.identity: tuple[str, int, Any] = (self.name, 0, "stream")
        self.cached = 0.0
        if self._isatty():
            raise stage_error(
                errno.EINVAL,
                f"refusing to read a tar archive from a terminal ('{self.name}'): pipe one "
                "in (curl ... | fastload stage - DST) or name a file",
                self.name,
            )
        self._grow_pipe()
        self.head = self._read_head(512)

    def _isatty(self) -> bool:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            return os.isatty(self._fd if self._fd >= 0 else self._file.fileno())
        return False

    def _grow_pipe(self) -> None:
        """A pipe's buffer raised to 1 MiB where allowed: its writer (curl, zstd -dc)
        blocks less often while this side is busy."""
        fd = self._fd
        if fd < 0:
            try:
                fd = self._file.fileno()
            except (AttributeError, OSError, ValueError):
                return
        with contextlib.suppress(OSError, AttributeError):
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)  # type: ignore[attr-defined,unused-ignore]

    def _read_head(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self._read_raw(memoryview(buf))
        return bytes(buf[:got])

    def _read_raw(self, view: memoryview) -> int:
        """Fills ``view`` from the stream; fewer bytes only at its end."""
        got, n = 0, len(view)
        while got < n:
            if self._fd >= 0:
                try:
                    k = os.readv(self._fd, [view[got:]])
                except InterruptedError:
                    continue
            else:
                readinto = getattr(self._file, "readinto", None)
                if readinto is not None:
                    k = readinto(view[got:])
                else:
                    chunk = self._file.read(n - got)
                    k = len(chunk)
                    view[got:got + k] = chunk
                if k is None:  # a non-blocking stream with nothing yet
                    raise stage_error(
                        errno.EAGAIN, f"read '{self.name}': the stream is non-blocking",
                        self.name)
            if not k:
                break
            got += k
        return got

    def read_into(self, view: memoryview) -> int:
        """The next bytes of the archive into ``view`` (the head first); fewer than its
        length only at the end of the stream."""
        got = 0
        if self.head:
            got = min(len(self.head), len(view))
            view[:got] = self.head[:got]
            self.head = self.head[got:]
        got += self._read_raw(view[got:])
        self.size += got
        return got

    def reader(
        self, job: _core.ExtractJob, hasher: Any, can_seek: bool, raw: bool = True
    ) -> StreamReader:
        return StreamReader(self, job, hasher=hasher)

    def direct_write_min(self, dst: Path) -> int:
        # Where the stream comes from is unknown (a file on the destination's disk through
        # cat, or the network): buffered writes, unless FASTLOAD_DIRECT_WRITES asks.
        value = os.environ.get("FASTLOAD_DIRECT_WRITES", "").strip()
        return direct_write_min(Path("/"), dst, 0.0) if value else 0

    def changed(self) -> bool:
        return False


def open_stream(src: object, dst: str | os.PathLike[str], req: StageRequest) -> Archive:
    """The source of a stage() of a tar stream (:class:`StreamArchive`): stdin, a pipe, a
    file object; plain, gzip or zstd by its first bytes; read once, in order, never
    seeked. Its destination is the directory ``dst``."""
    if req.unpack is False:
        raise stage_error(
            errno.EINVAL,
            "a stream can only be extracted as a tar archive: unpack=False needs a file",
        )
    data = StreamArchive(src)
    if not data.head:
        # GNU tar refuses it too: a download that failed (curl -f ... |) gives an
        # empty stream, which must not pass for an empty archive.
        raise stage_error(
            errno.EINVAL, f"'{data.name}' is empty: no tar archive came through it", data.name
        )
    options: dict[str, Any] = {
        **req.selection(), "file": True, "stream": True, "unpack": req.unpack_option,
    }  # fmt: skip
    return Archive(data, stream_compression(data.head, data.name), options)
