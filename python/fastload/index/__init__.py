"""The shard index: a memory-mapped table of every sample of a set of webdataset-style
tar shards (``shard_index``), and the names of shard sets (``shards``: lists,
directories, globs, braces).

May import: ``errors``, ``_util``, ``_core``.
"""

from .shard_index import IndexMember, SampleInfo, ShardIndex, ShardInfo
from .shards import Shards, default_index_path, expand_braces, expand_shards

__all__ = [
    "IndexMember",
    "SampleInfo",
    "ShardIndex",
    "ShardInfo",
    "Shards",
    "default_index_path",
    "expand_braces",
    "expand_shards",
]
