"""Fetchers of whole objects for the cache: :class:`ByUrl` (objects named by whole URLs,
each through its bucket's store) and :func:`store_fetcher` (parallel ranged GETs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ._counters import count_get

if TYPE_CHECKING:
    from ..sources.objstore import ObjectStore
    from .store import CacheEntry, Fetcher

__all__ = ["PART", "PARTS_IN_FLIGHT", "ByUrl", "store_fetcher"]

#: Objects above this size are fetched in parallel ranged GETs of this size.
PART = 16 << 20
PARTS_IN_FLIGHT = 4


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
