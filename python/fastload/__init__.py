"""fastload: stage ML datasets to node-local disk, fast; read tar shards fast.

The package has one folder per part, in a one-way order: a part imports only itself and
the parts below it (siblings on one line never import each other). ``_LAYERS`` is that
order; tests/test_layers.py checks every import against it, function-level ones too.
This module is the public facade: it re-exports the API, and no module imports it.

Only the exceptions are imported with the package; every other name is imported on first
use (``__getattr__`` below), so `import fastload` in a job step, a training script or a
DataLoader worker costs a few ms, and each path imports what it uses: a local stage no
object store (asyncio, ssl, obstore), no version lookup (importlib.metadata), no torch or
numpy (tests/test_imports.py).
"""

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
from .sources.base import set_site_loader as _set_site_loader

if TYPE_CHECKING:  # at run time, __getattr__ below imports them on first use
    from . import env
    from .data import Mix, PackedBatch, ShardIndexDataset, ShardIterableDataset, Stream
    from .data.collate import collate
    from .data.device import decode_images, to_device
    from .data.files import FileDataset
    from .data.monitor import Monitor, monitor
    from .env import resolve
    from .index import ShardIndex
    from .packing import PackResult, ShardWriter, pack, pack_dataset, register_encoder
    from .probing import ProbeResult, probe
    from .staging import StageResult, VerifyResult, available_engines, stage, verify
    from .staging.background import Staging

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

# name -> the module it comes from, imported on first use. The datasets need torch,
# packing numpy (numpy's BLAS threads alone cost a staging job CPU time); staging, env
# and the index are cheaper but not free, and many imports of fastload use none of them.
_LAZY = {
    **dict.fromkeys(("PackResult", "ShardWriter", "pack", "pack_dataset",
                     "register_encoder"), ".packing"),
    **dict.fromkeys(("ShardIndexDataset", "ShardIterableDataset", "Mix", "Stream",
                     "collate", "PackedBatch", "to_device", "decode_images"), ".data"),
    **dict.fromkeys(("monitor", "Monitor"), ".data.monitor"),
    **dict.fromkeys(("probe", "ProbeResult"), ".probing"),
    **dict.fromkeys(("StageResult", "VerifyResult", "available_engines", "stage",
                     "verify"), ".staging"),
    "ShardIndex": ".index",
    "FileDataset": ".data.files",
    "Staging": ".staging.background",
    "resolve": ".env",
}  # fmt: skip
# The parts, as attributes once imported (an `import fastload` used to import these).
_PARTS = ("cache", "data", "env", "index", "packing", "probing", "sources", "staging")

__version__: str  # __getattr__ below: importlib.metadata costs an import ~25 ms

__all__ = [
    "ChecksumMismatchError",
    "FastloadError",
    "FileDataset",
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
    "Staging",
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
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _PARTS:
        value = importlib.import_module(f".{name}", __name__)
    elif name == "__version__":
        from ._util import version

        value = version()
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next use finds it without asking again
    return value


def _site_storage() -> dict[str, object]:
    # The configuration file's [storage] tables, read where an object store is made
    # (env, which reads that file, is not imported with the package).
    from .env.config import storage_defaults

    return storage_defaults()


_set_site_loader(_site_storage)
