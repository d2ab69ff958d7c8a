"""Downloading a reader's next shards ahead, in a background thread, while the cache has
room: the reader says which shard it is reading; the thread keeps the next ``depth``
shards of its order cached, never waiting for room (a full cache makes it wait for the
reader to move on, and the reader then downloads what it needs itself)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

from ..cache import RemoteShards

__all__ = ["Prefetcher"]

#: How long the thread waits before it looks for room again.
_RETRY = 0.1


class Prefetcher:
    def __init__(self, shards: RemoteShards, order: Sequence[int], depth: int) -> None:
        self._shards = shards
        self._order = list(order)
        self._at = {s: i for i, s in reversed(list(enumerate(self._order)))}
        self._depth = depth
        self._cur = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if depth > 0 and self._order:
            self._thread = threading.Thread(target=self._run, name="fastload-prefetch",
                                            daemon=True)
            self._thread.start()

    def reading(self, shard: int) -> None:
        """The reader is at ``shard`` (positions only move forward)."""
        with self._cond:
            at = self._at.get(shard, self._cur)
            if at > self._cur:
                self._cur = at
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()

    def _run(self) -> None:
        done: set[int] = set()
        while True:
            with self._cond:
                if self._stop:
                    return
                cur = self._cur
            todo = [s for s in self._order[cur:cur + 1 + self._depth] if s not in done]
            full = False
            for s in todo:
                with self._cond:
                    if self._stop or self._cur != cur:
                        break
                ok = False
                # A failure (server gone, object changed) is the reader's to report when
                # it gets to the shard; the thread just stops trying it.
                with contextlib.suppress(Exception):
                    ok = self._shards.prefetch(s)
                if not ok:
                    full = True
                    break
                done.add(s)
            with self._cond:
                if self._stop:
                    return
                if self._cur == cur:
                    self._cond.wait(_RETRY if full else None)
