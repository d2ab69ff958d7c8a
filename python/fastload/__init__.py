"""fastload: stage ML datasets to node-local disk, fast; read tar shards fast."""

from typing import TYPE_CHECKING

from . import env
from .errors import (
    ChecksumMismatchError,
    FastloadError,
    IndexFormatError,
    NotEnoughSpaceError,
    SourceChangedError,
    StageError,
    TarFormatError,
    UnsafeArchiveError,
    UnsupportedFileError,
)
from .index import ShardIndex
from .resolve import resolve
from .stage import StageResult, VerifyResult, available_engines, stage, verify

if TYPE_CHECKING:  # at run time, __getattr__ below imports them on first use
    from .data import PackedBatch, ShardIndexDataset, ShardIterableDataset, collate
    from .writer import PackResult, ShardWriter, pack, pack_dataset, register_encoder

_WRITER = ("PackResult", "ShardWriter", "pack", "pack_dataset", "register_encoder")

__version__ = "0.1.0"

__all__ = [
    "ChecksumMismatchError",
    "FastloadError",
    "IndexFormatError",
    "NotEnoughSpaceError",
    "PackResult",
    "PackedBatch",
    "ShardIndex",
    "ShardIndexDataset",
    "ShardIterableDataset",
    "ShardWriter",
    "SourceChangedError",
    "StageError",
    "StageResult",
    "TarFormatError",
    "UnsafeArchiveError",
    "UnsupportedFileError",
    "VerifyResult",
    "__version__",
    "available_engines",
    "collate",
    "env",
    "pack",
    "pack_dataset",
    "register_encoder",
    "resolve",
    "stage",
    "verify",
]


def __getattr__(name: str) -> object:
    # The datasets need torch, the writer numpy: imported on first use, so `import
    # fastload` to stage a dataset imports neither (numpy's BLAS threads alone cost a
    # staging job CPU time).
    if name in _WRITER:
        from . import writer

        return getattr(writer, name)
    if name == "ShardIndexDataset":
        from .data import ShardIndexDataset

        return ShardIndexDataset
    if name == "ShardIterableDataset":
        from .data import ShardIterableDataset

        return ShardIterableDataset
    if name in ("collate", "PackedBatch"):
        from . import data

        return getattr(data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
