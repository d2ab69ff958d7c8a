"""resolve(): find a dataset in the first source that has it, stage it to node-local disk
and return the local path.

Sources, in the order given: local paths, paths relative to the environment's dataset
roots (``/network/datasets`` on Mila...), and ``http(s)://`` URLs, downloaded once into
the environment's cache (under the node lock, into a temporary file renamed into place
once its checksum is verified). The data is then staged with :func:`fastload.stage`, so
of the processes of one node that resolve the same data at once, one copies and the
others wait for it; if it dies, the next waiter takes over.

Names of well-known datasets (``"imagenet"``, ``"cifar10"``...) are looked up in a
registry: ``datasets.toml`` beside this module, extended by the ``[datasets]`` tables of
the user's configuration file.
"""

from __future__ import annotations

import errno
import os
import sys
import urllib.parse
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union, overload

from .._util import parse_checksum
from ..errors import ChecksumMismatchError, NotEnoughSpaceError, stage_error
from ..sources import check_supported, is_store_url, is_url
from ..sources import download as download_url
from ..staging import Patterns, Progress, StageResult, archive_compression, stage
from ..staging.archive import SUFFIXES
from ..staging.background import Staging
from ..staging.zipformat import is_zip_file
from .base import Environment, expand
from .datasets import DatasetSpec, Source, Unpack, datasets
from .placement import (
    OnFull,
    OnFullWarning,
    cache_key,
    check_file,
    check_on_full,
    choose,
    refit,
)
from .registry import current

__all__ = ["resolve"]

PathLike = Union[str, "os.PathLike[str]"]


@overload
def resolve(
    name_or_path: PathLike | None = None, *, wait: Literal[True] = ..., **options: Any
) -> Path: ...
@overload
def resolve(
    name_or_path: PathLike | None = None, *, wait: Literal[False], **options: Any
) -> Staging: ...


