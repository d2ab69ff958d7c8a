"""The node-local shard cache: whole objects downloaded once per node, kept under a
size limit, evicted least recently used first but never while a process reads them
(``store``); object-store shard sets read through it, with their index (``remote``).

May import: ``sources``, ``index``, ``errors``, ``_util``, ``_core``.
"""

from .remote import INDEX_OBJECT, RemoteShards, is_remote
from .store import CacheEntry, Pin, ShardCache

__all__ = ["INDEX_OBJECT", "CacheEntry", "Pin", "RemoteShards", "ShardCache", "is_remote"]
