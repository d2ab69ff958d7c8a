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

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import os
import sys
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Protocol, Union

from ._archive import _SUFFIXES, archive_compression, parse_checksum
from ._state import node_lock, write_json_atomic
from .env import Environment, current, expand
from .errors import ChecksumMismatchError, StageError, stage_error
from .stage import Patterns, Progress, stage

__all__ = ["DatasetSpec", "Source", "datasets", "resolve"]

Unpack = Union[bool, Literal["auto", "nested"]]
PathLike = Union[str, "os.PathLike[str]"]

_URL_SCHEMES = ("http://", "https://")
_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------
# The dataset registry
# --------------------------------------------------------------------------------------


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
        return self.location.startswith(_URL_SCHEMES)


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
    if "url" in raw and not location.startswith(_URL_SCHEMES):
        raise ValueError(f"{where}: url {location!r} must start with http:// or https://")
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

    text = files("fastload").joinpath("datasets.toml").read_text(encoding="utf-8")
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    return MappingProxyType(parse_datasets(tomllib.loads(text), "fastload/datasets.toml"))


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


# --------------------------------------------------------------------------------------
# resolve()
# --------------------------------------------------------------------------------------


def resolve(
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
) -> Path:
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
        download: ``False`` skips ``http(s)://`` sources (a compute node without
            network access).

    Data already in the environment's ``tmpdir`` is returned where it is (with no
    ``destination``): it is node-local already.

    Paths may use the template fields ``{name}``, ``{split}``, ``{tmpdir}``,
    ``{scratch}``, ``{cache}``, ``{user}``, ``$VARIABLES`` and ``~``.

    Raises:
        FileNotFoundError: no source has the data (a :class:`StageError` naming every
            place that was tried).
        ChecksumMismatchError: the data does not match its checksum.
        ValueError: an unknown split, a bad template, or conflicting arguments.
    """
    environment = env if env is not None else current()
    if unpack not in (True, False, "auto", "nested"):
        raise ValueError(f"unpack must be True, False, 'auto' or 'nested', not {unpack!r}")
    if checksum is not None and checksum is not False:
        parse_checksum(checksum)
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
            try:
                found = _download(url, cache_dir, src_checksum, progress)
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
                return hit
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
            returns=spec.returns,
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
    if location.startswith(_URL_SCHEMES):
        location = urllib.parse.unquote(urllib.parse.urlsplit(location).path)
    base = os.path.basename(location.rstrip("/")) or "data"
    low = base.lower()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
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
    if not text.startswith(_URL_SCHEMES) and "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(f"{text!r}: the {scheme}:// scheme is not supported yet (http, https)")
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
    returns: str | None,
) -> Path:
    is_file = found.is_file()
    as_file = is_file and (unpack is False or archive_compression(found) is None)
    target = base / src.into if src.into else base
    if as_file and (registered or src.into):
        target = target / found.name
    elif as_file and not explicit_destination:
        target = base.parent / found.name  # {tmpdir}/foo.bin, not {tmpdir}/foo.bin/...
    result = stage(
        found,
        target,
        include=include,
        unpack=unpack if is_file else "auto",
        checksum=checksum,
        progress=progress,
    )
    if returns is not None:
        return base / returns if returns else base
    return result.path


# --------------------------------------------------------------------------------------
# Downloads
# --------------------------------------------------------------------------------------


class _Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


def _http_backend() -> str:
    """``"fsspec"`` when fsspec's HTTP file system can be used (it needs aiohttp), else
    ``"urllib"`` (the standard library). ``FASTLOAD_HTTP`` chooses one."""
    forced = os.environ.get("FASTLOAD_HTTP", "").strip().lower()
    if forced in ("fsspec", "urllib"):
        return forced
    if forced not in ("", "auto"):
        raise ValueError(f"FASTLOAD_HTTP must be 'fsspec', 'urllib' or 'auto', not {forced!r}")
    try:
        import aiohttp  # noqa: F401
        import fsspec  # noqa: F401
    except ImportError:
        return "urllib"
    return "fsspec"


def _net_error(url: str, e: BaseException) -> StageError:
    return stage_error(errno.EIO, f"cannot download '{url}': {type(e).__name__}: {e}", url)


@contextlib.contextmanager
def _open_url(url: str) -> Iterator[tuple[_Reader, int | None]]:
    """The response body as a stream, and its length when the server says it."""
    if _http_backend() == "fsspec":
        import fsspec

        try:
            fs = fsspec.filesystem("http")
            f = fs.open(url, "rb", block_size=0)
        except FileNotFoundError:
            raise stage_error(errno.ENOENT, f"'{url}' was not found (HTTP 404)", url) from None
        except Exception as e:
            raise _net_error(url, e) from e
        with f:
            size = getattr(f, "size", None)
            yield f, int(size) if size else None
        return
    import urllib.error
    import urllib.request

    from . import __version__

    request = urllib.request.Request(url, headers={"User-Agent": f"fastload/{__version__}"})
    try:
        resp = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code in (404, 410):
            raise stage_error(
                errno.ENOENT, f"'{url}' was not found (HTTP {e.code})", url
            ) from None
        raise _net_error(url, e) from None
    except (urllib.error.URLError, OSError) as e:
        raise _net_error(url, e) from None
    with resp:
        yield resp, resp.length


def _url_filename(url: str) -> str:
    path = urllib.parse.unquote(urllib.parse.urlsplit(url).path)
    name = os.path.basename(path.rstrip("/"))
    return name if name and name not in (".", "..") else "download"


def _meta_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.fastload-download.json")


def _hash_file(path: Path, algo: str) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _cached(target: Path, url: str, want: tuple[str, str] | None) -> bool | None:
    """Whether the cached download can be used: True; False when it is there but does
    not match the checksum; None when there is no complete download."""
    try:
        with open(_meta_path(target), encoding="utf-8") as f:
            meta = json.load(f)
        st = os.stat(target)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(meta, dict)
        or meta.get("url") != url
        or meta.get("size") != st.st_size
        or meta.get("mtime_ns") != st.st_mtime_ns
    ):
        return None
    if want is None:
        return True
    digests = meta.setdefault("digests", {})
    if want[0] not in digests:
        digests[want[0]] = _hash_file(target, want[0])
        write_json_atomic(_meta_path(target), meta)
    return bool(digests[want[0]] == want[1])


def _download(url: str, cache_dir: Path, checksum: str | None, progress: Progress) -> Path:
    """Downloads ``url`` once into ``cache_dir/downloads/`` (one process per node; the
    others wait for it) and returns the local file."""
    want = parse_checksum(checksum)
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    target = cache_dir / "downloads" / key / _url_filename(url)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO,
            f"cannot create the download cache '{target.parent}': {e.strerror}",
            str(target.parent),
        ) from None
    with _cache_lock(target) as locked:
        if _cached(target, url, want):
            return target
        _fetch(url, target, want, progress, shared_part=locked)
    return target


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


@contextlib.contextmanager
def _cache_lock(target: Path) -> Iterator[bool]:
    """The lock beside a cached download (True), or none (False) where the cache's file
    system refuses locks (some network file systems): then every process downloads to
    its own temporary and the renames stay atomic."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(node_lock(target))
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            yield False
        else:
            yield True