def resolve(  # type: ignore[misc]  # (the overloads say what wait= returns)
    name_or_path: PathLike | None = None,
    *,
    sources: Sequence[PathLike] | None = None,
    cache: PathLike | None = None,
    destination: PathLike | None = None,
    unpack: Unpack = "auto",
    checksum: str | Literal[False] | None = None,
    include: Patterns = None,
    split: str | None = None,
    env: Environment | None = None,
    progress: Progress = None,
    download: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    fanout: bool | Any = False,
    on_full: OnFull | None = None,
    wait: bool = True,
) -> Path | Staging:
    """Finds a dataset, stages it to node-local disk, and returns the local path.

    ``resolve("imagenet", split="train")`` stages ImageNet's training set from where
    this cluster keeps it; ``resolve("/network/datasets/foo.tar.zst")`` extracts that
    archive; ``resolve("cifar10", sources=["https://.../cifar.tar.gz"])`` downloads
    once into the cache. Every process of a node may call it at once: one copies, the
    others wait and get the same path.

    Args:
        name_or_path: a registry name (see :func:`datasets`), a path (absolute, or
            relative to the dataset roots or to the current directory), or a URL.
        sources: where to look instead of the registry, in order: paths (relative ones
            under each dataset root, then the current directory) and ``http(s)://``
            URLs. ``None``: the registry's sources for a known name, else
            ``name_or_path`` itself.
        cache: where downloads are kept (default: the environment's ``cache``).
        destination: where the data is staged (default: ``{tmpdir}/{name}``).
        unpack: for archives, as in :func:`fastload.stage`; ``"auto"`` keeps what the
            registry says of each source.
        checksum: ``"sha256:<hex>"``/``"md5:<hex>"`` of the file found (default: the
            registry's); ``False`` skips the registry's checksums.
        include: glob patterns: stage only the matching paths.
        split: the split of a registry dataset (``"train"``, ``"val"``...); also the
            ``{split}`` template field.
        env: the environment (default: :func:`fastload.env.current`).
        progress: as in :func:`fastload.stage` (also shown while downloading).
        download: ``False`` skips URL sources (a compute node without network access).
        storage_options: for ``s3://`` (``gs://``, ``az://``) sources, as in
            :func:`fastload.stage`.
        fanout: as in :func:`fastload.stage`, for a dataset found on a file system: the
            job's nodes read it once in total and exchange it (every process of the job
            calls resolve() alike).
        on_full: what to do when the data does not fit on node-local disk (decided
            before the first byte, from its size and the free space, once per node):
            ``"fallback"`` (default; the environment's ``on_full``, ``FASTLOAD_ON_FULL``)
            goes on with a one-line :class:`OnFullWarning`: a tree or file is read in
            place, an archive, a bucket's objects or a URL's download is extracted or
            downloaded once into the ``cache``; ``"error"`` raises
            :class:`NotEnoughSpaceError`. See docs/on-full.md.
        wait: ``False`` returns at once the :class:`~fastload.staging.background.Staging`
            handle of the stage (``stage(..., wait=False)``): read the data through it
            while it stages (docs/read-while-staging.md). Where the data does not fit
            (``on_full``), the decision is made first, from the data's measured size, and
            the handle is the stage into the cache, or one of the source read in place.

    Data already in the environment's ``tmpdir`` is returned where it is (with no
    ``destination``): it is node-local already.

    Paths may use the template fields ``{name}``, ``{split}``, ``{tmpdir}``,
    ``{scratch}``, ``{cache}``, ``{user}``, ``$VARIABLES`` and ``~``.

    Raises:
        FileNotFoundError: no source has the data (a :class:`StageError` naming every
            place that was tried).
        ChecksumMismatchError: the data does not match its checksum.
        NotEnoughSpaceError: the data fits neither on node-local disk nor (falling back)
            in the cache, or ``on_full="error"`` and it does not fit on node-local disk.
        ValueError: an unknown split, a bad template, or conflicting arguments.
    """
    environment = env if env is not None else current()
    if unpack not in (True, False, "auto", "nested"):
        raise ValueError(f"unpack must be True, False, 'auto' or 'nested', not {unpack!r}")
    if checksum is not None and checksum is not False:
        parse_checksum(checksum)
    full = check_on_full(environment.on_full if on_full is None else on_full)
    spec, name, registered, split = _plan(name_or_path, sources, split, environment)
    fields: dict[str, str | None] = {**environment.fields(), "name": name, "split": split}

    def fill(template: PathLike) -> Path:
        return Path(os.path.abspath(expand(os.fspath(template), fields, os.environ)))

    cache_dir = fill(cache) if cache is not None else environment.cache
    if destination is not None:
        base = fill(destination)
    elif split is not None and not registered:
        base = fill("{tmpdir}/{name}/{split}")
    else:
        base = fill("{tmpdir}/{name}")

    tried: list[str] = []
    failures: list[OSError] = []
    for src in spec.sources:
        src_checksum = checksum if isinstance(checksum, str) else None
        if src_checksum is None and checksum is not False:
            src_checksum = src.checksum
        if src.is_url:
            if not download:
                continue
            url = expand(src.location, fields, os.environ)
            tried.append(url)
            if is_store_url(url):  # staged straight from the store, no download
                try:
                    return _placed(
                        url, base / src.into if src.into else base, base,
                        _Where(full, cache_dir, f"{name!r} ({url})", spec.returns),
                        include=include,
                        unpack=src.unpack if unpack == "auto" and src.unpack is not None
                        else unpack,
                        checksum=src_checksum, progress=progress,
                        storage_options=storage_options, wait=wait,
                    )  # fmt: skip
                except FileNotFoundError as e:
                    failures.append(e)
                    continue
            try:
                found = download_url(url, cache_dir, src_checksum, progress)
            except ChecksumMismatchError:
                raise
            except OSError as e:
                failures.append(e)
                continue
            src_checksum = None  # verified as it arrived
        else:
            candidates = _candidates(src.location, fields, environment, cwd=not registered)
            tried.extend(str(c) for c in candidates)
            if not candidates:
                tried.append(f"{src.location} (relative to the dataset roots: there are none)")
            hit = next((c for c in candidates if os.path.lexists(c)), None)
            if hit is None:
                continue
            if destination is None and _within(hit, environment.tmpdir):
                return hit if wait else Staging.ready(hit)
            found = hit
        return _stage_found(
            found,
            src,
            base,
            registered=registered,
            explicit_destination=destination is not None,
            unpack=src.unpack if unpack == "auto" and src.unpack is not None else unpack,
            checksum=src_checksum,
            include=include,
            progress=progress,
            fanout=fanout,
            where=_Where(full, cache_dir, f"{name!r} ({found})", spec.returns),
            wait=wait,
        )

    what = f"dataset {name!r}" + (f" (split {split!r})" if split else "")
    lines = [f"{what} not found in environment {environment.name!r}; tried:"]
    lines += [f"  {t}" for t in tried]
    lines += [f"  {e}" for e in failures if str(e) not in tried]
    if not environment.dataset_roots and any(not s.is_url for s in spec.sources):
        lines.append(
            "  (this environment has no dataset roots: set FASTLOAD_DATASET_ROOTS, or "
            f"dataset_roots in [environments.{environment.name}] of the configuration file)"
        )
    err = next((e.errno for e in failures if e.errno not in (None, errno.ENOENT)), None)
    raise stage_error(err or errno.ENOENT, "\n".join(lines), name)


