"""The registry of environment detectors, and :func:`detect`.

Detectors are tried in order, the first that matches wins: ``mila``, ``drac``, then
site plug-ins (the ``fastload.environments`` entry-point group, and
:func:`register_environment`), then the generic ``slurm`` and ``local``. The registry is
a private dict; :func:`environments` gives a read-only view of it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

from .._util import usable_cores
from . import drac, local, mila, slurm
from .base import Context, Detector, Environment, expand
from .config import check_config, load_config

__all__ = ["ENTRY_POINT_GROUP", "current", "detect", "environments", "register_environment"]

ENTRY_POINT_GROUP = "fastload.environments"

_registry: dict[str, Detector] = {}
_entry_points_loaded = False

# Variables that override a path of any environment (after the configuration file).
ENV_VARS = {
    "tmpdir": "FASTLOAD_TMPDIR",
    "cache": "FASTLOAD_CACHE",
    "scratch": "FASTLOAD_SCRATCH",
    "dataset_roots": "FASTLOAD_DATASET_ROOTS",
    "cpus": "FASTLOAD_CPUS",
    "on_full": "FASTLOAD_ON_FULL",
}


def register_environment(
    detector: Detector, *, before: str | None = "slurm", replace: bool = False
) -> None:
    """Adds an environment detector.

    Args:
        detector: its ``name`` is what ``FASTLOAD_ENV`` and the configuration use.
        before: the detector it is tried before (default ``"slurm"``: a site is more
            specific than "some SLURM cluster"); ``None`` tries it last.
        replace: allow replacing a detector of the same name (it keeps its place).

    Raises:
        ValueError: the name is taken (and ``replace`` is false), or ``before`` is
            not a registered detector.
    """
    if not isinstance(detector, Detector):
        raise TypeError(f"expected a fastload.env.Detector, not {type(detector).__name__}")
    if detector.name in _registry:
        if not replace:
            raise ValueError(f"an environment named {detector.name!r} is already registered")
        _registry[detector.name] = detector
        return
    if before is None:
        _registry[detector.name] = detector
        return
    if before not in _registry:
        raise ValueError(f"before={before!r}: no such environment ({', '.join(_registry)})")
    items = list(_registry.items())
    at = [name for name, _ in items].index(before)
    items.insert(at, (detector.name, detector))
    _registry.clear()
    _registry.update(items)


def _load_entry_points(force: bool = False) -> None:
    """Registers the detectors other packages declare in the ``fastload.environments``
    group (once per process, or again with ``force``). A broken plug-in is skipped with
    a warning: it must not make fastload unusable."""
    global _entry_points_loaded
    if _entry_points_loaded and not force:
        return
    _entry_points_loaded = True
    # Imported here, where plug-ins are looked for: importlib.metadata costs an import
    # of fastload ~25 ms.
    import importlib.metadata

    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj: Any = ep.load()
            if not isinstance(obj, Detector) and callable(obj):
                obj = obj()
            if not isinstance(obj, Detector):
                raise TypeError(f"it is a {type(obj).__name__}, not a fastload.env.Detector")
            if obj.name != ep.name:
                obj = dataclasses.replace(obj, name=ep.name)
            register_environment(obj, replace=True)
        except Exception as e:
            warnings.warn(
                f"fastload: skipping environment plug-in {ep.name!r} ({ep.value}): {e}",
                RuntimeWarning,
                stacklevel=2,
            )


def environments() -> Mapping[str, Detector]:
    """The registered detectors, in the order they are tried (a read-only view)."""
    _load_entry_points()
    return MappingProxyType(_registry)


for _builtin in (mila.DETECTOR, drac.DETECTOR, slurm.DETECTOR, local.DETECTOR):
    register_environment(_builtin, before=None)


@functools.lru_cache(maxsize=1)
def _hostname() -> str:
    """This host's fully qualified name (looked up once: it may ask DNS)."""
    name = socket.gethostname()
    if "." not in name:
        fq = socket.getfqdn(name)
        if "." in fq and not fq.startswith("localhost"):
            name = fq
    return name


