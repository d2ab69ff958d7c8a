"""ShardCache: a node-local cache of whole objects (tar shards) with a size limit,
shared by every process of the node through the file system and ``flock`` only.

Layout under ``root``::

    shards/<entry>          complete objects (the only files read)
    shards/<entry>.part     a download in progress: created at full size (sparse) under
                            the cache lock, so it counts against the limit at once, and
                            flock-ed by its downloader for as long as it lives
    state/<entry>.pin       readers hold a shared flock while they read <entry>
    state/<entry>.dl        the downloader of <entry> holds an exclusive flock
    state/lock              the cache lock: taken (briefly) to reserve room and evict
    state/waiting           readers waiting for room hold a shared flock (prefetching
                            stands back meanwhile)

``<entry>`` is ``<hash of the URL>-<hash of the ETag>-<base name>``: another version of
an object is another entry, and an entry is only ever whole (renamed into place after
its size was checked), so a cached file is never partly one version and partly another.

Contracts:

- The bytes in ``shards/`` (entries plus reservations) never exceed ``limit``. Room is
  reserved before a download starts; when there is none, the least recently used
  entries that no process has pinned are removed; if that is not enough the caller
  waits (or, for prefetching, gives up).
- Prefetching never takes room a reader needs: a prefetch reserves room only while no
  reader waits for room (a waiting reader holds a shared ``flock`` on ``state/waiting``;
  a prefetch tries it exclusively, under the cache lock) and only if ``keep_free``
  bytes stay free beside it (the room of the next shard a reader asks for). What a
  prefetch downloaded is unpinned as soon as it is in place: evictable like any entry.
- A pin is a shared ``flock`` on the entry's pin file: eviction takes it exclusively and
  without waiting, so a pinned entry is never removed. The kernel drops flocks when their
  holder dies (``kill -9`` included): nothing stale stays behind, there is no shared
  memory.
- A crashed downloader leaves a ``.part`` nobody locks; the next scan removes it. A
  ``.part`` is never read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._util import human, pwrite_all
from ..errors import SourceChangedError, stage_error
from ..sources.retry import process_retries

if TYPE_CHECKING:
    from ..sources.objstore import ObjectStore

__all__ = ["COUNTERS", "CacheEntry", "Counters", "Pin", "ShardCache", "count_get"]

#: How often a reader waiting for room or for another process's download looks again.
_POLL = 0.05
#: A reader gives up waiting for room after this long (every byte pinned by others).
WAIT_FOR_ROOM = 600.0
#: Objects above this size are fetched in parallel ranged GETs of this size.
PART = 16 << 20
PARTS_IN_FLIGHT = 4

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class Counters:
    """This process's cache activity (``fastload.monitor`` reads it): reader pins that
    found their shard cached (``hits``) or not (``misses``), downloads and their bytes,
    evictions, object GETs and the seconds they took (summed over the GETs in flight),
    and the retries of this process's object-store requests (``retries``: the retry
    policy's count, :func:`fastload.sources.retry.process_retries`, for every request
    the process made, the cache's and any other). Counted where the work runs: the
    downloads of a DataLoader worker forked after obstore was used run in the process
    serving it (:mod:`fastload.cache._fetchd`)."""

    FIELDS = ("hits", "misses", "downloads", "download_bytes", "evictions", "evicted_bytes",
              "gets", "get_seconds", "retries")  # fmt: skip

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._v = dict.fromkeys(self.FIELDS, 0.0)

    def add(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._v[name] += n

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._v)
        out["retries"] = float(process_retries().total())
        return out

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


COUNTERS = Counters()
os.register_at_fork(after_in_child=COUNTERS._after_fork)

#: The descriptors this process holds flocks through (pins, downloads, the cache lock).
#: A flock belongs to the open file, which a forked child shares: a DataLoader worker
#: forked while its parent held a pin would keep that entry pinned (unevictable) for its
#: whole life, after the parent let go of it. In a forked child these descriptors are
#: turned into /dev/null (a later close by the code that took them closes that): the
#: locks stay the parent's, and the child takes its own.
_HELD: set[int] = set()
_HELD_LOCK = threading.Lock()


def _hold(fd: int) -> int:
    with _HELD_LOCK:
        _HELD.add(fd)
    return fd


def _close(fd: int) -> None:
    """Closes a descriptor taken through :func:`_hold` (drops its flock)."""
    with _HELD_LOCK:
        _HELD.discard(fd)
    os.close(fd)


def _leave_locks_to_parent() -> None:
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()  # another thread may have held it at the fork
    if not _HELD:
        return
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for fd in _HELD:
            with contextlib.suppress(OSError):
                os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)
    _HELD.clear()


os.register_at_fork(after_in_child=_leave_locks_to_parent)
#: Called as ``on_event(op, entry name, size, start, end)`` (``time.monotonic()``) after
#: each download (op ``"download"``) and eviction (``"evict"``) this process makes; set by
#: ``fastload.monitor`` while it traces.
on_event: Callable[[str, str, int, float, float], None] | None = None


def _event(op: str, name: str, size: int, start: float) -> None:
    COUNTERS.add("downloads" if op == "download" else "evictions")
    COUNTERS.add("download_bytes" if op == "download" else "evicted_bytes", size)
    hook = on_event
    if hook is not None:
        hook(op, name, size, start, time.monotonic())


@dataclass(frozen=True)
class CacheEntry:
    """An object as cached: its URL, the ETag it must have, its size."""

    url: str
    etag: str | None
    size: int

    @property
    def name(self) -> str:
        u = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        e = hashlib.sha256((self.etag or "").encode()).hexdigest()[:8]
        base = _SAFE.sub("_", self.url.rstrip("/").rsplit("/", 1)[-1])[-80:]
        return f"{u}-{e}-{base}"

    @property
    def url_prefix(self) -> str:
        return self.name.split("-", 1)[0] + "-"


#: ``fetch(entry, write)``: reads the object (which must still have ``entry.etag``) and
#: calls ``write(offset, bytes)`` for its parts; raises SourceChangedError otherwise.
Fetcher = Callable[[CacheEntry, Callable[[int, Any], None]], None]
#: ``via(entry, wait, keep_free)``: downloads ``entry`` in another process, as
#: :meth:`ShardCache._download` would here.
Via = Callable[[CacheEntry, bool, "int | None"], "bool | None"]


class Pin:
    """An entry pinned for reading: ``path`` stays in place until ``release()``."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    def release(self) -> None:
        if self._fd >= 0:
            _close(self._fd)  # drops the shared flock
            self._fd = -1

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def _try_lock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class ShardCache:
    """The cache in ``root`` (created if missing), holding at most ``limit`` bytes of
    objects (``None``: no limit). Safe to use from many processes and threads at once."""

    def __init__(self, root: str | os.PathLike[str], limit: int | None = None) -> None:
        self.root = Path(os.path.abspath(root))
        self.limit = limit
        self.shards = self.root / "shards"
        self.state = self.root / "state"
        try:
            self.shards.mkdir(parents=True, exist_ok=True)
            self.state.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise stage_error(
                e.errno or errno.EIO, f"cannot use cache folder '{self.root}': {e.strerror}",
                str(self.root),
            ) from None
        #: Downloads this process made (entry names), for tests and reports.
        self.downloads: list[str] = []

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShardCache, (os.fspath(self.root), self.limit))

    # --- locks ---------------------------------------------------------------------------

    def _open(self, path: Path) -> int:
        return _hold(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = self._open(self.state / "lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _close(fd)

    def _log(self, op: str, name: str, size: int) -> None:
        """Appends ``pid op name size`` to ``state/events.log`` (one ``O_APPEND`` write
        per event: lines of concurrent processes never interleave), for tests and
        reports: what each process downloaded and evicted, in order."""
        line = f"{os.getpid()} {op} {name} {size}\n".encode()
        with contextlib.suppress(OSError):
            fd = os.open(self.state / "events.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND
                         | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def events(self) -> list[tuple[int, str, str, int]]:
        """The event log: (pid, "download" or "evict", entry name, size), in order."""
        try:
            text = (self.state / "events.log").read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            pid, op, name, size = line.split(" ")
            out.append((int(pid), op, name, int(size)))
        return out

    # --- what is there -------------------------------------------------------------------

    def check_fits(self, size: int, url: str) -> None:
        """A limit smaller than one object is an error (it could never be cached)."""
        if self.limit is not None and size > self.limit:
            raise ValueError(
                f"cache_limit {human(self.limit)} ({self.limit} bytes) is smaller than "
                f"'{url}' ({human(size)}, {size} bytes): raise cache_limit to at least the "
                "largest shard (a few shards' worth lets the next shards download ahead)"
            )

    def usage(self) -> int:
        """Bytes in the cache now: entries and live reservations (stale ones removed)."""
        with self._locked():
            return self._scan()[0]

    def _scan(self) -> tuple[int, list[tuple[int, str, int]]]:
        """(bytes used, complete entries as (mtime_ns, name, size)); removes the
        ``.part`` files of dead downloaders. Call with the cache lock held."""
        used = 0
        entries = []
        with os.scandir(self.shards) as it:
            for d in it:
                try:
                    st = d.stat()
                except FileNotFoundError:
                    continue
                if d.name.endswith(".part"):
                    try:
                        fd = _hold(os.open(d.path, os.O_RDONLY | os.O_CLOEXEC))
                    except FileNotFoundError:
                        continue
                    try:
                        if _try_lock(fd, fcntl.LOCK_EX):  # nobody writes it: a dead one
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(d.path)
                            continue
                    finally:
                        _close(fd)
                    used += st.st_size
                else:
                    used += st.st_size
                    entries.append((st.st_mtime_ns, d.name, st.st_size))
        return used, entries

    def _evict_one(self, name: str) -> bool:
        """Removes entry ``name`` unless a process has it pinned. Cache lock held."""
        fd = self._open(self.state / f"{name}.pin")
        try:
            if not _try_lock(fd, fcntl.LOCK_EX):
                return False
            try:
                size = os.stat(self.shards / name).st_size
                os.unlink(self.shards / name)
            except FileNotFoundError:
                return True
            self._log("evict", name, size)
            _event("evict", name, size, time.monotonic())
            return True
        finally:
            _close(fd)

    def _evict(self, bytes_: int, entries: list[tuple[int, str, int]]) -> bool:
        """Removes unpinned entries, least recently used first, until ``bytes_`` are
        freed; removes none (and returns False) if the unpinned ones cannot free that
        much. Cache lock held."""
        taken: list[tuple[int, str, int]] = []  # (pin descriptor locked, name, size)
        freed = 0
        try:
            for _, name, size in sorted(entries):
                if freed >= bytes_:
                    break
                fd = self._open(self.state / f"{name}.pin")
                if not _try_lock(fd, fcntl.LOCK_EX):  # pinned
                    _close(fd)
                    continue
                taken.append((fd, name, size))
                freed += size
            if freed < bytes_:
                return False
            for _, name, size in taken:
                with contextlib.suppress(FileNotFoundError):
                    t = time.monotonic()
                    os.unlink(self.shards / name)
                    self._log("evict", name, size)
                    _event("evict", name, size, t)
            return True
        finally:
            for fd, _, _ in taken:
                _close(fd)

    def _readers_waiting(self) -> bool:
        """Whether a reader waits for room now (holds ``state/waiting`` shared)."""
        fd = self._open(self.state / "waiting")
        try:
            return not _try_lock(fd, fcntl.LOCK_EX)
        finally:
            _close(fd)  # drops the exclusive flock, if taken

    def _reserve(self, entry: CacheEntry, keep_free: int | None = None) -> int | None:
        """Makes room for ``entry`` (evicting unpinned entries, least recently used
        first) and creates its ``.part`` at full size, flock-ed; returns its descriptor,
        or None when the pinned entries leave no room. ``keep_free`` (prefetching): None
        also while a reader waits for room, or unless ``keep_free`` bytes stay free
        beside ``entry``. Cache lock held."""
        need = entry.size
        if keep_free is not None and self.limit is not None:
            if self._readers_waiting():
                return None
            need += keep_free
        used, entries = self._scan()
        if self.limit is not None and used + need > self.limit \
                and not self._evict(used + need - self.limit, entries):
            return None
        part = self.shards / f"{entry.name}.part"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)  # a dead downloader's (we hold the entry's download lock)
        fd = _hold(os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, entry.size)
        return fd

    # --- pinning and fetching ------------------------------------------------------------

    def path(self, entry: CacheEntry) -> Path:
        return self.shards / entry.name

    def _valid(self, entry: CacheEntry) -> bool:
        try:
            return os.stat(self.path(entry)).st_size == entry.size
        except FileNotFoundError:
            return False

    def acquire(
        self,
        entry: CacheEntry,
        fetch: Fetcher,
        *,
        wait: bool = True,
        via: Via | None = None,
    ) -> Pin | None:
        """Pins ``entry``, downloading it first if it is not cached (one process per node
        downloads; the others wait for it). ``wait=False``: returns None instead of
        waiting for room or for another process's download. ``via(entry, wait,
        keep_free)``: another process downloads (see :mod:`fastload.cache._fetchd`)."""
        pin_fd, ok = self._pinned(entry, fetch, wait, None, via)
        if not ok:
            _close(pin_fd)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path(entry))  # least recently used = oldest mtime
        return Pin(pin_fd, self.path(entry))

    def prefetch(self, entry: CacheEntry, fetch: Fetcher, via: Via | None = None,
                 keep_free: int = 0) -> bool | None:  # fmt: skip
        """Downloads ``entry`` without waiting, if there is room for it with
        ``keep_free`` bytes to spare and no reader waits for room: True once it is
        cached, False when there is no such room now, None when another process or
        thread is downloading it."""
        pin_fd, ok = self._pinned(entry, fetch, False, keep_free, via)
        _close(pin_fd)
        return ok

    def _pinned(self, entry: CacheEntry, fetch: Fetcher, wait: bool, keep_free: int | None,
                via: Via | None) -> tuple[int, bool | None]:
        """Takes a pin of ``entry`` (its descriptor, for the caller to close) and
        downloads it unless it is cached: True once it is in place, False without room,
        None while another downloader has it (``wait`` False)."""
        self.check_fits(entry.size, entry.url)
        pin_fd = self._open(self.state / f"{entry.name}.pin")
        try:
            fcntl.flock(pin_fd, fcntl.LOCK_SH)
            if self._valid(entry):
                if keep_free is None:  # a reader's pin, not a prefetch
                    COUNTERS.add("hits")
                return pin_fd, True
            if keep_free is None:
                COUNTERS.add("misses")
            ok = self._download(entry, fetch, wait, keep_free) if via is None \
                else via(entry, wait, keep_free)
            return pin_fd, None if ok is None else bool(ok) and self._valid(entry)
        except BaseException:
            _close(pin_fd)
            raise

    def _download(self, entry: CacheEntry, fetch: Fetcher, wait: bool,
                  keep_free: int | None = None) -> bool | None:
        """Downloads ``entry`` into place, with its pin held by the caller: True once it
        is in place; with ``wait`` False, False when there is no room and None when
        another downloader has it. ``keep_free`` (a prefetch): see :meth:`prefetch`."""
        dl_fd = self._open(self.state / f"{entry.name}.dl")
        waiting = -1  # state/waiting, held shared while this reader waits for room
        try:
            if wait:
                fcntl.flock(dl_fd, fcntl.LOCK_EX)  # another process's download: wait
            elif not _try_lock(dl_fd, fcntl.LOCK_EX):
                return None  # another downloader has it
            if self._valid(entry):  # it was downloaded while we waited
                return True
            deadline = time.monotonic() + WAIT_FOR_ROOM
            while True:
                with self._locked():
                    part_fd = self._reserve(entry, keep_free)
                if part_fd is not None:
                    break
                if not wait:
                    return False
                if waiting < 0:  # from now on no prefetch takes the room that frees
                    waiting = self._open(self.state / "waiting")
                    fcntl.flock(waiting, fcntl.LOCK_SH)
                if time.monotonic() > deadline:
                    raise stage_error(
                        errno.ENOSPC,
                        f"cache '{self.root}' (limit {human(self.limit or 0)}) stayed full of "
                        f"shards other readers hold for {WAIT_FOR_ROOM:.0f} s: cannot fetch "
                        f"'{entry.url}'; raise cache_limit (every process reading through "
                        "this cache keeps one shard pinned)",
                        entry.url,
                    )
                time.sleep(_POLL)
            if waiting >= 0:
                _close(waiting)
                waiting = -1
            part = self.shards / f"{entry.name}.part"
            started = time.monotonic()
            try:
                self._fill(entry, part_fd, fetch)
                # Under the lock: a scan between listing the .part and stat-ing it would
                # count neither name, and let another download past the limit.
                with self._locked():
                    os.rename(part, self.path(entry))
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)
                raise
            finally:
                _close(part_fd)
            self.downloads.append(entry.name)
            self._log("download", entry.name, entry.size)
            _event("download", entry.name, entry.size, started)
            return True
        finally:
            if waiting >= 0:
                _close(waiting)
            _close(dl_fd)

    def _fill(self, entry: CacheEntry, fd: int, fetch: Fetcher) -> None:
        written = [0]
        lock = threading.Lock()

        def write(offset: int, data: Any) -> None:
            view = memoryview(data)
            if offset + len(view) > entry.size:
                raise stage_error(errno.EIO, f"'{entry.url}' is longer than listed "
                                  f"({entry.size} bytes)", entry.url, SourceChangedError)
            pwrite_all(fd, view, offset, self.shards / f"{entry.name}.part")
            with lock:
                written[0] += len(view)

        fetch(entry, write)
        if written[0] != entry.size:
            raise stage_error(
                errno.EIO,
                f"'{entry.url}': {written[0]} bytes arrived, {entry.size} were listed",
                entry.url, SourceChangedError,
            )

    def drop(self, url: str) -> int:
        """Removes every unpinned entry of ``url`` (any version); returns how many."""
        prefix = CacheEntry(url, None, 0).url_prefix
        n = 0
        with self._locked():
            for name in os.listdir(self.shards):
                if name.startswith(prefix) and not name.endswith(".part") \
                        and self._evict_one(name):
                    n += 1
        return n


