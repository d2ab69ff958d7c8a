"""Packing: write samples into shuffled, indexed webdataset-style tar shards.

- ``writer``: :class:`ShardWriter`, one shard after another, and the value encoders;
- ``api``: :func:`pack` and :func:`pack_dataset`, which choose a pipeline:
  ``folder`` (a tree, a tar or a tar of tars, packed natively from a pure ``plan`` over
  the ``listing`` of the source) or ``dataset`` (a map-style dataset or an iterable, with
  worker processes).

May import: ``env``, ``staging``, ``sources``, ``index``, ``errors``, ``_util``,
``_core`` (never ``data`` or the CLI). Imports numpy: ``import fastload`` loads this
part only when one of its names is used.
"""

from .api import pack, pack_dataset
from .writer import PackResult, ShardWriter, encoders, parse_size, register_encoder

__all__ = [
    "PackResult",
    "ShardWriter",
    "encoders",
    "pack",
    "pack_dataset",
    "parse_size",
    "register_encoder",
]