def _within(path: Path, parent: Path) -> bool:
    try:
        real, top = Path(os.path.realpath(path)), Path(os.path.realpath(parent))
    except OSError:
        return False
    return real != top and top in real.parents


def _derive_name(location: str) -> str:
    """``/data/foo.tar.gz`` -> ``foo``; ``https://host/a/b.tgz?x=1`` -> ``b``."""
    if is_url(location):
        location = urllib.parse.unquote(urllib.parse.urlsplit(location).path)
    base = os.path.basename(location.rstrip("/")) or "data"
    low = base.lower()
    for suffix in sorted([*SUFFIXES, ".zip"], key=len, reverse=True):
        if low.endswith(suffix) and len(base) > len(suffix):
            return base[: -len(suffix)]
    return base


def _plan(
    name_or_path: PathLike | None,
    sources: Sequence[PathLike] | None,
    split: str | None,
    environment: Environment,
) -> tuple[DatasetSpec, str, bool, str | None]:
    """(what to look for, the dataset's name, whether it comes from the registry, the
    split: a registry dataset's default one when none is given)."""
    if sources is not None:
        if isinstance(sources, (str, os.PathLike)):
            sources = [sources]
        locations = [os.fspath(s) for s in sources]
        if not locations:
            raise ValueError("sources is empty")
        name = os.fspath(name_or_path) if name_or_path is not None else _derive_name(locations[0])
        spec = DatasetSpec(name, sources=tuple(Source(loc) for loc in locations))
        return spec, name, False, split
    if name_or_path is None:
        raise ValueError("resolve() needs a dataset name, a path, a URL, or sources=")
    text = os.fspath(name_or_path)
    check_supported(text)
    registry = datasets(environment)
    if text in registry:
        entry = registry[text]
        chosen = split if split is not None or not entry.splits else entry.default_split
        return entry.split(split), text, True, chosen
    return DatasetSpec(text, sources=(Source(text),)), _derive_name(text), False, split


def _candidates(
    location: str, fields: Mapping[str, str | None], environment: Environment, *, cwd: bool
) -> list[Path]:
    path = Path(expand(location, fields, os.environ))
    if path.is_absolute():
        return [path]
    out = [root / path for root in environment.dataset_roots]
    if cwd:
        out.append(Path(os.path.abspath(path)))
    return out


