"""A zip's bytes by ranges (a local file's preads, an object's ranged GETs, an HTTP
server's Range requests: :class:`LocalZip`, :class:`StoreZip`, :class:`HttpZip`; read
from many threads at once), and its members' decoders (stored, deflate, bzip2, lzma,
zstd where ``zstandard`` is installed), bounded by the declared sizes: a member never
yields more bytes than its entry declares (a bomb's stream stops there, an error)."""

from __future__ import annotations

import bz2
import contextlib
import errno
import logging
import lzma
import os
import shutil
import struct
import tempfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import Any, Protocol

from .._util import version
from ..errors import stage_error
from .zipformat import METHODS, Member, zip_error

log = logging.getLogger(__name__)


class ZipData(Protocol):
    """Where a zip's bytes come from."""

    name: str  # the path or URL the manifest records
    size: int
    identity: tuple[Any, ...]  # changes with the archive

    def read_at(self, offset: int, length: int) -> bytes | memoryview: ...
    def changed(self) -> bool: ...
    def close(self) -> None: ...


class LocalZip:
    """A zip on a file system: positional reads, any number at once."""

    def __init__(self, path: Path, *, temporary: bool = False) -> None:
        self.path, self.name = path, str(path)
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        self.size, self._mtime_ns = st.st_size, st.st_mtime_ns
        self.identity: tuple[Any, ...] = (self.name, st.st_size, st.st_mtime_ns)
        self._temporary = temporary

    def read_at(self, offset: int, length: int) -> bytes | memoryview:
        length = max(0, min(length, self.size - offset))
        data = os.pread(self._fd, length, offset)  # (bytes: no zero-filled buffer first)
        if len(data) < length:  # short (a signal, or the file shrank): the rest, if any
            parts, got = [data], len(data)
            while got < length and (more := os.pread(self._fd, length - got, offset + got)):
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    def changed(self) -> bool:
        st = os.stat(self.path)
        return (st.st_size, st.st_mtime_ns) != (self.size, self._mtime_ns)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._temporary:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class StoreZip:
    """A zip object in an object store (s3://, gs://, az://): ranged GETs, each with
    ``If-Match`` its listed ETag; never downloaded whole."""

    def __init__(self, store: Any, info: Any) -> None:
        self._store, self._info = store, info
        self.name = store.url
        self.size = info.size
        self.identity: tuple[Any, ...] = (self.name, info.size, info.identity)

    def read_at(self, offset: int, length: int) -> bytes | memoryview:
        end = min(self.size, offset + length)
        if end <= offset:
            return b""
        got: memoryview = self._store.get_range(self._info.key, offset, end, self._info.etag)
        return got

    def changed(self) -> bool:
        try:
            return bool(self._store.head(self._info.key).identity != self._info.identity)
        except FileNotFoundError:
            return True

    def close(self) -> None:
        pass


def _http_request(url: str, headers: dict[str, str], method: str = "GET") -> Any:
    req = urllib.request.Request(url, method=method,
                                 headers={"User-Agent": f"fastload/{version()}", **headers})
    try:
        return urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        code = errno.ENOENT if e.code == 404 else errno.EIO
        raise stage_error(code, f"'{url}': HTTP {e.code} {e.reason}", url) from None
    except (urllib.error.URLError, OSError) as e:
        raise stage_error(errno.EHOSTUNREACH, f"'{url}': {e}", url) from None


class HttpZip:
    """A zip behind an HTTP server that serves byte ranges (``Range``, answered 206):
    read by ranges, each asking ``If-Range`` the validator first seen (a changed file
    is answered whole, 200: an error). :func:`open_http_zip` falls back to a download
    where the server does not serve ranges."""

    def __init__(self, url: str, size: int, validator: str) -> None:
        self.name, self.size, self._validator = url, size, validator
        self.identity: tuple[Any, ...] = (url, size, validator)

    def read_at(self, offset: int, length: int) -> bytes | memoryview:
        end = min(self.size, offset + length)
        if end <= offset:
            return b""
        headers = {"Range": f"bytes={offset}-{end - 1}"}
        if self._validator:
            headers["If-Range"] = self._validator
        with _http_request(self.name, headers) as resp:
            if resp.status != 206:
                raise stage_error(errno.EIO, f"'{self.name}' changed while it was read (a "
                                  "range was answered with the whole file)", self.name)
            return bytes(resp.read(end - offset))

    def changed(self) -> bool:
        with _http_request(self.name, {"Range": "bytes=0-0"}) as resp:
            return _validator(resp) != self._validator

    def close(self) -> None:
        pass


def _validator(resp: Any) -> str:
    return str(resp.headers.get("ETag") or resp.headers.get("Last-Modified") or "")


def open_http_zip(url: str, spool: Path) -> HttpZip | LocalZip:
    """``url`` read by ranges; where its server answers a range with the whole file (no
    ``Range`` support), that answer is saved in ``spool`` (a folder beside the
    destination) and the zip read from there, with a warning saying so."""
    resp = _http_request(url, {"Range": "bytes=0-0"})
    with resp:
        if resp.status == 206:
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            if total.isdigit():
                return HttpZip(url, int(total), _validator(resp))
        log.warning("'%s' does not serve byte ranges (HTTP %s to a Range request): "
                    "downloading it whole before extracting", url, resp.status)
        spool.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".zip-", suffix=".fl-tmp", dir=spool)
        try:
            with os.fdopen(fd, "wb") as out:
                if resp.status == 206:  # a range with no total: ask for all of it
                    with _http_request(url, {}) as whole:
                        shutil.copyfileobj(whole, out, 8 << 20)
                else:
                    shutil.copyfileobj(resp, out, 8 << 20)
            local = LocalZip(Path(tmp), temporary=True)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    local.name = url
    local.identity = (url, local.size, _validator(resp) or local.size)
    return local


