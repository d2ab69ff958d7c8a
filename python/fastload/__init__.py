"""fastload: stage ML datasets to node-local disk, fast; read tar shards fast.

The package has one folder per part, in a one-way order: a part imports only itself and
the parts below it (siblings on one line never import each other). ``_LAYERS`` is that
order; tests/test_layers.py checks every import against it, function-level ones too.
This module is the public facade: it re-exports the API, and no module imports it.
"""

from typing import TYPE_CHECKING

from . import env
from .env import resolve
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
from .staging import StageResult, VerifyResult, available_engines, stage, verify

if TYPE_CHECKING:  # at run time, __getattr__ below imports them on first use
    from .data import Mix, PackedBatch, ShardIndexDataset, ShardIterableDataset, Stream
    from .data.collate import collate
    from .data.device import decode_images, to_device
    from .data.monitor import Monitor, monitor
    from .packing import PackResult, ShardWriter, pack, pack_dataset, register_encoder
    from .probing import ProbeResult, probe

_LAYERS = """
fastload.__main__
fastload.cli | fastload.torchvision
fastload.data | fastload.packing | fastload.probing
fastload.env
fastload.staging | fastload.cache
fastload.sources | fastload.index
fastload._util
fastload.errors
fastload._core
"""

_PACKING = ("PackResult", "ShardWriter", "pack", "pack_dataset", "register_encoder")

__version__: str  # __getattr__ below: importlib.metadata costs an import ~25 ms

__all__ = [
    "ChecksumMismatchError",
    "FastloadError",
    "IndexFormatError",
    "Mix",
    "Monitor",
    "NotEnoughSpaceError",
    "PackResult",
    "PackedBatch",
    "ProbeResult",
    "ShardIndex",
    "ShardIndexDataset",
    "ShardIterableDataset",
    "ShardWriter",
    "SourceChangedError",
    "StageError",
    "StageResult",
    "Stream",
    "TarFormatError",
    "UnsafeArchiveError",
    "UnsupportedFileError",
    "VerifyResult",
    "__version__",
    "available_engines",
    "collate",
    "decode_images",
    "env",
    "monitor",
    "pack",
    "pack_dataset",
    "probe",
    "register_encoder",
    "resolve",
    "stage",
    "to_device",
    "verify",
]


def __getattr__(name: str) -> object:
    # The datasets need torch, packing numpy: imported on first use, so `import
    # fastload` to stage a dataset imports neither (numpy's BLAS threads alone cost a
    # staging job CPU time). The version (importlib.metadata) and probe (statistics,
    # the object stores) likewise: every job step, training script and DataLoader
    # worker imports fastload, few of them ask for these (tests/test_imports.py).
    if name == "__version__":
        from ._util import version

        globals()["__version__"] = v = version()
        return v
    if name in ("probe", "ProbeResult"):
        from . import probing

        return getattr(probing, name)
    if name in _PACKING:
        from . import packing

        return getattr(packing, name)
    if name == "ShardIndexDataset":
        from .data import ShardIndexDataset

        return ShardIndexDataset
    if name == "ShardIterableDataset":
        from .data import ShardIterableDataset

        return ShardIterableDataset
    if name in ("Mix", "Stream"):
        from . import data as _data

        return getattr(_data, name)
    if name in ("monitor", "Monitor"):
        from .data import monitor as _monitor

        return getattr(_monitor, name)
    if name in ("collate", "PackedBatch", "to_device", "decode_images"):
        from . import data

        return getattr(data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
