"""The pieces every environment detector works with: ``Environment``, ``Context``,
``Detector`` and path templates.

A detector is a pure function of a :class:`Context` (the process environment, the host
name, a way to ask whether a path exists, the configuration), so each cluster can be
simulated in a test with a dict, a string and a temporary directory.
"""

from __future__ import annotations

import dataclasses
import os
import re
import string
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Union

__all__ = [
    "Context",
    "Detector",
    "Environment",
    "expand",
    "fallback_tmpdir",
    "slurm_cpus",
    "xdg_cache",
]

PathLike = Union[str, "os.PathLike[str]"]


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where data lives here: the answer of :func:`fastload.env.detect`.

    Every path is absolute. ``tmpdir`` is where :func:`fastload.resolve` stages data by
    default; ``cache`` keeps downloads across jobs; ``dataset_roots`` are searched, in
    order, for datasets by name.
    """

    name: str
    """The detector that matched (or was forced): ``"mila"``, ``"drac"``, ``"slurm"``,
    ``"local"``, or a site plug-in's name."""
    tmpdir: Path
    """Node-local destination (``$SLURM_TMPDIR`` in a job)."""
    cache: Path
    """Persistent cache for downloads (kept between jobs)."""
    scratch: Path | None
    """The user's large shared work space, if this environment has one."""
    dataset_roots: tuple[Path, ...]
    """Read-only directories holding curated datasets, searched in order."""
    cpus: int
    """CPUs this job may use on this node (``SLURM_CPUS_ON_NODE`` in a job)."""
    user: str = ""
    hostname: str = ""
    cluster: str | None = None
    """The cluster's own name where the site gives one (``CC_CLUSTER`` on the Alliance)."""
    on_full: str = "fallback"
    """What :func:`fastload.resolve` does with data that does not fit in ``tmpdir``:
    ``"fallback"`` (read it in place, or from the ``cache``, with a warning) or
    ``"error"`` (``on_full`` in the configuration, ``FASTLOAD_ON_FULL``)."""
    config: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    """The configuration file's contents (``datasets`` extends the dataset registry)."""
    config_path: Path | None = dataclasses.field(default=None, repr=False, compare=False)
    """The configuration file that was read, if any."""

    def fields(self) -> dict[str, str | None]:
        """Values of the template fields (``{tmpdir}``, ``{scratch}``, ``{user}``...)."""
        return {
            "env": self.name,
            "tmpdir": str(self.tmpdir),
            "cache": str(self.cache),
            "scratch": None if self.scratch is None else str(self.scratch),
            "user": self.user,
            "hostname": self.hostname,
            "cluster": self.cluster,
        }

    def expand(self, template: PathLike, **extra: str | None) -> Path:
        """``template`` with ``{tmpdir}``, ``{scratch}``, ``{user}``, ``{cache}`` (and
        ``extra`` fields such as ``{name}``), ``$VARS`` and ``~`` filled in."""
        return Path(expand(os.fspath(template), {**self.fields(), **extra}, os.environ))


@dataclasses.dataclass(frozen=True)
class Context:
    """What a detector may look at. Nothing else: detection stays a pure function."""

    environ: Mapping[str, str]
    hostname: str
    """The host's fully qualified name."""
    exists: Callable[[Path], bool]
    config: Mapping[str, Any]
    cpu_count: int
    """CPUs this process may run on, used when no scheduler says otherwise."""
    forced: bool = False
    """True when ``FASTLOAD_ENV`` (or the config's ``environment``) chose the detector."""

    def get(self, name: str) -> str | None:
        """The variable's value, or None when it is unset or empty."""
        value = self.environ.get(name)
        return value if value else None

    @property
    def user(self) -> str:
        user = self.get("USER") or self.get("LOGNAME")
        if user is None:
            import getpass

            try:
                user = getpass.getuser()
            except (KeyError, OSError):
                user = "user"
        return user

    @property
    def home(self) -> Path:
        home = self.get("HOME")
        return Path(home) if home else Path.home()

    def existing(self, paths: Sequence[Path]) -> tuple[Path, ...]:
        """The paths that exist, in order, without duplicates."""
        seen: set[Path] = set()
        out: list[Path] = []
        for p in paths:
            if p not in seen and self.exists(p):
                seen.add(p)
                out.append(p)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class Detector:
    """An environment plug-in: ``matches`` says whether the process runs there,
    ``build`` describes it (called also when ``FASTLOAD_ENV`` forces this one).

    Register one with :func:`fastload.env.register_environment`, or from another
    package through the ``fastload.environments`` entry-point group (the entry point
    names a ``Detector`` object, or a callable taking no argument that returns one).
    """

    name: str
    matches: Callable[[Context], bool]
    build: Callable[[Context], Environment]
    description: str = ""


# --------------------------------------------------------------------------------------
# Helpers shared by the detectors
# --------------------------------------------------------------------------------------


def slurm_cpus(ctx: Context) -> int:
    """The CPU budget on this node: ``SLURM_CPUS_ON_NODE`` in a SLURM job, else the
    CPUs this process may run on (its affinity mask, not ``os.cpu_count()``)."""
    value = ctx.get("SLURM_CPUS_ON_NODE")
    if value is not None:
        try:
            n = int(value.split("(")[0].split(",")[0])
        except ValueError:
            n = 0
        if n > 0:
            return n
    return ctx.cpu_count


def xdg_cache(ctx: Context) -> Path:
    """``$XDG_CACHE_HOME/fastload``, by default ``~/.cache/fastload``."""
    base = ctx.get("XDG_CACHE_HOME")
    return (Path(base) if base else ctx.home / ".cache") / "fastload"


def fallback_tmpdir(ctx: Context) -> Path:
    """``$SLURM_TMPDIR``, else a per-user directory in ``$TMPDIR`` (``/tmp``), which is
    node-local on nearly every cluster."""
    tmp = ctx.get("SLURM_TMPDIR")
    if tmp is not None:
        return Path(tmp)
    return Path(ctx.get("TMPDIR") or "/tmp") / f"fastload-{ctx.user}"


_VAR = re.compile(r"\$(\w+)|\$\{([^}]*)\}")


def expand(template: str, fields: Mapping[str, str | None], environ: Mapping[str, str]) -> str:
    """Fills in a path template: ``$VAR`` and ``${VAR}`` from ``environ``, a leading
    ``~`` from ``$HOME``, then ``{field}`` from ``fields`` (``{{`` and ``}}`` stand for
    braces).

    Raises:
        ValueError: an unknown field, a field without a value here (``{scratch}`` where
            there is no scratch), or an unset variable.
    """

    def var(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        value = environ.get(name)
        if not value:
            raise ValueError(f"path {template!r} uses ${name}, which is not set")
        return value

    text = _VAR.sub(var, template)
    if text == "~" or text.startswith("~/"):
        home = environ.get("HOME") or str(Path.home())
        text = home + text[1:]
    out: list[str] = []
    for literal, field, spec, conv in string.Formatter().parse(text):
        out.append(literal)
        if field is None:
            continue
        if spec or conv or field not in fields:
            known = ", ".join("{" + k + "}" for k in sorted(fields))
            raise ValueError(f"path {template!r}: unknown field {{{field}}} (known: {known})")
        value = fields[field]
        if value is None:
            raise ValueError(f"path {template!r} uses {{{field}}}, which has no value here")
        out.append(value)
    return "".join(out)
