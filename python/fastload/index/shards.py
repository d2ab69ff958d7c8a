"""Shard sets: what a source of shards names (a list, a directory, globs, webdataset
braces ``{000000..000999}``) and where an index built for them is cached by default."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Union

from .. import _core

PathLike = Union[str, "os.PathLike[str]"]
Shards = Union[PathLike, Sequence[PathLike]]

#: File names a directory source contributes: tar shards, and compressed ones (which
#: the builder then refuses with a message saying how to make them readable).
_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tar.xz", ".tar.lz4")

_BRACES = re.compile(r"\{([^{}]*)\}")

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def expand_braces(pattern: str) -> list[str]:
    """webdataset's shard notation: ``a-{000..002}.tar`` -> ``a-000.tar a-001.tar a-002.tar``
    (zero padding kept from the first bound), ``{a,b}`` -> ``a b``; nested and repeated
    groups expand left to right."""
    m = _BRACES.search(pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end() :]
    r = _RANGE.match(body)
    if r is not None:
        lo, hi = int(r.group(1)), int(r.group(2))
        width = len(r.group(1)) if r.group(1).startswith("0") else 0
        step = 1 if hi >= lo else -1
        choices = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    else:
        choices = body.split(",")
    return [p for c in choices for p in expand_braces(head + c + tail)]


def expand_shards(shards: Shards) -> list[str]:
    """The shard paths a source names: a list of paths, a directory (its tar files,
    sorted), or a string with globs (``*``, ``?``, ``[...]``) and webdataset braces."""
    if isinstance(shards, (str, os.PathLike)):
        text = os.fspath(shards)
        if os.path.isdir(text):
            found = sorted(
                os.path.join(text, n)
                for n in os.listdir(text)
                if n.endswith(_SHARD_SUFFIXES) and os.path.isfile(os.path.join(text, n))
            )
            if not found:
                raise FileNotFoundError(f"no tar shards (*.tar) in directory {text!r}")
            return found
        out: list[str] = []
        for p in expand_braces(text):
            if glob.has_magic(p):
                matched = sorted(glob.glob(p))
                if not matched:
                    raise FileNotFoundError(f"no shards match {p!r}")
                out.extend(matched)
            else:
                out.append(p)
        return out
    paths = [os.fspath(p) for p in shards]
    if not paths:
        raise ValueError("no shards given")
    return paths


def default_index_path(shards: Sequence[str]) -> Path:
    """Where ``build(shards)`` without a path puts the index: a per-user cache folder
    (``$FASTLOAD_INDEX_CACHE``, else ``$XDG_CACHE_HOME/fastload/index``), named by a hash
    of the shards' absolute paths. Opening checks sizes and mtimes, so a cached index
    is never used stale."""
    root = os.environ.get("FASTLOAD_INDEX_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "fastload", "index")
    joined = "\0".join(os.path.abspath(s) for s in shards).encode("utf-8", "surrogateescape")
    name = f"{_core.fl64(joined):016x}.fidx"
    return Path(root) / name

