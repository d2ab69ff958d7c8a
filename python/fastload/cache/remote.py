"""RemoteShards: tar shards in an object store (``s3://``, ``gs://``, ``az://``) read
through the node-local :class:`~fastload.cache.store.ShardCache`.

The shards a source names (braces, globs, a prefix ending in ``/``, a list of URLs) are
listed once (size and ETag of each). Their index is, in this order: an index object
beside the shards (``index.fidx``, what ``pack`` writes, or its zstd-compressed copy
``index.fidx.zst``, a tenth of the bytes, read first where libzstd is present) that
describes exactly these shards and is newer than all of them; an index built earlier for
the same ETags (kept in the cache's ``views/``); else one built now from the shards' tar
headers (each shard passes through the cache once, its headers scanned into memory while
it is pinned; the index file counts against the cache's limit like a shard).

The index lives in a *view*: ``views/<hash of URLs and ETags>/`` holds the index file
and, at the paths the index records, symbolic links to the cache entries of those
versions (each made when its shard is first pinned). The native reader opens shards
through the links, so the datasets read remote shards with the same native fetch as
local ones; a shard is read only while pinned (:meth:`RemoteShards.pinned_one`), which
downloads it first when it is not cached.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import hashlib
import json
import logging
import os
import shutil
import tarfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

from .. import _core
from .._util import human, node_lock, pwrite_all, write_json_atomic
from ..errors import IndexFormatError, SourceChangedError, TarFormatError, stage_error
from ..index import ShardIndex, expand_braces
from ..sources import is_store_url, store_for
from ..sources.objstore import ObjectInfo, ObjectStore, StorageOptions, split_url
from . import _fetchd, _space
from .store import ByUrl, CacheEntry, Pin, ShardCache, count_get, store_fetcher

log = logging.getLogger(__name__)

__all__ = ["INDEX_OBJECT", "INDEX_OBJECT_ZST", "RemoteShards", "is_remote"]

#: The index object ``pack`` writes beside the shards.
INDEX_OBJECT = "index.fidx"
#: Its zstd-compressed copy, also written by ``pack`` to a bucket: an index is about ten
#: times its compressed size, and the first sample waits for all of it.
INDEX_OBJECT_ZST = INDEX_OBJECT + ".zst"
_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tar.xz", ".tar.lz4")
#: Shards indexed at once when there is no index object.
_INDEX_IN_FLIGHT = 4
#: The index object's parts (ranged GETs, several in flight).
_INDEX_PART = 4 << 20


def is_remote(source: object) -> bool:
    """Whether a dataset source names object-store shards."""
    if isinstance(source, str):
        return is_store_url(source)
    if isinstance(source, (list, tuple)) and source:
        return all(is_store_url(s) for s in source)
    return False


def _dir_of(url: str) -> str:
    return url.rsplit("/", 1)[0] + "/"


class RemoteShards:
    """The shards of ``source`` (a URL pattern or a list of URLs) read through ``cache``."""

    def __init__(
        self,
        source: str | Sequence[str],
        cache: ShardCache,
        storage_options: StorageOptions | None = None,
    ) -> None:
        self.cache = cache
        self.storage_options = dict(storage_options or {})
        try:
            listed = self._expand(source)
            self._save_listing(source, listed)
        except OSError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            listed = self._cached_listing(source, e)
        self.urls = [u for u, _ in listed]
        self.entries = [CacheEntry(u, i.etag, i.size) for u, i in listed]
        biggest = max(self.entries, key=lambda e: e.size)
        cache.check_fits(biggest.size, biggest.url)
        #: The size of the largest shard.
        self.largest = biggest.size
        self._index_objects = self._listing_index(listed)
        # DataLoader workers forked from here on get their downloads served by this
        # process (no helper process to start in each).
        _fetchd.serve_forks()

    def store(self, url: str) -> ObjectStore:
        """The store of ``url``'s bucket (clients are shared per process, and made
        again after fork: :func:`fastload.sources.store_for`)."""
        scheme, bucket, _ = split_url(url)
        store: ObjectStore = store_for(f"{scheme}://{bucket}/", self.storage_options)
        return store

    @staticmethod
    def _key(url: str) -> str:
        return split_url(url)[2]

    # --- listing -------------------------------------------------------------------------

    def _list_dir(self, dir_url: str, cache: dict[str, dict[str, ObjectInfo]]
                  ) -> dict[str, ObjectInfo]:
        """Every object under ``dir_url`` by its full URL (one listing per folder)."""
        if dir_url not in cache:
            store = store_for(dir_url, self.storage_options)
            cache[dir_url] = {dir_url + o.key: o for o in store.list()}
        return cache[dir_url]

    def _expand(self, source: str | Sequence[str]) -> list[tuple[str, ObjectInfo]]:
        names = expand_braces(source) if isinstance(source, str) else [str(s) for s in source]
        if not names:
            raise ValueError("no shards given")
        listings: dict[str, dict[str, ObjectInfo]] = {}
        out: list[tuple[str, ObjectInfo]] = []
        for name in names:
            if name.endswith("/"):  # a prefix: its tar objects (not those of sub-prefixes)
                found = sorted(
                    (u, i) for u, i in self._list_dir(name, listings).items()
                    if "/" not in u[len(name):] and u.endswith(_SHARD_SUFFIXES)
                )
                if not found:
                    raise FileNotFoundError(f"no tar shards (*.tar) under '{name}'")
                out += found
            elif glob.has_magic(split_url(name)[2]):
                star = min(name.find(c) for c in "*?[" if c in name)
                listed = self._list_dir(_dir_of(name[:star]), listings)
                found = sorted((u, i) for u, i in listed.items() if fnmatch.fnmatchcase(u, name))
                if not found:
                    raise FileNotFoundError(f"no shards match '{name}'")
                out += found
            else:
                info = self._list_dir(_dir_of(name), listings).get(name)
                if info is None:
                    raise stage_error(errno.ENOENT, f"'{name}': no such object", name)
                out.append((name, info))
        self._listings = listings
        return out

    def _listing_file(self, source: str | Sequence[str]) -> Path:
        h = hashlib.sha256(repr(source if isinstance(source, str) else list(source)).encode())
        return self.cache.root / "listings" / f"{h.hexdigest()[:24]}.json"

    def _save_listing(self, source: str | Sequence[str], listed: list[tuple[str, ObjectInfo]]
                      ) -> None:
        """Keeps what ``source`` listed, so that the shards can be read from the cache
        while the store cannot be reached."""
        path = self._listing_file(source)
        with contextlib.suppress(OSError):
            path.parent.mkdir(exist_ok=True)
            write_json_atomic(path, [[u, i.key, i.size, i.etag, i.mtime_ns, i.version]
                                     for u, i in listed])  # fmt: skip

    def _cached_listing(self, source: str | Sequence[str], error: OSError
                        ) -> list[tuple[str, ObjectInfo]]:
        """The last listing of ``source`` when every shard of it is in the cache (and
        its index in a view): the store is down, the node has what it needs. Else the
        store's error."""
        try:
            with open(self._listing_file(source), encoding="utf-8") as f:
                rows = json.load(f)
            listed = [(u, ObjectInfo(k, size, etag, mtime, version))
                      for u, k, size, etag, mtime, version in rows]  # fmt: skip
        except (OSError, ValueError, TypeError):
            raise error from None
        self._listings = {}
        self.entries = [CacheEntry(u, i.etag, i.size) for u, i in listed]
        index = self.cache.root / "views" / self._view_key() / "index.fidx"
        if not listed or not index.exists() or not all(
            self.cache.path(e).exists() for e in self.entries
        ):
            raise error
        log.warning(
            "fastload: %s; reading the %d shards cached in '%s', unchecked",
            error.args[-1] if error.args else error, len(listed), self.cache.root,
        )
        return listed

    def _listing_index(self, listed: list[tuple[str, ObjectInfo]]
                       ) -> list[tuple[str, ObjectInfo]]:
        """The index objects beside the shards (URL and listing), the compressed one
        first where it can be decoded, if the shards share a folder and the object is
        newer than every shard (an index written before a shard is stale)."""
        dirs = {_dir_of(u) for u, _ in listed}
        if len(dirs) != 1:
            return []
        d = dirs.pop()
        newest = max(i.mtime_ns for _, i in listed)
        names = [INDEX_OBJECT_ZST, INDEX_OBJECT] if _core.zstd_available() else [INDEX_OBJECT]
        out = []
        for name in names:
            info = self._listings.get(d, {}).get(d + name)
            if info is not None and info.mtime_ns >= newest:
                out.append((d + name, info))
        return out

    # --- the index -----------------------------------------------------------------------

    def _view_key(self) -> str:
        h = hashlib.sha256()
        for e in self.entries:
            h.update(f"{e.url}\0{e.etag}\0{e.size}\n".encode())
        return h.hexdigest()[:24]

    def _stored(self) -> list[str]:
        """The shard paths the index records, relative to the view: the keys relative
        to the shards' common folder."""
        common = os.path.commonpath([self._key(u) for u in self.urls]) if len(self.urls) > 1 \
            else os.path.dirname(self._key(self.urls[0]))
        base = f"{common}/" if common else ""
        return [self._key(u)[len(base):] if self._key(u).startswith(base) else self._key(u)
                for u in self.urls]

    def index(self) -> ShardIndex:
        """The index of these shards (from the index object, kept, or built now: once
        per node, the other processes wait and open it)."""
        view = self.cache.root / "views" / self._view_key()
        path = view / "index.fidx"
        self._view, self._links = view, self._stored()
        with contextlib.suppress(FileNotFoundError, IndexFormatError):
            return ShardIndex.open(path, check=False)
        view.mkdir(parents=True, exist_ok=True)
        with node_lock(path):
            with contextlib.suppress(FileNotFoundError, IndexFormatError):
                return ShardIndex.open(path, check=False)
            if not any(self._fetch_index_object(url, info, path)
                       for url, info in self._index_objects):
                self._build(path, self._links)
            return ShardIndex.open(path, check=False)

    def _fetch_index_object(self, url: str, info: ObjectInfo, dest: Path) -> bool:
        """Downloads the index object ``url`` (decoded, if it is the compressed one) to
        ``dest`` when it describes exactly these shards (paths and sizes); False
        otherwise (a bad or foreign object is not used: the caller tries the next)."""
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        # In parts, several in flight: an index of 200,000 samples is 28 MB (2.8 MB
        # compressed), and the first sample waits for all of it.
        fetch = store_fetcher(ByUrl(self.store), str, _INDEX_PART)
        entry = CacheEntry(url, info.etag, info.size)
        try:
            # Written into a file reserved in the cache at the index's size (it counts
            # against the limit); a compressed one is decoded into memory first.
            if url.endswith(".zst"):
                packed = bytearray(info.size)
                got_bytes = 0
                counting = threading.Lock()  # parts arrive on several threads

                def keep(at: int, data: Any) -> None:
                    nonlocal got_bytes
                    packed[at:at + len(data)] = data
                    with counting:
                        got_bytes += len(data)

                fetch(entry, keep)
                if got_bytes != info.size:
                    raise stage_error(errno.EIO, f"'{url}': {got_bytes} bytes read, "
                                      f"{info.size} listed", url)
                decoded = os.memfd_create("fastload-index", os.MFD_CLOEXEC)
                try:
                    # An index is about ten times its compressed size; more than a
                    # thousand times is not an index (and must not fill the memory).
                    _core.decompress_to(packed, "zstd", decoded, 1000 * info.size + (1 << 20),
                                        url)
                    del packed
                    size = os.fstat(decoded).st_size
                    fd = self.cache.reserve_file(tmp, size)
                    try:
                        at = 0
                        while at < size:
                            n = os.sendfile(fd, decoded, at, size - at)
                            if n <= 0:
                                raise stage_error(errno.EIO, f"'{tmp}': short copy", str(tmp))
                            at += n
                    finally:
                        os.close(fd)
                finally:
                    os.close(decoded)
            else:
                fd = self.cache.reserve_file(tmp, info.size)
                written = [0]
                counting = threading.Lock()

                def write(at: int, data: Any) -> None:
                    pwrite_all(fd, data, at, tmp)
                    with counting:
                        written[0] += len(memoryview(data))

                try:
                    fetch(entry, write)
                finally:
                    os.close(fd)
                if written[0] != info.size:
                    raise stage_error(errno.EIO, f"'{url}': {written[0]} bytes read, "
                                      f"{info.size} listed", url)
            native = _core.Index(os.fspath(tmp), check_shards=False)
            got = [native.shard(i) for i in range(native.shard_count)]
            del native
        except (IndexFormatError, TarFormatError, FileNotFoundError, SourceChangedError):
            tmp.unlink(missing_ok=True)
            return False
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        names = [os.path.basename(self._key(u)) for u in self.urls]
        if [g[0] for g in got] != names or [g[2] for g in got] != [e.size for e in self.entries]:
            tmp.unlink(missing_ok=True)
            return False
        os.replace(tmp, dest)
        return True

    def _build(self, dest: Path, stored: list[str]) -> None:
        """Builds the index from each shard's tar headers: every shard passes through the
        cache, its headers scanned (natively, into memory) while it is pinned; the index
        is then assembled from the scans and written into a file reserved in the cache
        at its size (no copy of a shard is kept: the cache stays within its limit)."""
        scans: list[Any] = [None] * len(self.entries)

        def one(i: int) -> None:
            with self.pinned_one(i) as pin:
                try:
                    scans[i] = _core.scan_shard(os.fspath(pin.path))
                except (TarFormatError, IndexFormatError) as e:
                    raise type(e)(f"'{self.urls[i]}': {e}") from None

        with ThreadPoolExecutor(_INDEX_IN_FLIGHT, thread_name_prefix="fastload-index") as pool:
            list(pool.map(one, range(len(self.entries))))
        image = _core.build_index_scanned(scans, self.urls, stored, "error")
        scans.clear()  # freed before the index is written
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        fd = self.cache.reserve_file(tmp, len(image))
        try:
            image.write(fd, os.fspath(tmp))
            os.fsync(fd)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def _link(self, shard: int) -> None:
        """Links the path the index records for ``shard`` in the view to its cache entry,
        unless it is there: made when the shard is first pinned, not all at once with the
        index (a link costs about as much as a small request: 70 ms for 200 shards)."""
        view = getattr(self, "_view", None)
        if view is None:  # no index asked for yet: nothing reads through the view
            return
        link = view / self._links[shard]
        if os.path.lexists(link):
            return
        link.parent.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(self.cache.path(self.entries[shard]), link.parent)
        tmp = link.with_name(f".{link.name}.{os.getpid()}.{threading.get_ident()}.lnk")
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, link)

    # --- reading -------------------------------------------------------------------------

    def fetcher(self) -> Any:
        return store_fetcher(ByUrl(self.store), str)

    def _via(self) -> Any:
        """In a process forked after obstore was used: downloads by the helper."""
        if not _fetchd.forked():
            return None
        cache, options = self.cache, self.storage_options

        def download(entry: CacheEntry, wait: bool, keep_free: int | None) -> bool | None:
            return cast("bool | None", _fetchd.helper().call(
                "download", os.fspath(cache.root), cache.limit,
                (entry.url, entry.etag, entry.size), wait, keep_free, options,
            ))

        return download

    def pinned_one(self, shard: int, *, wait: bool = True) -> Pin:
        """Pins shard ``shard`` (downloading it first if needed). An object that changed
        on the server since it was listed raises SourceChangedError, and its cached
        versions are dropped."""
        entry = self.entries[shard]
        try:
            pin = self.cache.acquire(entry, self.fetcher(), wait=wait, via=self._via())
        except SourceChangedError as e:
            self.cache.drop(entry.url)
            raise stage_error(
                errno.EIO,
                f"'{entry.url}' changed on the server since its shards were listed "
                f"(ETag {entry.etag}); its cached copies were dropped: make the dataset "
                f"again to read the new version ({e})",
                entry.url, SourceChangedError,
            ) from None
        if pin is None:  # only if the download vanished at once (evicted by nobody: a bug)
            raise stage_error(errno.EIO, f"'{entry.url}' could not be kept in the cache "
                              f"'{self.cache.root}'", entry.url)
        try:
            self._link(shard)
        except BaseException:
            pin.release()
            raise
        return pin

    def min_limit(self, readers: int) -> int:
        """The smallest cache limit ``readers`` readers of these shards can share: each
        keeps the shard it reads pinned (until it moves on to the next), and one more
        needs room for its next shard, so the cache must hold the ``readers`` largest
        shards at once. (The cache's own files, :func:`._space.overhead`, take their room
        too: below that, readers take turns, giving back the pins of those not reading.)"""
        sizes = sorted((e.size for e in self.entries), reverse=True)
        return sum(sizes[:max(1, readers)])

    def check_one_fits(self) -> None:
        """ValueError if the limit cannot hold the largest shard beside the cache's own
        files (its index: known once it is built or fetched)."""
        limit = self.cache.limit
        own = _space.overhead(self.cache.root) + _space.slack(limit)
        if limit is not None and limit < self.largest + own:
            need = self.largest + own
            raise ValueError(
                f"cache_limit {human(limit)} ({limit} bytes) cannot hold the largest shard "
                f"({human(self.largest)}) beside the cache's own files in '{self.cache.root}' "
                f"(the index, listings and log: {human(own)}): raise cache_limit to at "
                f"least {human(need)} ({need} bytes)"
            )

    def prefetch(self, shard: int) -> bool | None:
        """Downloads shard ``shard`` if the cache has room now, keeping the room of the
        largest shard free for a reader, and no reader waits for room: True once it is
        cached, False when there is no room, None when another process or thread
        downloads it."""
        entry = self.entries[shard]
        if self.cache._valid(entry):
            return True
        try:
            return self.cache.prefetch(entry, self.fetcher(), self._via(), self.largest)
        except SourceChangedError:
            self.cache.drop(entry.url)
            return False  # the reader gets the error when it reaches the shard

    def read_range(self, shard: int, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of shard ``shard`` in one ranged GET (no cache)."""
        entry = self.entries[shard]
        t = time.monotonic()
        try:
            if _fetchd.forked():
                return memoryview(_fetchd.helper().call(
                    "range", entry.url, start, end, entry.etag, self.storage_options))
            return self.store(entry.url).get_range(self._key(entry.url), start, end, entry.etag)
        except SourceChangedError:
            self.cache.drop(entry.url)
            raise
        finally:
            count_get(t)


def header_skeleton(src: Path, dst: Path, size: int) -> None:
    """A sparse copy of tar ``src``: its header blocks at their offsets, holes for the
    members' data, the same size. The index builder reads headers only, so indexing it
    gives the index of ``src``. A failed write (a full disk) names ``dst``, and leaves
    no partial file."""
    try:
        _write_skeleton(src, dst, size)
    except OSError as e:
        dst.unlink(missing_ok=True)
        if e.filename is not None or e.errno is None:
            raise  # names its path already (opening src or dst)
        raise stage_error(
            e.errno, f"write the header skeleton '{dst}' of '{src}': {e.strerror}", str(dst)
        ) from e


def _write_skeleton(src: Path, dst: Path, size: int) -> None:
    with open(src, "rb") as f, open(dst, "wb") as out:
        try:
            tf = tarfile.open(fileobj=f, mode="r:")  # noqa: SIM115 - closed just below
        except tarfile.ReadError:  # not a tar: the builder says what is wrong with it
            f.seek(0)
            shutil.copyfileobj(f, out)
            return
        with tf:
            for ti in tf:
                f.seek(ti.offset)
                out.seek(ti.offset)
                out.write(f.read(ti.offset_data - ti.offset))
        out.truncate(size)

