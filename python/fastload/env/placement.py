"""Where resolve() puts a dataset: on node-local disk when it fits, else (``on_full=
"fallback"``) where it can be read without that disk: a tree or file in place, an
archive, a bucket's objects or a URL's download extracted once into the environment's
cache.

The decision is made before the first byte is written, from the dataset's size and the
free space: an archive's extracted size is measured first (:func:`choose`); a tree, a
file or a bucket's objects are measured by stage() itself, whose space check comes
before its first byte, the fallback then decided by :func:`refit`. It is made under a
lock beside the node-local destination and recorded there (``.NAME.fastload-where.json``):
of the processes of one node asking at once, the first decides and the others follow
its record. A later call follows a record of "local" (the stage itself says if the data
no longer fits), and one of a fallback while the disk still lacks the room it recorded.
``fastload env`` lists the records under the environment's ``tmpdir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from .._util import human, node_lock, parse_checksum, write_json_atomic
from ..errors import ChecksumMismatchError, NotEnoughSpaceError
from ..staging import Patterns

__all__ = [
    "ON_FULL",
    "OnFull",
    "OnFullWarning",
    "Placement",
    "cache_key",
    "check_file",
    "check_on_full",
    "choose",
    "placements",
    "record_path",
    "refit",
]

OnFull = Literal["fallback", "error"]
ON_FULL: tuple[str, ...] = ("fallback", "error")
Where = Literal["local", "in_place", "cache"]

_RECORD = ".{}.fastload-where.json"
_VERSION = 1


class OnFullWarning(UserWarning):
    """resolve() went on without node-local disk: the dataset does not fit there."""


def check_on_full(value: object, what: str = "on_full") -> OnFull:
    if value not in ON_FULL:
        raise ValueError(f"{what} must be 'fallback' or 'error', not {value!r}")
    return value  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A decision of resolve(), as recorded beside the node-local destination."""

    where: Where
    """``"local"`` (staged to node-local disk), ``"in_place"`` (read where it is),
    ``"cache"`` (extracted or downloaded into the environment's cache)."""
    source: str
    """The source, as staged: a path or a URL."""
    target: str
    """The node-local destination that was wanted."""
    path: str
    """Where the data is read from: ``target``, the source, or the copy in the cache."""
    kind: str
    """``"tree"``, ``"file"``, ``"archive"``, ``"prefix"``, ``"object"``, or ``"nested"``
    (a tree staged with ``unpack="nested"``: its zips extracted)."""
    needed: int
    """Bytes the data still needs on node-local disk (an archive's extracted size is
    estimated: a gzip's trailer, a zstd frame's header, else the archive's size)."""
    free: int
    """Free bytes on the node-local disk when this was decided."""
    why: str
    """One line: the warning resolve() gave, or why the data was staged."""
    decided_by: str
    """The process that decided (``process PID on HOST``)."""
    followed: int = 0
    """How many later calls followed this decision without deciding again."""
    shards: bool = False
    """The data is tar shards in a bucket (the warning names ShardIterableDataset)."""

    def as_dict(self) -> dict[str, Any]:
        return {"version": _VERSION, **dataclasses.asdict(self)}


def record_path(target: Path) -> Path:
    return target.parent / _RECORD.format(target.name)


