"""How the benchmarks import the peers that read their own formats (MosaicML streaming,
litdata, Hugging Face ``datasets``): skipped with a hint where one is not installed (with
CI set, failed: _guard.py), their warnings silenced. Imports nothing of the benchmarks' own
but _guard, so data.py (which builds the peers' data sets) and _peers.py (which reads
them) both stand on it."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from _guard import missing

STUBS = Path(__file__).resolve().parent / "_stubs"
HINT = "run scripts/bench-peers.sh to set up a benchmark venv with the peers"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Their warnings ignored: the suite turns warnings into errors, which is for fastload,
    not for the peers (mosaicml's LocalDataset leaves its index.json open, a
    ResourceWarning; their imports raise their dependencies' deprecation warnings)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _import(module: str, dist: str) -> ModuleType:
    if importlib.util.find_spec(module) is None:
        missing(f"{dist} is not installed ({HINT})")
    with quiet():
        try:
            return importlib.import_module(module)
        except ImportError as e:
            missing(f"{dist} does not import here: {e} ({HINT})")


def import_streaming() -> ModuleType:
    """mosaicml-streaming. ``import streaming`` imports streaming.vision, which imports
    torchvision; without a real torchvision (no CPU build here, and installing it would
    replace this torch build), a two-name stub from benchmarks/_stubs goes on sys.path
    first. Nothing the benchmarks call reaches it."""
    if importlib.util.find_spec("streaming") is None:
        missing(f"mosaicml-streaming is not installed ({HINT})")
    if str(STUBS) not in sys.path and importlib.util.find_spec("torchvision") is None:
        sys.path.append(str(STUBS))
    return _import("streaming", "mosaicml-streaming")


def import_litdata() -> ModuleType:
    return _import("litdata", "litdata")


def import_datasets() -> ModuleType:
    return _import("datasets", "Hugging Face datasets")
