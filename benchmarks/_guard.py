"""What a benchmark needs from the machine (a tool, a peer, the netsim mount, fastload
itself): where it is missing the case is skipped, saying why; with ``CI`` set
(``CI=true``) it fails instead, since scripts/test.sh sets up everything the benchmarks
use (as tests/kit/tools.py does for the tests). Skips that are a case's design, not a
missing thing, stay plain ``pytest.skip`` and are listed in tests/allowed-skips.txt."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str) -> NoReturn:
    """Skips the case (``reason`` in the summary), or fails it under CI."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: scripts/test.sh sets up everything the benchmarks "
                    "use)", pytrace=False)  # fmt: skip
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str, reason: str | None = None) -> ModuleType:
    """``pytest.importorskip`` through :func:`missing`."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(f"{reason or f'{name} is not installed'}: {e}")