class ByUrl:
    """The ``get``/``get_range``/``stream_range``/``fetch_parts`` of objects named by
    whole URLs, each through the store ``store_of(url)`` gives for its bucket (so one
    fetcher serves shards of several buckets; the helper and the server of forked
    workers use it with their own settings)."""

    def __init__(self, store_of: Callable[[str], ObjectStore]) -> None:
        self._store_of = store_of

    def get(self, url: str, etag: str | None) -> memoryview:
        return self._store_of(url).get(_key(url), etag)

    def get_range(self, url: str, start: int, end: int, etag: str | None) -> memoryview:
        return self._store_of(url).get_range(_key(url), start, end, etag)

    def stream_range(self, url: str, start: int, end: int, etag: str | None) -> Iterator[Any]:
        return self._store_of(url).stream_range(_key(url), start, end, etag)

    def fetch_parts(self, url: str, etag: str | None, size: int,
                    write: Callable[[int, Any], None], **kw: Any) -> None:  # fmt: skip
        self._store_of(url).fetch_parts(_key(url), etag, size, write, **kw)


def _key(url: str) -> str:
    from ..sources.objstore import split_url

    return split_url(url)[2]


def count_get(start: float) -> None:
    """Counts one GET (answered or not) that started at ``start``."""
    COUNTERS.add("gets")
    COUNTERS.add("get_seconds", time.monotonic() - start)


def store_fetcher(store: Any, key_of: Callable[[str], str], part_size: int = PART) -> Fetcher:
    """A Fetcher over an :class:`~fastload.sources.objstore.ObjectStore`: its
    ``fetch_parts``, ranged GETs of ``part_size`` bytes, :data:`PARTS_IN_FLIGHT` at a
    time, every one with ``If-Match`` on the listed ETag, each body written in pieces as
    they arrive (a fresh buffer of a shard's size per download cost a page fault per
    4 KiB, and as much system time as the download itself)."""

    def fetch(entry: CacheEntry, write: Callable[[int, Any], None]) -> None:
        store.fetch_parts(key_of(entry.url), entry.etag, entry.size, write,
                          part_size=part_size, in_flight=PARTS_IN_FLIGHT,
                          on_get=count_get)  # fmt: skip

    return fetch
