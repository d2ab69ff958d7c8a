"""fastload: stage ML datasets to node-local disk, fast; read tar shards fast."""

from typing import TYPE_CHECKING

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
from .stage import StageResult, VerifyResult, available_engines, stage, verify

if TYPE_CHECKING:  # at run time, __getattr__ below imports it (and torch) on first use
    from .data import ShardIndexDataset

__version__ = "0.1.0"

__all__ = [
    "ChecksumMismatchError",
    "FastloadError",
    "IndexFormatError",
    "NotEnoughSpaceError",
    "ShardIndex",
    "ShardIndexDataset",
    "SourceChangedError",
    "StageError",
    "StageResult",
    "TarFormatError",
    "UnsafeArchiveError",
    "UnsupportedFileError",
    "VerifyResult",
    "__version__",
    "available_engines",
    "stage",
    "verify",
]


def __getattr__(name: str) -> object:
    # ShardIndexDataset needs torch: imported on first use, so `import fastload` never
    # imports torch.
    if name == "ShardIndexDataset":
        from .data import ShardIndexDataset

        return ShardIndexDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
