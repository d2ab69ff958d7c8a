"""Pins and forked processes: a flock belongs to the open file, which a forked child
shares, so a DataLoader worker forked while its parent held a pin would keep that entry
unevictable for its whole life. A child leaves the parent's locks to the parent and
takes its own."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any, Callable

from fastload.cache import ShardCache
from fastload.cache.store import CacheEntry, Pin

WAIT = 60.0  # a hang guard only


def fetch(entry: CacheEntry, write: Callable[[int, Any], None]) -> None:
    write(0, entry.url.encode().ljust(entry.size, b"."))


def child(cache: ShardCache, entry: CacheEntry, inherited: Pin, events: list[Any]) -> None:
    """Keeps the parent's Pin object alive (as a worker's copy of a reader would) and
    pins ``entry`` itself until told to let go."""
    pinned, let_go, released, end = events
    own = cache.acquire(entry, fetch)
    assert own is not None and own.path == inherited.path
    pinned.set()
    assert let_go.wait(WAIT)
    own.release()
    released.set()
    assert end.wait(WAIT)
    inherited.release()  # closes what the fork left in its place, not a lock


def test_a_forked_child_keeps_only_its_own_pins(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "c", limit=3000)
    a = CacheEntry("s3://b/a.tar", "e1", 2000)
    b = CacheEntry("s3://b/b.tar", "e1", 2000)  # room for one of them only
    pin = cache.acquire(a, fetch)
    assert pin is not None
    ctx = multiprocessing.get_context("fork")
    events = [ctx.Event() for _ in range(4)]
    proc = ctx.Process(target=child, args=(cache, a, pin, events))
    proc.start()
    try:
        assert events[0].wait(WAIT)
        pin.release()
        # The child's own pin holds a: no room for b.
        assert cache.acquire(b, fetch, wait=False) is None
        assert cache.path(a).exists()
        events[1].set()
        assert events[2].wait(WAIT)
        # The child let go of its pin, and the parent of its own: a is evicted for b,
        # although the child, holding the parent's Pin object, still runs.
        got = cache.acquire(b, fetch, wait=False)
        assert got is not None, "the child still holds the parent's pin of a"
        got.release()
        assert not cache.path(a).exists()
        assert ("evict", cache.path(a).name) in [(op, n) for _, op, n, _ in cache.events()]
    finally:
        events[3].set()
        proc.join(WAIT)
    assert proc.exitcode == 0
