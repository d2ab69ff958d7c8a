"""Object stores (``s3://``, ``gs://``, ``az://``) through obstore (Rust's object_store):
ranged reads with ``If-Match``, request signing. Listing is in :mod:`.listing`; S3
listings, and the GETs of keys obstore would address under another name, are made by
:mod:`.s3raw` where the credentials are keys (obstore parses every key of a listing).
Retries are ours, not obstore's (whose retries cannot be counted): every request goes
through one policy (:mod:`.retry`), and each store counts its retries by reason
(:attr:`ObjectStore.retries`). Where the settings come from (site, profile,
environment, ``storage_options``) and how they are checked: :mod:`.settings`.

Errors name the URL: a missing bucket or key is ``FileNotFoundError``; refused
credentials are ``PermissionError`` naming the endpoint too; an object that changed
while it was read is :class:`SourceChangedError`; an unreachable endpoint is one line.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import importlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path
from typing import Any

from .._util import selected
from ..errors import SourceChangedError, stage_error
from .base import OBJECT_SCHEMES
from .credentials import answer_timeout, credentials_not_found, seconds, unreachable
from .objlist import ObjectInfo, ObjectList
from .retry import RawError, RetryCounts, Tries
from .settings import (
    StorageOptions,
    _metadata_disabled,
    normalize_options,
    s3_settings,
    site_options,
)

log = logging.getLogger(__name__)

SCHEMES = OBJECT_SCHEMES
_EXTRA = "pip install 'fastload[s3]'  (it installs obstore)"
_URL = re.compile(r"^(s3|gs|az)://([^/]+)/?(.*)$")
# Pieces of a streamed range: small enough for the CPU's cache and for malloc to reuse
# (1 MiB pieces page-faulted 4x as often), large enough that a GiB is a few thousand.
STREAM_CHUNK = 256 << 10
# A server that has not answered the first request for this many seconds is said to be
# not answering (the limit of a wait: credentials.ANSWER_TIMEOUT).
NOT_ANSWERING = 3.0

def split_url(url: str) -> tuple[str, str, str]:
    """``s3://bucket/a/b`` -> ``("s3", "bucket", "a/b")``."""
    m = _URL.match(url)
    if m is None:
        raise ValueError(f"not an object store URL (s3://bucket/key): {url!r}")
    return m.group(1), m.group(2), m.group(3)


_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def _forget_clients() -> None:
    """In a forked child: a client's runtime does not survive fork, and the lock may have
    been held by a thread that is not there."""
    global _clients_lock
    _clients.clear()
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_clients)


