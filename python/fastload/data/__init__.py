"""PyTorch datasets over indexed tar shards. This package is the only place that
imports torch."""

from .collate import PackedBatch, PackedField, collate
from .dataset import ShardIndexDataset
from .iterable import ShardIterableDataset

__all__ = ["PackedBatch", "PackedField", "ShardIndexDataset", "ShardIterableDataset", "collate"]
