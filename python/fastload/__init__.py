"""fastload: stage ML datasets to node-local disk, fast; read tar shards fast."""

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
from .stage import StageResult, VerifyResult, available_engines, stage, verify

__version__ = "0.1.0"

__all__ = [
    "ChecksumMismatchError",
    "FastloadError",
    "IndexFormatError",
    "NotEnoughSpaceError",
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
