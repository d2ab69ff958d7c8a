"""The configuration file: ``$FASTLOAD_CONFIG``, else ``$XDG_CONFIG_HOME/fastload/
config.toml`` (by default ``~/.config/fastload/config.toml``).

.. code-block:: toml

    environment = "slurm"               # like FASTLOAD_ENV: skip detection

    [paths]                             # any environment
    cache = "{scratch}/fastload-cache"

    [environments.slurm]                # only when this environment is the one
    tmpdir = "/local/ssd/{user}"        # a node-local disk SLURM does not announce
    on_full = "error"                   # data larger than tmpdir: fail, not fall back
    dataset_roots = ["/shared/datasets"]

    [datasets.mydata]                   # extends the dataset registry
    sources = [{ path = "mydata/mydata.tar.zst" }]

    [storage.s3]                        # the site's object store (S3-compatible)
    endpoint_url = "https://s3.example.edu"

Keys of ``[paths]`` and ``[environments.NAME]``: ``tmpdir``, ``cache``, ``scratch``
(path templates), ``dataset_roots`` (a list of them), ``cpus`` (an integer),
``on_full`` (``"fallback"`` or ``"error"``: what resolve() does with data that does not
fit in ``tmpdir``, docs/on-full.md). The variables ``FASTLOAD_TMPDIR``,
``FASTLOAD_CACHE``, ``FASTLOAD_SCRATCH``, ``FASTLOAD_DATASET_ROOTS`` (``:``-separated),
``FASTLOAD_CPUS`` and ``FASTLOAD_ON_FULL`` override both.
``[storage.s3]`` (also ``gs``, ``az``) holds defaults for object store URLs
(``endpoint_url``, ``region``, ``anonymous``...), below ``~/.aws``, the ``AWS_*``
variables and ``storage_options=``.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import stage_error

__all__ = ["PATH_KEYS", "config_path", "load_config", "read_toml", "storage_defaults"]

PATH_KEYS = ("tmpdir", "cache", "scratch", "dataset_roots", "cpus", "on_full")
_TOP_KEYS = ("environment", "paths", "environments", "datasets", "storage")


def config_path(environ: Mapping[str, str]) -> tuple[Path, bool]:
    """The configuration file to read, and whether it was named explicitly (then it
    must exist)."""
    explicit = environ.get("FASTLOAD_CONFIG")
    if explicit:
        return Path(explicit).expanduser(), True
    base = environ.get("XDG_CONFIG_HOME")
    if not base:
        home = environ.get("HOME") or str(Path.home())
        base = str(Path(home) / ".config")
    return Path(base) / "fastload" / "config.toml", False


def read_toml(path: Path) -> dict[str, Any]:
    """Parses a TOML file (``tomllib``; ``tomli`` on Python 3.10)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        try:
            import tomli as tomllib
        except ImportError:
            raise ImportError(
                f"reading {path} needs the 'tomli' package on Python < 3.11 "
                "(pip install tomli)"
            ) from None
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML: {e}") from None


def load_config(environ: Mapping[str, str]) -> tuple[dict[str, Any], Path | None]:
    """Reads and checks the configuration file; ``({}, None)`` when there is none.

    Raises:
        FileNotFoundError: ``FASTLOAD_CONFIG`` names a file that does not exist.
        ValueError: the file is not valid TOML, or has an unknown key or a wrong type.
    """
    path, explicit = config_path(environ)
    try:
        data = read_toml(path)
    except FileNotFoundError:
        if explicit:
            raise stage_error(
                errno.ENOENT,
                f"FASTLOAD_CONFIG names '{path}', which does not exist: create it, or "
                "unset FASTLOAD_CONFIG",
                str(path),
            ) from None
        return {}, None
    check_config(data, path)
    return data, path


def storage_defaults() -> dict[str, Any]:
    """The configuration file's ``[storage]`` tables, for object store URLs (the site
    loader of sources.base, which the package sets)."""
    data, _ = load_config(os.environ)
    return dict(data.get("storage", {}))


def _fail(path: Path, message: str) -> ValueError:
    return ValueError(f"{path}: {message}")


def _check_paths(table: Any, where: str, path: Path) -> None:
    if not isinstance(table, dict):
        raise _fail(path, f"[{where}] must be a table")
    for key, value in table.items():
        if key not in PATH_KEYS:
            raise _fail(path, f"unknown key '{key}' in [{where}] (known: {', '.join(PATH_KEYS)})")
        if key == "cpus":
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _fail(path, f"[{where}] cpus must be a positive integer")
        elif key == "on_full":
            if value not in ("fallback", "error"):
                raise _fail(path, f"[{where}] on_full must be \"fallback\" or \"error\"")
        elif key == "dataset_roots":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise _fail(path, f"[{where}] dataset_roots must be a list of paths")
        elif not isinstance(value, str):
            raise _fail(path, f"[{where}] {key} must be a path (a string)")


def check_config(data: Mapping[str, Any], path: Path) -> None:
    for key in data:
        if key not in _TOP_KEYS:
            raise _fail(path, f"unknown key '{key}' (known: {', '.join(_TOP_KEYS)})")
    env = data.get("environment")
    if env is not None and not isinstance(env, str):
        raise _fail(path, "environment must be a name (a string)")
    if "paths" in data:
        _check_paths(data["paths"], "paths", path)
    envs = data.get("environments", {})
    if not isinstance(envs, dict):
        raise _fail(path, "[environments] must be a table of tables")
    for name, table in envs.items():
        _check_paths(table, f"environments.{name}", path)
    storage = data.get("storage", {})
    if not isinstance(storage, dict) or not all(isinstance(v, dict) for v in storage.values()):
        raise _fail(path, "[storage] must be a table of tables ([storage.s3])")
    datasets = data.get("datasets", {})
    if not isinstance(datasets, dict) or not all(isinstance(v, dict) for v in datasets.values()):
        raise _fail(path, "[datasets] must be a table of tables")
