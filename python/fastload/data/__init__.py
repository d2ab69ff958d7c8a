"""PyTorch datasets over indexed tar shards. This package is the only place that
imports torch.

May import: ``env``, ``staging``, ``sources``, ``index``, ``errors``, ``_util``, ``_core``
(never ``packing`` or the CLI).
"""

from typing import Any

from torch.utils.data import _utils as _torch_data_utils

from .. import _core
from .collate import PackedBatch, PackedField, collate
from .dataset import ShardIndexDataset
from .device import decode_images, to_device
from .iterable import ShardIterableDataset
from .mix import Stream
from .mixed import Mix

__all__ = [
    "Mix",
    "PackedBatch",
    "PackedField",
    "ShardIndexDataset",
    "ShardIterableDataset",
    "Stream",
    "collate",
    "decode_images",
    "to_device",
]


def _collate_payloads(batch: list[Any], *, collate_fn_map: Any = None) -> list[Any]:
    """torch's ``default_collate`` for a field of zero-copy payloads: a list, as it does
    for ``bytes`` (a worker sends payloads as bytes)."""
    return list(batch)


# So that DataLoader(ShardIndexDataset(...), batch_size=...) works with torch's own
# default_collate, as torch does for bytes; the map is the one default_collate consults
# (torch.utils.data._utils.collate.default_collate_fn_map).
_torch_data_utils.collate.default_collate_fn_map.setdefault(_core.Payload, _collate_payloads)