def _fetch(
    url: str,
    target: Path,
    want: tuple[str, str] | None,
    progress: Progress,
    *,
    shared_part: bool = True,
) -> None:
    """Downloads into a temporary beside ``target``, hashing on the way, then renames it
    into place. Under the lock the temporary has a fixed name (what a killed download
    left is overwritten); without it, a name of this process's own."""
    suffix = ".part" if shared_part else f".part-{os.uname().nodename}-{os.getpid()}"
    part = target.with_name(f".{target.name}{suffix}")
    hashes = {"sha256": hashlib.sha256()}
    if want is not None and want[0] != "sha256":
        hashes[want[0]] = hashlib.new(want[0])
    bar = None
    done = 0
    try:
        with _open_url(url) as (stream, size), open(part, "wb") as out:
            if progress is True:
                from tqdm.auto import tqdm

                bar = tqdm(
                    total=size, unit="B", unit_scale=True, unit_divisor=1024,
                    desc=f"download {target.name}",
                )
            last = 0.0
            while True:
                try:
                    chunk = stream.read(_CHUNK)
                except OSError as e:
                    raise _net_error(url, e) from e
                except Exception as e:  # aiohttp's errors are not OSErrors
                    raise _net_error(url, e) from e
                if not chunk:
                    break
                out.write(chunk)
                for h in hashes.values():
                    h.update(chunk)
                done += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
                elif callable(progress) and time.monotonic() - last > 0.25:
                    last = time.monotonic()
                    progress(done, size or 0, 0, 1)
            out.flush()
            os.fsync(out.fileno())
        if size is not None and done != size:
            raise stage_error(
                errno.EIO, f"download of '{url}' ended after {done} of {size} bytes", url
            )
        digests = {algo: h.hexdigest() for algo, h in hashes.items()}
        if want is not None and digests[want[0]] != want[1]:
            exc = ChecksumMismatchError(
                errno.EIO,
                f"checksum mismatch for '{url}': expected {want[0]}:{want[1]}, "
                f"got {want[0]}:{digests[want[0]]}",
            )
            exc.filename = url
            raise exc
        os.replace(part, target)
        st = os.stat(target)
        meta = {
            "url": url,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "digests": digests,
            "downloaded": time.time(),
        }
        write_json_atomic(_meta_path(target), meta)
        if callable(progress):
            progress(done, done, 1, 1)
    except BaseException:
        with contextlib.suppress(OSError):
            part.unlink()
        raise
    finally:
        if bar is not None:
            bar.close()
