"""Downloading a reader's next shards ahead, in background threads, while the cache has
room: the reader says which shard it is reading; the threads keep the shards of its
order from that one to ``depth`` after it cached, all of them downloading at once (one
download per thread: an object store serves several requests in flight much faster
than one after another, and the first batch needs several shards). They never wait for
room and never take room a reader needs (:meth:`RemoteShards.prefetch` keeps the room
of the largest shard free, and stands back while a reader waits for room): a full cache
makes a thread wait for the reader to move on, and the reader then downloads what it
needs itself."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

from ..cache import RemoteShards

__all__ = ["Prefetcher"]

#: How long a thread waits before it looks for room again.
_RETRY = 0.1
#: Downloads at once, whatever the depth.
_MAX_THREADS = 8


class Prefetcher:
    def __init__(self, shards: RemoteShards, order: Sequence[int], depth: int) -> None:
        self._shards = shards
        self._order = list(order)
        self._at = {s: i for i, s in reversed(list(enumerate(self._order)))}
        self._depth = depth
        self._cur = 0
        self._stop = False
        self._cond = threading.Condition()
        self._done: set[int] = set()  # cached (or failed: the reader reports those)
        self._busy: set[int] = set()  # being downloaded by a thread
        # A download found no room since the reader last moved, or less than _RETRY ago.
        self._full = False
        self._threads: list[threading.Thread] = []
        if depth > 0 and self._order:
            for i in range(min(depth + 1, _MAX_THREADS, len(self._order))):
                t = threading.Thread(target=self._run, name=f"fastload-prefetch-{i}",
                                     daemon=True)  # fmt: skip
                t.start()
                self._threads.append(t)

    def reading(self, shard: int) -> None:
        """The reader is at ``shard`` (positions only move forward)."""
        with self._cond:
            at = self._at.get(shard, self._cur)
            if at > self._cur:
                self._cur = at
                self._full = False
                self._cond.notify_all()

    def stop(self, *, settle: bool = False) -> None:
        """Ends the threads; with ``settle`` (the reader got to the end of its order:
        the shards it read are in place, a thread at most finishes a download's
        bookkeeping, its log line and counters, or one the reader did not need), returns
        once they have ended, so that an epoch ends with its downloads logged and
        counted and no thread of it left downloading."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if settle:  # (called by the reader, never by a thread of its own)
            for t in self._threads:
                t.join()

    def _next(self) -> int | None:
        """The first shard of the window that no thread has, or None (with the lock)."""
        if self._full:
            return None
        for s in self._order[self._cur:self._cur + 1 + self._depth]:
            if s not in self._done and s not in self._busy:
                return s
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                s = None
                while not self._stop and s is None:
                    s = self._next()
                    if s is None and not self._cond.wait(_RETRY if self._full else None):
                        self._full = False  # a while without news: look for room again
                if self._stop or s is None:
                    return
                self._busy.add(s)
            # A failure (server gone, object changed) is the reader's to report when it
            # gets to the shard; the threads just stop trying it. Another downloader
            # (the reader itself, often) finishes it without them.
            ok: bool | None = True
            with contextlib.suppress(Exception):
                ok = self._shards.prefetch(s)
            with self._cond:
                self._busy.discard(s)
                if ok is False:
                    self._full = True
                else:
                    self._done.add(s)
                self._cond.notify_all()
