"""PyTorch datasets over indexed tar shards. This package is the only place that
imports torch."""

from .dataset import ShardIndexDataset

__all__ = ["ShardIndexDataset"]
