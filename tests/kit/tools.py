"""What a test needs from the machine: a tool on PATH, root, a device. Where it is
missing, the test is skipped, saying why; with ``CI`` set (``CI=true``) it fails
instead, since scripts/test.sh installs every tool the tests use."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing(reason: str, *, module: bool = False) -> NoReturn:
    """Skips the test (``reason`` in the summary), or fails it under CI; ``module``: called
    at a test module's top level."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: scripts/test.sh installs every tool the tests use)",
                    pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def require_tool(name: str, package: str) -> str:
    """The path of the command ``name``; ``package`` is the Debian package that has it."""
    path = shutil.which(name)
    if path is None:
        missing(f"{name} is not installed (apt-get install {package})")
    return path


def require_root(what: str) -> None:
    if os.geteuid() != 0:
        missing(f"{what} needs root")


def require_module(name: str, reason: str | None = None) -> ModuleType:
    """``pytest.importorskip`` through the guard: the module, or a skip (with CI set, a
    failure) saying why; callable at a module's top level. The test extra installs every
    module the tests import this way."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(f"{reason or f'{name} is not installed (the test extra has it)'}: {e}",
                module=True)  # fmt: skip
