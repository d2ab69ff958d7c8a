"""The dataset registry: well-known datasets by name (``"imagenet"``, ``"cifar10"``...),
where each may be found (paths relative to the environment's dataset roots, or URLs), its
splits and checksums. ``datasets.toml`` beside this module, extended by the ``[datasets]``
tables of the user's configuration file."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Union

from .. import sources
from .._util import parse_checksum
from .base import Environment
from .registry import current

__all__ = ["DatasetSpec", "Source", "datasets", "parse_datasets"]

Unpack = Union[bool, Literal["auto", "nested"]]


@dataclasses.dataclass(frozen=True)
class Source:
    """One place a dataset may be."""

    location: str
    """A path template (relative: to each dataset root) or an ``http(s)://`` URL."""
    unpack: Unpack | None = None
    """How to stage an archive found here (None: the caller's choice)."""
    checksum: str | None = None
    """``"md5:<hex>"`` or ``"sha256:<hex>"`` of the file found here."""
    into: str = ""
    """Where it lands inside the destination."""

    @property
    def is_url(self) -> bool:
        return sources.is_url(self.location)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A registry entry: where a dataset (or one split of it) may be found."""

    name: str
    description: str = ""
    sources: tuple[Source, ...] = ()
    returns: str | None = None
    """The path resolve() returns, relative to the destination (None: where the source
    landed)."""
    splits: Mapping[str, DatasetSpec] = dataclasses.field(default_factory=dict)
    default_split: str | None = None

    def split(self, split: str | None) -> DatasetSpec:
        """The entry of one split (``split=None``: the default one, if any)."""
        if not self.splits:
            if split is not None:
                raise ValueError(f"dataset {self.name!r} has no splits (split={split!r})")
            return self
        chosen = split if split is not None else self.default_split
        if chosen is None or chosen not in self.splits:
            known = ", ".join(sorted(self.splits))
            what = "needs a split" if chosen is None else f"has no split {chosen!r}"
            raise ValueError(f"dataset {self.name!r} {what} (splits: {known})")
        sub = self.splits[chosen]
        if sub.returns is None and self.returns is not None:
            sub = dataclasses.replace(sub, returns=self.returns)
        return sub


def _parse_source(raw: Any, where: str) -> Source:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a source must be a table (path = ... or url = ...)")
    unknown = set(raw) - {"path", "url", "unpack", "checksum", "into"}
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} in a source")
    if ("path" in raw) == ("url" in raw):
        raise ValueError(f"{where}: a source has either a path or a url")
    location = raw.get("path", raw.get("url"))
    if not isinstance(location, str) or not location:
        raise ValueError(f"{where}: a source's path or url must be a non-empty string")
    if "url" in raw and not sources.is_url(location):
        known = ", ".join(f"{s}://" for s in sorted(sources.schemes()))
        raise ValueError(f"{where}: url {location!r} must start with one of {known}")
    unpack = raw.get("unpack")
    if unpack not in (None, True, False, "auto", "nested"):
        raise ValueError(f"{where}: unpack must be true, false, 'auto' or 'nested'")
    checksum = raw.get("checksum")
    if checksum is not None:
        if not isinstance(checksum, str):
            raise ValueError(f"{where}: checksum must be a string like 'md5:<hex>'")
        parse_checksum(checksum)
    into = raw.get("into", "")
    if not isinstance(into, str) or os.path.isabs(into) or ".." in Path(into).parts:
        raise ValueError(f"{where}: into must be a relative path inside the destination")
    return Source(location, unpack, checksum, into)


def _parse_spec(name: str, raw: Any, where: str, *, top: bool = True) -> DatasetSpec:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: dataset {name!r} must be a table")
    keys = {"description", "sources", "returns"} | (
        {"splits", "default_split"} if top else set()
    )
    unknown = set(raw) - keys
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} in {name!r}")
    raw_sources = raw.get("sources", [])
    if not isinstance(raw_sources, list):
        raise ValueError(f"{where}: {name}.sources must be an array of tables")
    sources = tuple(_parse_source(s, f"{where}: {name}") for s in raw_sources)
    splits = {
        split: _parse_spec(name, table, where, top=False)
        for split, table in raw.get("splits", {}).items()
    }
    if not sources and not splits:
        raise ValueError(f"{where}: dataset {name!r} has no sources")
    returns = raw.get("returns")
    if returns is not None and (not isinstance(returns, str) or os.path.isabs(returns)):
        raise ValueError(f"{where}: {name}.returns must be a relative path")
    default_split = raw.get("default_split")
    if default_split is not None and default_split not in splits:
        raise ValueError(f"{where}: {name}.default_split {default_split!r} is not a split")
    description = raw.get("description", "")
    return DatasetSpec(name, str(description), sources, returns, splits, default_split)


def parse_datasets(table: Mapping[str, Any], where: str) -> dict[str, DatasetSpec]:
    """Dataset entries from a TOML table (the registry file's, or a configuration's
    ``[datasets]``)."""
    return {name: _parse_spec(name, raw, where) for name, raw in table.items()}


@functools.lru_cache(maxsize=1)
def _builtin_datasets() -> Mapping[str, DatasetSpec]:
    from importlib.resources import files

    here = files(__package__ or "fastload.env")
    text = here.joinpath("datasets.toml").read_text(encoding="utf-8")
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    return MappingProxyType(parse_datasets(tomllib.loads(text), "fastload/env/datasets.toml"))


def datasets(env: Environment | None = None) -> Mapping[str, DatasetSpec]:
    """The dataset registry: fastload's ``datasets.toml``, with the entries of the
    configuration file's ``[datasets]`` added (an entry of the same name replaces
    fastload's). A read-only mapping."""
    environment = env if env is not None else current()
    merged = dict(_builtin_datasets())
    extra = environment.config.get("datasets", {})
    if extra:
        where = str(environment.config_path or "configuration")
        merged.update(parse_datasets(extra, where))
    return MappingProxyType(merged)