def cache_key(source: str, options: Mapping[str, Any]) -> str:
    """The folder of the cache a source's copy lands in: the same for every job (the
    node-local destination is not part of it), different for other options."""
    text = json.dumps([source, sorted((k, repr(v)) for k, v in options.items())])
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _free(path: Path) -> int:
    """Free bytes (for an unprivileged user) on the file system holding ``path`` or its
    nearest existing parent."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def _read(target: Path) -> Placement | None:
    try:
        with open(record_path(target), encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict) or data.pop("version", None) != _VERSION:
            return None
        return Placement(**data)
    except (OSError, ValueError, TypeError):
        return None  # none, torn, or of another version: decided again


def _write(target: Path, place: Placement) -> None:
    # A disk too full for a few hundred bytes: the next caller decides again, alike.
    with contextlib.suppress(OSError):
        write_json_atomic(record_path(target), place.as_dict())


@contextlib.contextmanager
def _deciding(target: Path) -> Iterator[None]:
    """The node lock of the decision (beside the destination's own, which stage() takes
    and a caller may wait on for the whole stage); none where it cannot be made."""
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(OSError):
            target.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(node_lock(target.with_name(target.name + ".where")))
        yield


def check_file(path: Path, checksum: str) -> None:
    """A file read in place against its published checksum (a copy would be checked as
    it is made)."""
    algo, want = parse_checksum(checksum) or ("", "")
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    if h.hexdigest() != want:
        exc = ChecksumMismatchError(
            errno.EIO,
            f"checksum mismatch for '{path}': expected {algo}:{want}, got {algo}:{h.hexdigest()}",
        )
        exc.filename = str(path)
        raise exc


def _me() -> str:
    return f"process {os.getpid()} on {os.uname().nodename}"


# --------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------


def _rounded(size: int, blocks: int, bsize: int) -> int:
    """What a file takes in whole blocks (a sparse file only its allocated ones)."""
    alloc = blocks * 512
    return -(-(alloc if 0 < alloc < size else size) // bsize) * bsize


def _gzip_size(path: Path, size: int) -> int:
    """A gzip's extracted size: its trailer holds it modulo 2**32, taken as the first
    such value not below the compressed size (a tar of media barely compresses)."""
    with open(path, "rb") as f:
        f.seek(max(0, size - 4))
        tail = f.read(4)
    if len(tail) < 4:
        return size
    isize = int.from_bytes(tail, "little")
    floor = size - size // 64
    wraps = max(0, -(-(floor - isize) // (1 << 32)))
    return isize + wraps * (1 << 32)


def _zstd_size(path: Path, size: int) -> int:
    """A zstd frame's content size where its header has one (the zstd tool writes it for
    a file), else the compressed size."""
    with open(path, "rb") as f:
        head = f.read(18)
    if len(head) < 6 or head[:4] != b"\x28\xb5\x2f\xfd":
        return size
    fhd = head[4]
    fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[did_flag]
    width = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if not width or len(head) < at + width:
        return size
    value = int.from_bytes(head[at : at + width], "little") + (256 if width == 2 else 0)
    return max(size, value)


def _archive_size(path: Path, compression: str, size: int) -> int:
    try:
        if compression == "gzip":
            return _gzip_size(path, size)
        if compression == "zstd":
            return _zstd_size(path, size)
    except OSError:
        pass
    return size


def _measure_local(src: Path, dst_parent: Path, include: Patterns, unpack: Any) -> tuple[str, int]:
    from .. import _core
    from ..staging import archive_compression
    from ..staging.columns import FILE, Listing
    from ..staging.request import patterns

    bsize = os.statvfs(dst_parent).f_frsize or 4096
    if os.path.isdir(src):
        listing = Listing.from_walk(
            _core.walk_columns(str(src), list(patterns(include)), [], False, 16)
        ).of_kind(FILE)
        kind = "nested" if unpack == "nested" else "tree"
        return kind, sum(map(_rounded, listing.size, listing.blocks, [bsize] * len(listing)))
    if _is_zip(str(src), unpack):
        return "archive", _zip_size(str(src), dst_parent, include, unpack, None)
    st = os.stat(src)
    compression = None if unpack is False else archive_compression(src)
    if compression is None:
        return "file", _rounded(st.st_size, st.st_blocks, bsize)
    return "archive", _archive_size(src, compression, st.st_size)


def _measure_store(
    url: str, target: Path, include: Patterns, unpack: Any,
    storage_options: Mapping[str, Any] | None,
) -> tuple[str, int, bool]:  # fmt: skip
    from ..staging.archive import Archive
    from ..staging.remote import ObjectPrefix, open_remote
    from ..staging.request import StageRequest

    if _is_zip(url, unpack):
        return "archive", _zip_size(url, target.parent, include, unpack, storage_options), False
    req = StageRequest.make(include=include, unpack=unpack, storage_options=storage_options)
    source, _ = open_remote(url, target, req)
    if isinstance(source, Archive):
        return "archive", int(source.data.size), False
    if isinstance(source, ObjectPrefix):
        objects, _dirs = source.listing(req)
        shards = not source.single and any(
            objects.key_str(i).endswith(".tar") for i in range(min(len(objects), 64))
        )
        return ("object" if source.single else "prefix"), sum(objects.size), shards
    return "held", 0, False  # a complete copy, its store unreachable: it is local


def _is_zip(source: str, unpack: Any) -> bool:
    """Whether stage() extracts ``source`` as a zip: a URL by its name, a local file by
    its name or its first bytes unless its content is a tar's (as stage() tells: a tar
    named ``.zip`` is extracted as a tar)."""
    if unpack is False:
        return False
    if "://" in source:
        from ..staging.zipopen import is_zip_url

        return is_zip_url(source)
    from ..staging import archive_compression
    from ..staging.zipformat import is_zip_file

    return (os.path.isfile(source) and archive_compression(Path(source)) is None
            and is_zip_file(source))  # fmt: skip


def _zip_size(source: str, spool: Path, include: Patterns, unpack: Any,
              storage_options: Mapping[str, Any] | None) -> int:  # fmt: skip
    """The bytes a zip's selected members extract to, from its central directory (a
    few reads; an inner archive of ``unpack="nested"`` counted as its stored size)."""
    from ..staging.request import StageRequest
    from ..staging.zipopen import open_zip

    req = StageRequest.make(include=include, unpack="auto" if unpack == "nested" else unpack,
                            storage_options=storage_options, allow_empty=True)  # fmt: skip
    source_zip = open_zip(source, req, spool)
    try:
        files, _others = source_zip.listing(req)
        return int(sum(files.size))
    finally:
        source_zip.data.close()


def _kind(source: str, unpack: Any) -> str:
    """What ``source`` is, told without listing it: a store URL by its name (an archive
    object without an archive's suffix is an ``"object"`` here)."""
    if _is_zip(source, unpack):
        return "archive"
    if "://" in source:
        from ..staging.archive import suffix_kind

        if source.endswith("/"):
            return "prefix"
        name = source.rsplit("/", 1)[-1]
        return "archive" if unpack is not False and suffix_kind(name) else "object"
    if os.path.isdir(source):
        return "nested" if unpack == "nested" else "tree"
    from ..staging import archive_compression

    compressed = unpack is not False and archive_compression(Path(source)) is not None
    return "archive" if compressed else "file"


def _already(target: Path, source: str) -> int:
    """Bytes of this source already at ``target``: a complete stage's manifest, else the
    files of an interrupted one (a resume needs room for the rest only)."""
    from ..staging.state import read_manifest

    m = read_manifest(target)
    if m is not None and m.get("source") == source and m.get("complete"):
        return int(m.get("bytes", 0))
    if not target.is_dir() or target.is_symlink():
        return 0
    total = 0
    for dirpath, _dirs, files in os.walk(target):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# --------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------


def _message(p: Placement, label: str) -> str:
    head = (
        f"fastload: {label} needs {human(p.needed)} and the node-local disk at "
        f"'{Path(p.target).parent}' has {human(p.free)} free"
    )
    if p.where == "in_place":
        body = (
            f"reading it in place from '{p.path}' (every epoch reads the shared file "
            "system: slower than local disk, and a load on the storage everyone shares)"
        )
    else:
        verb = "extracting" if p.kind in ("archive", "nested") else "downloading"
        body = (
            f"{verb} it once into the cache '{p.path}' instead (kept for later jobs, read "
            "from there: slower than local disk)"
        )
    hint = (
        "; ShardIterableDataset(..., cache_limit=...) trains on shards larger than the "
        "disk, through a bounded node-local cache"
        if p.shards
        else ""
    )
    return f"{head}: {body}{hint}; on_full='error' (FASTLOAD_ON_FULL=error) fails instead"


def choose(
    source: str,
    target: Path,
    cache_target: Path,
    *,
    label: str,
    include: Patterns = None,
    unpack: Any = "auto",
    storage_options: Mapping[str, Any] | None = None,
    measure: bool | None = None,
) -> tuple[Placement, bool]:
    """Where ``source`` goes: ``target`` (node-local) when it fits, else in place (a tree
    or file) or ``cache_target``. Decided once per node (a record beside ``target``,
    under a lock); returns the placement and whether this call made the decision.

    ``measure``: size the data now. By default only an archive is (a stat, a few bytes
    of its head or tail): stage() checks the room of a tree, a file or a bucket's objects
    itself before its first byte, from the walk or listing it makes anyway, and the
    caller then asks :func:`refit`; an archive's own check counts its compressed size.
    ``True`` for a caller whose stage does not raise before it returns.

    Raises:
        NotEnoughSpaceError: it fits neither on node-local disk nor in the cache.
    """
    with _deciding(target):
        rec = _read(target)
        if rec is not None and rec.source == source and rec.target == str(target):
            with contextlib.suppress(OSError):
                if rec.where == "local" or _free(target) < rec.needed:
                    rec = dataclasses.replace(rec, followed=rec.followed + 1)
                    _write(target, rec)
                    return rec, False
        kind = _kind(source, unpack)
        if not (kind == "archive" if measure is None else measure):
            free = _free(target)
            place = Placement("local", source, str(target), str(target), kind, 0, free,
                              f"{human(free)} free: stage() checks the room", _me())  # fmt: skip
            _write(target, place)
            return place, True
        shards = False
        if "://" in source:
            kind, size, shards = _measure_store(source, target, include, unpack, storage_options)
        else:
            kind, size = _measure_local(Path(source), target.parent, include, unpack)
        needed = max(0, size - _already(target, source))
        free = _free(target)
        place = Placement("local", source, str(target), str(target), kind, needed, free,
                          f"fits: {human(needed)} needed, {human(free)} free", _me(),
                          shards=shards)  # fmt: skip
        if needed > free:
            place = _fallback(place, cache_target, label, size)
        _write(target, place)
        return place, True


def refit(
    place: Placement, cache_target: Path, error: NotEnoughSpaceError, label: str, *,
    storage_options: Mapping[str, Any] | None = None,
) -> Placement:  # fmt: skip
    """After the stage of a "local" decision found too little room (``error``, raised
    before its first byte): the fallback, decided once (a caller that finds the record
    already changed follows it)."""
    target = Path(place.target)
    with _deciding(target):
        rec = _read(target)
        if rec is not None and rec.where != "local" and rec.source == place.source:
            rec = dataclasses.replace(rec, followed=rec.followed + 1)
            _write(target, rec)
            return rec
        shards = place.shards
        if place.kind == "prefix":  # what the warning says depends on what is in it
            with contextlib.suppress(OSError, ValueError):
                shards = _measure_store(place.source, target, None, "auto", storage_options)[2]
        place = dataclasses.replace(place, needed=error.needed, free=error.free, decided_by=_me(),
                                    followed=0, shards=shards)  # fmt: skip
        place = _fallback(place, cache_target, label, error.needed)
        _write(target, place)
        return place


def _holds_zips(root: str) -> bool:
    from ..staging.zipformat import is_zip_name

    return any(any(map(is_zip_name, files)) for _d, _dirs, files in os.walk(root))


def _fallback(place: Placement, cache_target: Path, label: str, size: int) -> Placement:
    if place.kind == "nested" and not _holds_zips(place.source):
        place = dataclasses.replace(place, kind="tree")  # nothing to extract: as a tree
    if place.kind in ("tree", "file"):
        place = dataclasses.replace(place, where="in_place", path=place.source)
        return dataclasses.replace(place, why=_message(place, label))
    place = dataclasses.replace(place, where="cache", path=str(cache_target))
    needed = max(0, size - _already(cache_target, place.source))
    try:
        free = _free(cache_target)
    except OSError as e:
        raise NotEnoughSpaceError(
            f"{label} does not fit on the node-local disk at '{Path(place.target).parent}' "
            f"({human(place.free)} free), and its cache '{cache_target}' cannot be used: "
            f"{e.strerror}",
            path=str(cache_target), needed=needed, free=0,
        ) from None
    if needed > free:
        raise NotEnoughSpaceError(
            f"not enough space for {label} ({human(size)}): the node-local disk at "
            f"'{Path(place.target).parent}' has {human(place.free)} free, the cache "
            f"'{cache_target}' {human(free)} on its file system; free space on one of "
            "them, or point the cache elsewhere (resolve(cache=...), FASTLOAD_CACHE)",
            path=str(cache_target), needed=needed, free=free,
        )
    return dataclasses.replace(place, why=_message(place, label))


def placements(tmpdir: Path, depth: int = 3) -> list[Placement]:
    """The decisions recorded under ``tmpdir`` (``fastload env``), newest first."""
    found: list[tuple[float, Placement]] = []
    pattern = _RECORD.format("*")
    for level in range(depth):
        for path in tmpdir.glob("*/" * level + pattern):
            with contextlib.suppress(OSError):
                mtime = path.stat().st_mtime
                place = _read(path.with_name(path.name[1 : -len(".fastload-where.json")]))
                if place is not None:
                    found.append((mtime, place))
    return [p for _, p in sorted(found, key=lambda x: -x[0])]

