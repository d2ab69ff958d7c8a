"""This process's cache activity: :data:`COUNTERS` (``fastload.monitor`` reads it)."""

from __future__ import annotations

import os
import threading
import time

from ..sources.retry import process_retries

__all__ = ["COUNTERS", "Counters", "count_get"]


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


def count_get(start: float) -> None:
    """Counts one GET (answered or not) that started at ``start``."""
    COUNTERS.add("gets")
    COUNTERS.add("get_seconds", time.monotonic() - start)