def detect(
    environ: Mapping[str, str] | None = None,
    hostname: str | None = None,
    *,
    exists: Callable[[Path], bool] | None = None,
    config: Mapping[str, Any] | None = None,
    cpu_count: int | None = None,
) -> Environment:
    """Works out where this process runs and where its data should go.

    A pure function of its arguments (each defaults to this process's own):

    Args:
        environ: the process environment (``os.environ``).
        hostname: the host's fully qualified name.
        exists: tells whether a path exists (``os.path.exists``).
        config: the configuration; by default read from the file that ``environ``
            names (``FASTLOAD_CONFIG``, else ``~/.config/fastload/config.toml``).
        cpu_count: CPUs available when no scheduler says (the affinity mask).

    ``FASTLOAD_ENV=name`` (or ``environment = "name"`` in the configuration) skips
    detection; then the configuration's ``[paths]``, its ``[environments.<name>]`` and
    the ``FASTLOAD_TMPDIR``/``_CACHE``/``_SCRATCH``/``_DATASET_ROOTS``/``_CPUS``/
    ``_ON_FULL`` variables override the paths, in that order.

    Raises:
        ValueError: ``FASTLOAD_ENV`` names no registered environment, or the
            configuration is invalid.
    """
    env_map: Mapping[str, str] = os.environ if environ is None else environ
    config_path: Path | None = None
    if config is None:
        config, config_path = load_config(env_map)
    else:
        check_config(config, Path("<config>"))
    detectors = environments()
    forced = env_map.get("FASTLOAD_ENV") or config.get("environment")
    ctx = Context(
        environ=env_map,
        hostname=_hostname() if hostname is None else hostname,
        exists=os.path.exists if exists is None else exists,
        config=config,
        cpu_count=usable_cores() if cpu_count is None else cpu_count,
        forced=bool(forced),
    )
    if forced:
        detector = detectors.get(forced)
        if detector is None:
            raise ValueError(
                f"FASTLOAD_ENV={forced!r}: no such environment (known: {', '.join(detectors)})"
            )
    else:
        detector = next((d for d in detectors.values() if d.matches(ctx)), detectors["local"])
    env = detector.build(ctx)
    if env.name != detector.name:
        env = dataclasses.replace(env, name=detector.name)
    env = _override(env, ctx)
    return dataclasses.replace(env, config=config, config_path=config_path)


def _override(env: Environment, ctx: Context) -> Environment:
    values: dict[str, Any] = {}
    values.update(ctx.config.get("paths", {}))
    values.update(ctx.config.get("environments", {}).get(env.name, {}))
    for key, var in ENV_VARS.items():
        value = ctx.get(var)
        if value is not None:
            if key == "dataset_roots":
                values[key] = [v for v in value.split(os.pathsep) if v]
            else:
                values[key] = value
    if "cpus" in values:
        try:
            cpus = int(values["cpus"])
        except ValueError:
            raise ValueError(f"FASTLOAD_CPUS must be an integer, not {values['cpus']!r}") from None
        if cpus < 1:
            raise ValueError(f"the CPU budget must be at least 1, not {cpus}")
        env = dataclasses.replace(env, cpus=cpus)

    if "on_full" in values:
        if values["on_full"] not in ("fallback", "error"):
            raise ValueError(
                f"FASTLOAD_ON_FULL must be 'fallback' or 'error', not {values['on_full']!r}"
            )
        env = dataclasses.replace(env, on_full=values["on_full"])

    def path(template: str) -> Path:
        return Path(os.path.abspath(expand(template, env.fields(), ctx.environ)))

    # In this order, so that tmpdir and cache may be written in terms of {scratch}.
    if "scratch" in values:
        env = dataclasses.replace(env, scratch=path(values["scratch"]))
    if "tmpdir" in values:
        env = dataclasses.replace(env, tmpdir=path(values["tmpdir"]))
    if "cache" in values:
        env = dataclasses.replace(env, cache=path(values["cache"]))
    if "dataset_roots" in values:
        env = dataclasses.replace(
            env, dataset_roots=tuple(path(p) for p in values["dataset_roots"])
        )
    return env


def current() -> Environment:
    """The environment of this process (``detect()`` with every default)."""
    return detect()