def _client(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """One obstore client per bucket and settings in this process, shared by every
    ObjectStore (staging, the cache, its fork server, pack, probe)."""
    k = repr(key)
    with _clients_lock:
        client = _clients.get(k)
        if client is None:
            client = _clients[k] = make()
        return client


class ObjectStore:
    """A bucket (and a prefix in it) of an object store. Cheap to make: the clients are
    shared (:func:`_client`)."""

    def __init__(self, url: str, storage_options: StorageOptions | None = None) -> None:
        self.scheme, self.bucket, self.prefix = split_url(url)
        self.url = url
        try:
            # Typed as Any: obstore is optional, and its typed dicts are not worth
            # mirroring for the few keys passed through.
            self._ob: Any = importlib.import_module("obstore")
            obstores: Any = importlib.import_module("obstore.store")
        except ImportError:
            raise ModuleNotFoundError(
                f"reading {self.scheme}:// URLs needs obstore: {_EXTRA}"
            ) from None
        self.retries = RetryCounts()
        """The retries of this store's requests, by reason (:data:`.retry.REASONS`)."""
        # obstore retries nothing: every request goes through Tries (the policy, counted).
        retry = {"max_retries": 0, "retry_timeout": timedelta(seconds=120)}
        # A server that accepts the connection and sends nothing fails a request after
        # ``timeout`` seconds without a byte (read_timeout: each read, not the whole
        # body, so a slow stream of a big object is not cut).
        self.timeout = answer_timeout()
        client: dict[str, Any] = {"connect_timeout": "5s", "read_timeout": f"{self.timeout:g}s",
                                  "timeout": f"{max(300.0, 4 * self.timeout):g}s"}  # fmt: skip
        self._answered = False
        # No keys: the first request asks the instance metadata service for a role's
        # credentials before it reaches the store (the silence may be that service's).
        self._keyless = False
        # Listings, and GETs of keys obstore would address under another name, made by
        # sources/s3raw.py where the credentials are keys (or none are needed).
        self._raw: Any = None
        if self.scheme == "s3":
            s = s3_settings(storage_options)
            self.endpoint = s.pop("endpoint_url", None) or "https://s3.amazonaws.com"
            anonymous = bool(s.pop("anonymous", False))
            config: dict[str, Any] = {
                k: v for k, v in s.items() if k not in ("allow_http", "client_options")
            }
            config.setdefault("region", "us-east-1")
            if self.endpoint != "https://s3.amazonaws.com":
                config["endpoint"] = self.endpoint
                config.setdefault("virtual_hosted_style_request", False)
            if anonymous:
                config["skip_signature"] = True
                for k in ("access_key_id", "secret_access_key", "session_token"):
                    config.pop(k, None)
            elif "access_key_id" not in config and _metadata_disabled():
                # Without keys, the client would ask the instance metadata service
                # (169.254.169.254) for a role's credentials; where that is switched
                # off, say what is missing instead.
                raise stage_error(
                    errno.EACCES,
                    f"no credentials for '{url}' (endpoint {self.endpoint}): set "
                    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, pass "
                    "storage_options, or anonymous=True for a public bucket",
                    url,
                )
            self._keyless = not anonymous and "access_key_id" not in config
            if self.endpoint.startswith("http://"):
                client["allow_http"] = True
            client.update(s.get("client_options", {}))
            self.timeout = seconds(client.get("read_timeout"), self.timeout)
            self._raw = _raw_client(self, config, client, anonymous)
            self._store: Any = _client(
                ("s3", self.bucket, config, client),
                lambda: obstores.S3Store(
                    self.bucket, config=config, client_options=client, retry_config=retry
                ),
            )
        else:
            opts = {
                **normalize_options(self.scheme, site_options(self.scheme),
                                    f"the configuration file's [storage.{self.scheme}]"),
                **normalize_options(self.scheme, storage_options, "storage_options"),
            }  # fmt: skip
            where = opts.get("base_url") or opts.get("endpoint")
            self.endpoint = str(where or f"{self.scheme}://")
            self._store = _client(
                (self.scheme, self.bucket, opts, client),
                lambda: obstores.from_url(
                    f"{self.scheme}://{self.bucket}", config=opts or None,
                    client_options=client, retry_config=retry,
                ),
            )

    # --- errors --------------------------------------------------------------------------

    def error(self, e: BaseException, key: str, retries: int = 0) -> OSError:
        """An obstore (or network) error as the OSError a user can act on, after
        ``retries`` retries."""
        from obstore import exceptions as ox

        url = f"{self.scheme}://{self.bucket}/{key}"
        text = str(e).split("\n", 1)[0]
        if isinstance(e, (ox.NotFoundError, FileNotFoundError)) or "NoSuchBucket" in str(e):
            if "NoSuchBucket" in str(e):
                check = f"check the bucket's name, and that {self.endpoint} is the endpoint"
                what = "bucket"
            else:
                check = "check the key: names are case-sensitive, and a prefix ends in /"
                what = "object"
            return stage_error(
                errno.ENOENT, f"'{url}': no such {what} at {self.endpoint} ({check})", url
            )
        if isinstance(e, ox.PreconditionError) or getattr(e, "status", 0) == 412:
            return stage_error(
                errno.EIO,
                f"source changed: '{url}' was replaced while it was being read; stage "
                "again to pick up the new content",
                url,
                SourceChangedError,
            )
        missing = credentials_not_found(str(e))  # the store was never asked
        if missing is not None:
            return stage_error(errno.EACCES, f"no credentials found for '{url}' (endpoint "
                               f"{self.endpoint}, not contacted): {missing}", url)  # fmt: skip
        if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or any(
            code in str(e)
            for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", " 403 ")
        ):
            return stage_error(
                errno.EACCES,
                f"'{url}': access denied by {self.endpoint} (check the credentials: "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage_options)",
                url,
            )
        low = str(e).lower()
        if any(w in low for w in ("connection refused", "error sending request", "dns error",
                                  "tcp connect", "connect error", "timed out")):
            why = unreachable(low, retries, self.timeout)
            return stage_error(
                errno.EHOSTUNREACH, f"cannot reach {self.endpoint} for '{url}': {why}", url
            )
        if isinstance(e, OSError) and not isinstance(e, (ox.BaseError, RawError)):
            return e
        return stage_error(errno.EIO, f"'{url}': {type(e).__name__}: {text}", url)

    # --- requests ------------------------------------------------------------------------

    def _tries(self, full: str, started: float | None = None) -> Tries:
        """The attempts at one request for ``full`` (first made at ``time.monotonic()``
        ``started``, else now) under the retry policy, counted in :attr:`retries`; the
        last error raised as :meth:`error` words it."""
        return Tries(self.retries, lambda e, n: self.error(e, full, n), started=started,
                     answer_limit=self.timeout)  # fmt: skip

    def _call(self, full: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (one request for ``full``), retried under the policy. Until the store
        has answered once, a request unanswered for :data:`NOT_ANSWERING` seconds says so
        in a log line (the stage is otherwise silent until the timeout)."""
        tries = self._tries(full)
        watch: threading.Timer | None = None
        # An attempt that failed otherwise than by waiting (refused, a name that does not
        # resolve) is an answer of a kind: its retries are not a silent server.
        failed_at_once = [False]
        if not self._answered:
            watch = threading.Timer(NOT_ANSWERING, self._not_answering, (failed_at_once,))
            watch.daemon = True
            watch.start()
        try:
            while True:
                try:
                    got = fn()
                    self._answered = True
                    return got
                except Exception as e:
                    if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                        failed_at_once[0] = True
                    tries.failed(e)
        finally:
            if watch is not None:
                watch.cancel()

    def _not_answering(self, failed_at_once: list[bool]) -> None:
        if self._answered or failed_at_once[0]:
            return
        if self._keyless:  # the store may not have been asked yet
            metadata = os.environ.get("AWS_METADATA_ENDPOINT") or "http://169.254.169.254"
            silent = (f"no reply for {NOT_ANSWERING:g} s from the instance metadata service "
                      f"({metadata}), asked for credentials since none are set, or from "
                      f"{self.endpoint}")  # fmt: skip
        else:
            silent = f"{self.endpoint} is not answering (no reply for {NOT_ANSWERING:g} s)"
        log.warning("fastload: %s; giving up after %g s (FASTLOAD_STORE_TIMEOUT sets that "
                    "for a slow store)", silent, self.timeout)  # fmt: skip

    def _full(self, key: str) -> str:
        return f"{self.prefix.rstrip('/')}/{key}" if self.prefix and key else (self.prefix or key)

    def list(self, include: list[str] | None = None, exclude: list[str] | None = None
             ) -> list[ObjectInfo]:
        """Every object under the prefix (:meth:`list_columns`), an ObjectInfo each."""
        return builtins.list(self.list_columns(include, exclude))

    def list_columns(self, include: Sequence[str] | None = None,
                     exclude: Sequence[str] | None = None) -> ObjectList:  # fmt: skip
        """Every object under the prefix, keys relative to it, filtered by glob patterns,
        sorted, in columns (sources/listing.py :func:`~.listing.list_columns`)."""
        from .listing import list_columns

        return list_columns(self, include, exclude)

    def list_tree(
        self, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
    ) -> tuple[ObjectList, builtins.list[str]]:
        """The objects to stage as a directory tree, and the folders markers name, each
        key placed, checked, filtered (sources/listing.py :func:`~.listing.list_tree`)."""
        from .listing import list_tree

        return list_tree(self, include, exclude)

    def _is_marker(self, key: str) -> bool:
        """Whether the zero-byte ``key`` of a listing is ``key/`` (a folder marker): the
        object ``key`` itself is not there."""
        try:
            self.head(key)
        except FileNotFoundError:
            return True
        return False

    def _odd(self, full: str) -> bool:
        """Whether ``full`` is a key obstore would address under another name, which the
        raw client (made where listings are) fetches instead."""
        return self._raw is not None and odd_key(full)

    def head(self, key: str = "") -> ObjectInfo:
        full = self._full(key)
        if self._odd(full):
            return _info(key, self._call(full, lambda: self._raw.head(full)))
        return _info(key, self._call(full, lambda: self._ob.head(self._store, full)))

    def get_range(self, key: str, start: int, end: int, etag: str | None) -> memoryview:
        """Bytes ``[start, end)`` of the object (fewer at its end), which must still have
        ``etag``; they stay in obstore's buffer (no copy)."""
        full = self._full(key)
        if self._odd(full):
            return memoryview(self._call(full, lambda: self._raw.get(full, start, end, etag)))
        opts: dict[str, Any] = {"range": (start, end)}
        if etag:
            opts["if_match"] = etag
        got = memoryview(self._call(full, lambda: self._ob.get(self._store, full,
                                                              options=opts).bytes()))
        if len(got) > end - start:
            raise stage_error(errno.EIO, f"'{self.url}/{key}': longer reply than asked", full)
        return got

    def stream_range(self, key: str, start: int, end: int, etag: str | None,
                     chunk: int = STREAM_CHUNK) -> Iterator[bytes | memoryview]:
        """Bytes ``[start, end)`` of the object (fewer at its end), which must still have
        ``etag``, in pieces of about ``chunk`` bytes as they arrive (never more bytes
        than asked: a longer reply raises OSError EIO): a writer puts each
        piece at its place while it is still in the CPU's cache, and no buffer the size
        of the range is ever allocated (a fresh 16 MiB one per part cost ~100,000 page
        faults per GiB, s5cmd 5,000, and about twice s5cmd's system time). A range of at
        most ``chunk`` bytes comes in one piece (one ``get_range``). A reply cut short
        is resumed from the byte it stopped at (a ranged GET of the rest, with the
        same ``If-Match``), a retry of the policy."""
        if end - start <= chunk or self._odd(self._full(key)):
            yield self.get_range(key, start, end, etag)
            return
        full = self._full(key)
        got = 0
        tries = self._tries(full)
        while got < end - start:  # (an error after the last byte: nothing left to ask)
            opts: dict[str, Any] = {"range": (start + got, end)}
            if etag:
                opts["if_match"] = etag
            try:
                resp = self._ob.get(self._store, full, options=opts)
                for piece in resp.stream(min_chunk_size=chunk):
                    got += len(piece)
                    if got > end - start:
                        break
                    yield piece
                break
            except Exception as e:
                tries.failed(e)
        if got > end - start:
            raise stage_error(errno.EIO, f"'{self.url}/{key}': longer reply than asked", full)

    def read_into(self, key: str, start: int, view: memoryview, etag: str | None) -> int:
        """Reads ``len(view)`` bytes at ``start`` of the object into ``view`` (fewer at
        its end); the object must still have ``etag``. Returns the bytes read. They are
        copied in as their pieces arrive (:meth:`stream_range`): no buffer of the range's
        size besides ``view`` (the blocks of a remote archive, the units of a fan-out)."""
        n = 0
        for piece in self.stream_range(key, start, start + len(view), etag):
            view[n:n + len(piece)] = piece
            n += len(piece)
        return n

    def fetch_parts(
        self,
        key: str,
        etag: str | None,
        size: int,
        write: Callable[[int, Any], None],
        *,
        start: int = 0,
        part_size: int,
        in_flight: int = 8,
        skip: Iterable[int] = (),
        on_part: Callable[[int], None] | None = None,
        on_get: Callable[[float], None] | None = None,
        pool: ThreadPoolExecutor | None = None,
    ) -> None:
        """Bytes ``[start, size)`` of the object (which must still have ``etag``) in
        ranged GETs of ``part_size`` bytes, part ``k`` at ``start + k * part_size``,
        ``in_flight`` at a time (on ``pool``, where given); each piece goes to
        ``write(offset, piece)`` as it arrives (a part's pieces in order, on one thread),
        and ``on_part(k)`` runs once part ``k`` is whole; ``on_get(t0)`` after each GET
        (answered or not) that started at ``time.monotonic()`` ``t0``. Parts in ``skip``
        are not fetched. The one ranged-part fetcher of the node cache, staging and
        fan-out: the first error cancels the parts not yet started and is raised once
        the others have ended (none writes after)."""

        def one(k: int) -> None:
            off = begin = start + k * part_size
            t0 = time.monotonic()
            try:
                for piece in self.stream_range(key, begin, min(size, begin + part_size), etag):
                    write(off, piece)
                    off += len(piece)
            finally:
                if on_get is not None:
                    on_get(t0)
            if on_part is not None:
                on_part(k)

        skipped = set(skip)
        todo = [k for k in range(max(1, -(-(size - start) // part_size))) if k not in skipped]
        if len(todo) == 1:  # inline: the caller may itself run on ``pool``
            one(todo[0])
            return
        own = pool is None
        runner = pool or ThreadPoolExecutor(
            min(in_flight, len(todo)) or 1, thread_name_prefix="fastload-part"
        )
        futures = [runner.submit(one, k) for k in todo]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)
            raise
        finally:
            if own:
                runner.shutdown(wait=True)

    def get(self, key: str, etag: str | None = None) -> memoryview:
        """The whole object (its bytes stay in obstore's buffer: no copy)."""
        full = self._full(key)
        if self._odd(full):
            return memoryview(self._call(full, lambda: self._raw.get(full, etag=etag)))
        opts: dict[str, Any] = {"if_match": etag} if etag else {}
        return memoryview(self._call(full, lambda: self._ob.get(self._store, full,
                                                               options=opts).bytes()))

    async def get_async(self, key: str, etag: str | None = None) -> Any:
        """:meth:`get` awaited on an event loop (no thread per request), retried under
        the same policy: the body as obstore's Bytes (a buffer; no copy)."""
        full = self._full(key)
        if self._odd(full):
            import asyncio

            return await asyncio.to_thread(self.get, key, etag)
        opts: dict[str, Any] = {"if_match": etag} if etag else {}
        tries: Tries | None = None  # made at the first failure: most GETs have none
        started = time.monotonic()
        while True:
            try:
                resp = await self._ob.get_async(self._store, full, options=opts)
                return await resp.bytes_async()
            except Exception as e:
                # Imported here, with the first failure (a GET without one needs no
                # asyncio of its own; SmallGets, which runs the loop, imported it).
                import asyncio

                if tries is None:
                    tries = self._tries(full, started)
                await asyncio.sleep(tries.wait_after(e))

    def stream(self, key: str = "") -> Iterator[memoryview]:
        """The object's bytes as they arrive (for sequential consumers). A reply cut
        short is resumed where it stopped, if the object still has the ETag of the
        first reply (else :class:`SourceChangedError`)."""
        full = self._full(key)
        got = 0
        etag: str | None = None
        size = -1
        tries = self._tries(full)
        while got != size:  # (an error after the last byte: nothing left to ask)
            opts: dict[str, Any] = {}
            if got:
                opts["range"] = {"offset": got}
            if etag:
                opts["if_match"] = etag
            try:
                resp = self._ob.get(self._store, full, options=opts)
                etag = etag or resp.meta.get("e_tag")
                size = int(resp.meta["size"]) if size < 0 else size
                for chunk in resp.stream(min_chunk_size=8 << 20):
                    got += len(chunk)
                    yield memoryview(chunk)
                return
            except Exception as e:
                tries.failed(e)

    def put(self, key: str, data: Any) -> None:
        """``data`` (bytes, or a path of a file) as the object ``key``."""
        full = self._full(key)
        self._call(full, lambda: self._ob.put(self._store, full, data))


def odd_key(key: str) -> bool:
    """Whether obstore would address ``key`` under another name, or not at all: a leading
    or trailing ``/``, an empty, ``.`` or ``..`` segment, an ASCII control character."""
    if not key:
        return False
    if key[0] == "/" or key[-1] == "/" or "//" in key:
        return True
    if any(seg in (".", "..") for seg in key.split("/")):
        return True
    return any(ord(c) < 0x20 or ord(c) == 0x7F for c in key)


def _raw_client(store: ObjectStore, config: Mapping[str, Any], client: Mapping[str, Any],
                anonymous: bool) -> Any:  # fmt: skip
    """The raw client (sources/s3raw.py) of an S3 store whose credentials are keys, or
    that needs none; else None (obstore finds the credentials: a role, SSO; or a proxy
    is set, which obstore's client goes through and the raw one does not)."""
    if client.get("proxy_url") or any(
        os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                                    "ALL_PROXY", "all_proxy")
    ):  # fmt: skip
        return None
    keys: tuple[str, str, str | None] | None = None
    if not anonymous:
        if not (config.get("access_key_id") and config.get("secret_access_key")):
            return None
        keys = (config["access_key_id"], config["secret_access_key"],
                config.get("session_token") or config.get("token"))  # fmt: skip
    from .s3raw import RawS3

    region = str(config.get("region", "us-east-1"))
    endpoint = str(config.get("endpoint") or f"https://s3.{region}.amazonaws.com")
    virtual = str(config.get("virtual_hosted_style_request", "false")).lower() == "true"
    insecure = str(client.get("allow_invalid_certificates", "false")).lower() == "true"
    return RawS3(endpoint, store.bucket, region, keys, virtual=virtual, timeout=store.timeout,
                 verify=not insecure)  # fmt: skip


def _info(rel: str, meta: Mapping[str, Any]) -> ObjectInfo:
    one = ObjectList()
    one.add(rel, meta)
    info: ObjectInfo = one[0]
    return info


class _StreamReader:
    """``read(n)`` over an object's byte stream (the Reader of sources.base)."""

    def __init__(self, chunks: Iterator[memoryview]) -> None:
        self._chunks, self._rest = chunks, memoryview(b"")

    def read(self, n: int = -1, /) -> bytes:
        if not len(self._rest):
            self._rest = next(self._chunks, memoryview(b""))
        if n < 0 or n >= len(self._rest):
            out, self._rest = bytes(self._rest), memoryview(b"")
        else:
            out, self._rest = bytes(self._rest[:n]), self._rest[n:]
        return out


@contextlib.contextmanager
def open_object(url: str) -> Iterator[tuple[_StreamReader, int | None]]:
    """The sources registry's opener for object store URLs: the object as a stream."""
    store = ObjectStore(url)
    info = store.head()
    yield _StreamReader(store.stream()), info.size


def is_object_url(location: str | os.PathLike[str] | Path) -> bool:
    return isinstance(location, str) and _URL.match(location) is not None


__all__ = ["SCHEMES", "ObjectInfo", "ObjectList", "ObjectStore", "StorageOptions",
           "is_object_url", "open_object", "selected", "split_url"]  # fmt: skip