def _stage_found(
    found: Path,
    src: Source,
    base: Path,
    *,
    registered: bool,
    explicit_destination: bool,
    unpack: Unpack,
    checksum: str | None,
    include: Patterns,
    progress: Progress,
    fanout: bool | Any,
    where: _Where,
    wait: bool = True,
) -> Path | Staging:
    is_file = found.is_file()
    as_file = is_file and (
        unpack is False or (archive_compression(found) is None and not is_zip_file(found))
    )
    target = base / src.into if src.into else base
    if as_file and (registered or src.into):
        target = target / found.name
    elif as_file and not explicit_destination:
        target = base.parent / found.name  # {tmpdir}/foo.bin, not {tmpdir}/foo.bin/...
    return _placed(
        str(found),
        target,
        base,
        where,
        include=include,
        unpack=unpack if is_file or unpack == "nested" else "auto",  # a tree of zips
        checksum=checksum,
        progress=progress,
        fanout=fanout,
        wait=wait,
    )


class _Where(NamedTuple):
    """What decides where a found source goes (placement.py)."""

    on_full: OnFull
    cache: Path
    label: str
    returns: str | None


def _placed(source: str, target: Path, base: Path, where: _Where, wait: bool = True,
            **kw: Any) -> Path | Staging:  # fmt: skip
    """stage() of ``source`` into ``target`` (inside ``base``, or beside it for a file),
    or, where it does not fit and ``on_full`` allows, where placement.choose() says; the
    path resolve() returns, or with ``wait=False`` the stage's handle."""

    def returned(result: StageResult | Staging, top: Path) -> Path | Staging:
        if isinstance(result, Staging):
            if where.returns is None:
                return result
            # The handle reads the folder resolve() returns (a registry's `returns`),
            # where it lies inside the stage's destination.
            rel = os.path.relpath(top / where.returns, result.path)
            return result if rel == "." or rel.startswith("..") else result.within(rel)
        return result.path if where.returns is None else top / where.returns

    if where.on_full == "error":
        return returned(stage(source, target, wait=wait, **kw), base)
    options = {k: kw.get(k) for k in ("include", "unpack")}
    top = where.cache / "staged" / cache_key(source, options) / base.name
    cached = top / target.relative_to(base) if base in target.parents else top.parent / target.name
    # Fanned out, every node must enter the stage or none; in the background, a stage
    # that found no room would fail after resolve() returned: measured first.
    place, _ = choose(
        source, target, cached, label=where.label, include=kw.get("include"),
        unpack=kw.get("unpack", "auto"), storage_options=kw.get("storage_options"),
        measure=True if kw.get("fanout") or not wait else None,
    )  # fmt: skip
    if place.where == "local":
        if target.is_symlink() and os.readlink(target) in (source, str(cached)):
            target.unlink()  # the view of an earlier fallback: a stage would write through it
        try:
            return returned(stage(source, target, wait=wait, **kw), base)
        except NotEnoughSpaceError as e:
            place = refit(place, cached, e, where.label,
                          storage_options=kw.get("storage_options"))
    warnings.warn(place.why, OnFullWarning, stacklevel=_outside())
    if place.where == "in_place":
        here = _in_place(Path(source), target, base, where.returns, kw.get("checksum"))
        return here if wait else Staging.ready(here)
    kw.pop("fanout", None)  # the cache is one copy for every node
    return returned(stage(source, cached, wait=wait, **kw), top)


def _outside() -> int:
    """The ``stacklevel`` of the first caller outside this module (a warning names the
    caller's line)."""
    level, frame = 2, sys._getframe(2)
    while frame.f_back is not None and frame.f_globals.get("__name__") == __name__:
        level, frame = level + 1, frame.f_back
    return level


def _in_place(found: Path, target: Path, base: Path, returns: str | None,
              checksum: str | None) -> Path:  # fmt: skip
    """The path resolve() returns for ``found`` read where it is: itself, or for a
    registry layout (``into``, ``returns``) the folder it plays the part of ``target``
    in, else a symbolic link to it at ``target``."""
    if checksum is not None and found.is_file():
        check_file(found, checksum)
    if returns is None:
        return found
    rel = target.relative_to(base).parts if base in target.parents else ()
    if not rel:
        return found / returns if returns else found
    if found.parts[-len(rel) :] == rel:
        top = Path(*found.parts[: -len(rel)])
        return top / returns if returns else top
    if target.is_symlink() or not os.path.lexists(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.fastload-link-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(found)
        os.replace(tmp, target)
    return base / returns if returns else base