# --- decoding -------------------------------------------------------------------------


def method_name(method: int) -> str:
    return METHODS.get(method, f"method {method}")


def _zstd() -> Any:
    try:
        import zstandard  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return zstandard


def check_method(archive: str, m: Member) -> None:
    """Refuses a member whose method cannot be read here, naming both."""
    if m.method in (0, 8, 12, 14) or (m.method == 93 and _zstd() is not None):
        return
    hint = " (pip install zstandard)" if m.method == 93 else ""
    raise zip_error(archive, f"compressed with {method_name(m.method)}, which fastload "
                    f"cannot read{hint}", m.path)  # fmt: skip


def _lzma_decoder(archive: str, m: Member, head: bytes) -> tuple[Any, int]:
    """The raw LZMA decoder of a zip lzma member (its 4-byte header and 5 property
    bytes first) and the bytes those take."""
    if len(head) < 9:
        raise zip_error(archive, "truncated lzma header", m.path)
    n_props = struct.unpack_from("<H", head, 2)[0]
    if n_props != 5 or len(head) < 4 + n_props:
        raise zip_error(archive, "a broken lzma header", m.path)
    d = head[4]
    lc, lp, pb = d % 9, (d // 9) % 5, d // 45
    dict_size = struct.unpack_from("<I", head, 5)[0]
    filters = [{"id": lzma.FILTER_LZMA1, "dict_size": dict_size, "lc": lc, "lp": lp, "pb": pb}]
    return lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=filters), 9


class Decoder:
    """One member's data to its bytes, in pieces (``feed``), never more than declared:
    ``feed`` raises once the output would pass ``m.usize``; ``end`` checks the stream
    ended where it should and the CRC-32."""

    def __init__(self, archive: str, m: Member) -> None:
        self.archive, self.m = archive, m
        self.out = 0
        self.crc = 0
        self._d: Any = None
        self._first = True

    def _error(self, what: str) -> Exception:
        return zip_error(self.archive, what, self.m.path)

    def _start(self, data: Any) -> Any:
        m = self.m
        if m.method == 8:
            self._d = zlib.decompressobj(-15)
        elif m.method == 12:
            self._d = bz2.BZ2Decompressor()
        elif m.method == 14:
            self._d, skip = _lzma_decoder(self.archive, m, bytes(data[:9]))
            data = data[skip:]
        elif m.method == 93:
            self._d = _zstd().ZstdDecompressor().decompressobj()
        return data

    def feed(self, data: Any) -> Any:
        """The bytes ``data`` (the next piece of compressed data) decodes to."""
        m = self.m
        if m.method == 0:
            out = data
        else:
            if self._first:
                data = self._start(data)
                self._first = False
            try:
                out = self._decode(data, m.usize - self.out + 1)
            except (zlib.error, OSError, EOFError, lzma.LZMAError, ValueError) as e:
                raise self._error(f"corrupt {method_name(m.method)} data: {e}") from None
            except Exception as e:  # zstandard.ZstdError
                raise self._error(f"corrupt {method_name(m.method)} data: {e}") from None
        self.out += len(out)
        if self.out > m.usize:
            raise self._error(f"its data decodes to more than the {m.usize} bytes declared")
        self.crc = zlib.crc32(out, self.crc)
        return out

    def _decode(self, data: Any, room: int) -> bytes:
        d, method = self._d, self.m.method
        if method == 8:
            out: bytes = d.decompress(data, room)
            if d.unconsumed_tail:
                raise self._error(f"its data decodes to more than the {self.m.usize} "
                                  "bytes declared")  # fmt: skip
            return out
        if method == 93:
            out = d.decompress(bytes(data))
            return out
        if d.eof:
            if len(data):
                raise self._error("data after the end of its compressed stream")
            return b""
        out = d.decompress(data, room)
        if not d.needs_input and not d.eof:
            raise self._error(f"its data decodes to more than the {self.m.usize} bytes "
                              "declared")  # fmt: skip
        return out

    def end(self) -> None:
        m, d = self.m, self._d
        if self._first and m.method != 0:  # an empty compressed stream
            if m.usize:
                raise self._error("truncated: no compressed data")
            return
        if self.out != m.usize:
            raise self._error(f"its data decodes to {self.out} bytes, {m.usize} declared "
                              "(truncated or corrupt)")  # fmt: skip
        if m.method in (8, 12) and not d.eof:
            raise self._error(f"truncated {method_name(m.method)} stream")
        if m.method == 14 and m.flags & 0x2 and not d.eof:
            raise self._error("truncated lzma stream (no end marker)")
        if self.crc != m.crc:
            raise self._error(f"CRC-32 mismatch: the data has {self.crc:08x}, the archive "
                              f"declares {m.crc:08x}")  # fmt: skip


def decode_whole(archive: str, m: Member, data: Any) -> Any:
    """A member's whole data decoded and checked (a buffer: a stored member's is a view
    of ``data``)."""
    dec = Decoder(archive, m)
    out = dec.feed(data)
    dec.end()
    return out
