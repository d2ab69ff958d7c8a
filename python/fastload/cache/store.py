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
                            stands back, idle readers give their pins back meanwhile)
    state/held/<pid>        the pins a process holds, and for which dataset (for the
                            error of a reader that finds no room)

``<entry>`` is ``<hash of the URL>-<hash of the ETag>-<base name>``: another version of
an object is another entry, and an entry is only ever whole (renamed into place after
its size was checked), so a cached file is never partly one version and partly another.

Contracts:

- The bytes in ``shards/`` (entries plus reservations) never exceed ``limit``. Room is
  reserved before a download starts; when there is none, the least recently used
  entries that no process has pinned are removed; if that is not enough the caller
  waits (or, for prefetching, gives up). A pin held by a reader that is not reading is
  given back while a reader waits (:mod:`._holders`); a wait during which nothing
  changes in the cache for :data:`WAIT_FOR_ROOM` seconds fails, naming who holds what.
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
from typing import Any

from .._util import human, pwrite_all
from ..errors import SourceChangedError, stage_error
from . import _holders, _space
from ._counters import COUNTERS, Counters, count_get
from ._fetchers import PART, PARTS_IN_FLIGHT, ByUrl, store_fetcher

__all__ = ["COUNTERS", "PART", "PARTS_IN_FLIGHT", "ByUrl", "CacheEntry", "Counters", "Pin",
           "ShardCache", "count_get", "store_fetcher"]

#: How often a reader waiting for room or for another process's download looks again.
_POLL = 0.05


def _wait_setting() -> float:
    raw = os.environ.get("FASTLOAD_CACHE_WAIT", "")
    try:
        return float(raw) if raw else 30.0
    except ValueError:
        raise ValueError(f"FASTLOAD_CACHE_WAIT must be a number of seconds, not {raw!r}"
                         ) from None


#: A reader waiting for room gives up once nothing has changed in the cache for this
#: long (no download in progress, no entry pinned anew, downloaded or evicted): the
#: readers holding the room are stuck, or need more room at once than the limit.
#: ``FASTLOAD_CACHE_WAIT`` (seconds) sets it.
WAIT_FOR_ROOM = _wait_setting()

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


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
    """An entry pinned for reading: ``path`` stays in place until ``release()``. With
    ``root``, recorded as held by this process for ``label`` (see :mod:`._holders`)."""

    def __init__(self, fd: int, path: Path, root: Path | None = None, label: str = "") -> None:
        self._fd = fd
        self.path = path
        self._root = root
        if root is not None:
            _holders.record(root, fd, path.name, label)

    def release(self) -> None:
        if self._fd >= 0:
            if self._root is not None:
                _holders.forget(self._root, self._fd)
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
    objects (``None``: no limit). Safe to use from many processes and threads at once.
    ``owner`` names the reader in what others are told about the pins it holds."""

    def __init__(self, root: str | os.PathLike[str], limit: int | None = None,
                 owner: str = "") -> None:  # fmt: skip
        self.root = Path(os.path.abspath(root))
        self.limit = limit
        self.owner = owner
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
        return (ShardCache, (os.fspath(self.root), self.limit, self.owner))

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
        reports: what each process downloaded and evicted, in order. Past
        :data:`._space.LOG_MAX` bytes the log becomes ``events.log.1`` (the one before is
        dropped), so it holds a bounded share of the cache (:func:`._space.overhead`)."""
        line = f"{os.getpid()} {op} {name} {size}\n".encode()
        log = self.state / "events.log"
        with contextlib.suppress(OSError):
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            try:
                if os.write(fd, line) and os.fstat(fd).st_size > _space.LOG_MAX:
                    os.replace(log, log.with_name("events.log.1"))  # renames this inode
            finally:
                os.close(fd)

    def events(self) -> list[tuple[int, str, str, int]]:
        """The event log: (pid, "download" or "evict", entry name, size), in order (its
        last :data:`._space.LOG_MAX` bytes at least)."""
        text = ""
        for name in ("events.log.1", "events.log"):
            with contextlib.suppress(FileNotFoundError):
                text += (self.state / name).read_text()
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
        """Bytes in the cache now: entries, live reservations (stale ones removed) and
        the cache's own files (indexes, listings, logs: :func:`._space.overhead`)."""
        with self._locked():
            return self._scan()[0]

    def _scan(self) -> tuple[int, list[tuple[int, str, int]]]:
        """(bytes used, complete entries as (mtime_ns, name, size)); removes the
        ``.part`` files of dead downloaders. Call with the cache lock held."""
        used = _space.overhead(self.root)
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
        need = entry.size + _space.slack(self.limit)
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
        return Pin(pin_fd, self.path(entry), self.root, self.owner)

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
        try:
            if wait:
                fcntl.flock(dl_fd, fcntl.LOCK_EX)  # another process's download: wait
            elif not _try_lock(dl_fd, fcntl.LOCK_EX):
                return None  # another downloader has it
            if self._valid(entry):  # it was downloaded while we waited
                return True
            part_fd = self._room(entry.url, entry.size, wait,
                                 lambda: self._reserve(entry, keep_free))
            if part_fd is None:
                return False
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
            _close(dl_fd)

    def _room(self, url: str, size: int, wait: bool, take: Callable[[], int | None]
              ) -> int | None:
        """``take()`` under the cache lock (it makes room and reserves it, or returns
        None) until it succeeds; with ``wait`` False, once. While waiting this reader
        holds ``state/waiting`` shared: no prefetch takes the room that frees, and idle
        readers give their pins back (:mod:`._holders`). Raises once nothing has changed
        in the cache for :data:`WAIT_FOR_ROOM` seconds, naming who holds what."""
        waiting = -1
        seen: object = None  # what the cache looked like when it last changed
        since = time.monotonic()
        try:
            while True:
                with self._locked():
                    fd = take()
                    now = _space.progress(self.shards) if fd is None and wait else None
                if fd is not None or not wait:
                    return fd
                if waiting < 0:
                    waiting = self._open(self.state / "waiting")
                    fcntl.flock(waiting, fcntl.LOCK_SH)
                if now is None or now != seen:  # a download in progress, or a change
                    seen, since = now, time.monotonic()
                elif time.monotonic() - since > WAIT_FOR_ROOM:
                    raise _space.no_room(self.root, self.limit, url, size, WAIT_FOR_ROOM)
                time.sleep(_POLL)
        finally:
            if waiting >= 0:
                _close(waiting)

    def reserve_file(self, path: Path, size: int) -> int:
        """Creates ``path``, a file of the cache's own under its root (an index), at
        ``size`` bytes (sparse) once there is room for it, as for a download: it counts
        against the limit from then on. Returns its descriptor (the caller writes it and
        renames it into place, or removes it)."""

        def take() -> int | None:
            used, entries = self._scan()
            need = size + _space.slack(self.limit)
            if self.limit is not None and used + need > self.limit \
                    and not self._evict(used + need - self.limit, entries):
                return None
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            os.ftruncate(fd, size)
            return fd

        fd = self._room(os.fspath(path), size, True, take)
        assert fd is not None
        return fd

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


