"""Writing indexed tar shards: :class:`ShardWriter` (the pipelines and :func:`pack` use it).

Shards are plain POSIX tar files in webdataset's layout (a sample's fields are members
``KEY.FIELD``, next to each other) that GNU tar, webdataset, wids and fastload's index
read. Every member gets the same metadata (mode 0644, uid/gid 0, no user or group
name, mtime 2000-01-01), and a sample's fields are written in sorted order, so the same
samples give byte-identical shards. Names longer than 100 bytes get a pax header (wids,
which reads only the ustar name field, does not see those).

>>> with fastload.ShardWriter("out", max_size="500MB") as w:
...     w.write({"__key__": "cat/0001", "jpg": jpeg_bytes, "cls": 3})
>>> fastload.pack("/data/imagenet/train", "/scratch/train", shuffle=True, seed=0)
>>> fastload.pack_dataset(torchvision_dataset, "/scratch/ds", fields=("jpg", "cls"), workers=8)
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import string
import tempfile
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np

from .. import _core
from .._util import Size, parse_size
from ..index import ShardIndex
from . import upload as _upload
from .plan import END_BYTES

__all__ = [
    "PackResult",
    "ShardWriter",
    "encoders",
    "parse_size",
    "register_encoder",
]

PathLike = Union[str, "os.PathLike[str]"]
BytesLike = Union[bytes, bytearray, memoryview]

DEFAULT_PATTERN = "shard-{:06d}.tar"
DEFAULT_INDEX = "index.fidx"

# --- encoders --------------------------------------------------------------------------

Encoder = Callable[[Any], BytesLike]
_ENCODERS: dict[type, Encoder] = {}


def register_encoder(cls: type, fn: Encoder) -> None:
    """Encode values of type ``cls`` (and its subclasses) with ``fn(value) -> bytes``
    when writing samples, e.g. ``register_encoder(PIL.Image.Image, to_png)``. A later
    registration for the same type replaces the earlier one; registered encoders take
    precedence over the built-in ones (str, int, float, numpy arrays, dicts, lists)."""
    if not isinstance(cls, type):
        raise TypeError(f"register_encoder needs a type, not {cls!r}")
    if not callable(fn):
        raise TypeError(f"the encoder for {cls.__name__} must be callable")
    _ENCODERS[cls] = fn


def encoders() -> Mapping[type, Encoder]:
    """The registered encoders (a read-only view)."""
    return types.MappingProxyType(_ENCODERS)


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.asanyarray(a), allow_pickle=False)
    return buf.getvalue()


def encode_value(value: Any, field: str = "?") -> BytesLike:
    """The bytes a field value is stored as: bytes-like as is, a registered encoder's
    output, str as UTF-8, int (and bool, numpy integers) as decimal text (webdataset's
    ``.cls``), float as ``repr``, numpy arrays as ``.npy``, dicts and lists as JSON."""
    if isinstance(value, (bytes, bytearray)):
        return value
    if isinstance(value, memoryview):
        return value if value.c_contiguous else value.tobytes()
    if _ENCODERS:
        for cls in type(value).__mro__:
            enc = _ENCODERS.get(cls)
            if enc is not None:
                out = enc(value)
                if not isinstance(out, (bytes, bytearray, memoryview)):
                    raise TypeError(
                        f"field {field!r}: the encoder for {cls.__name__} returned "
                        f"{type(out).__name__}, not bytes"
                    )
                return out
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (int, np.integer)):
        return str(int(value)).encode("ascii")
    if isinstance(value, (float, np.floating)):
        return repr(float(value)).encode("ascii")
    if isinstance(value, np.ndarray):
        return _npy(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False).encode("utf-8")
    raise TypeError(
        f"field {field!r}: cannot encode a {type(value).__name__}; pass bytes, or register "
        f"an encoder: fastload.register_encoder({type(value).__name__}, fn)"
    )


# --- samples ---------------------------------------------------------------------------


def check_key(key: object) -> str:
    """A sample key as the shard index will read it back: a relative path without empty,
    ``.`` or ``..`` components, and no dot in its last component (the key ends at the
    first dot of the file name)."""
    if not isinstance(key, str):
        raise TypeError(f"__key__ must be a str, not {type(key).__name__}")
    parts = key.split("/")
    if not key or "\0" in key or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"invalid sample key {key!r}: it must be a relative path without empty, '.' "
            "or '..' components and without NUL bytes"
        )
    if "." in parts[-1]:
        raise ValueError(
            f"invalid sample key {key!r}: a dot in its last component would split it "
            f"(readers take the key up to the first dot of the file name: "
            f"{key.rsplit('/', 1)[0] + '/' if '/' in key else ''}"
            f"{parts[-1].split('.', 1)[0]!r})"
        )
    return key


def _check_field(key: str, field: object) -> str:
    if not isinstance(field, str):
        raise TypeError(f"sample {key!r}: field names must be str, not {type(field).__name__}")
    if not field or "/" in field or "\0" in field:
        raise ValueError(
            f"sample {key!r}: invalid field name {field!r} (not empty, no '/' or NUL)"
        )
    return field


def encode_sample(sample: Mapping[str, Any]) -> tuple[str, list[tuple[str, BytesLike]]]:
    """(key, [(field, bytes), ...] sorted by field) of a sample dict. Entries whose names
    start with ``__`` other than ``__key__`` (``__url__``, ...) are metadata, not written."""
    if not isinstance(sample, Mapping):
        raise TypeError(f"a sample must be a dict with '__key__', not {type(sample).__name__}")
    if "__key__" not in sample:
        raise ValueError(f"sample has no '__key__' (fields: {sorted(map(str, sample))})")
    key = check_key(sample["__key__"])
    fields = [
        (_check_field(key, name), encode_value(value, name))
        for name, value in sample.items()
        if not (isinstance(name, str) and name.startswith("__"))
    ]
    if not fields:
        raise ValueError(f"sample {key!r} has no fields to write")
    fields.sort(key=lambda f: f[0])
    return key, fields


def sample_bytes(key: str, fields: Sequence[tuple[str, BytesLike]]) -> int:
    """Bytes the sample takes in a shard."""
    klen = len(os.fsencode(key))
    total = 0
    for name, data in fields:
        nlen = klen + 1 + len(os.fsencode(name))
        size = memoryview(data).nbytes
        if nlen <= 100 and size <= 0o77777777777:
            total += 512 + ((size + 511) & ~511)
        else:
            total += int(_core.tar_member_bytes(np.array([nlen]), np.array([size]))[0])
    return total


# --- the writer ------------------------------------------------------------------------


def check_pattern(pattern: str) -> tuple[str, str]:
    """(prefix, suffix) around the one ``{}`` field of a shard name pattern, which must
    name a ``.tar`` file in the output folder."""
    try:
        parts = list(string.Formatter().parse(pattern))
    except ValueError as e:
        raise ValueError(f"bad shard pattern {pattern!r}: {e}") from None
    fields = [p for p in parts if p[1] is not None]
    if len(fields) != 1 or fields[0][1] not in ("", "0"):
        raise ValueError(
            f"shard pattern {pattern!r} must have exactly one positional field, "
            "e.g. 'shard-{:06d}.tar'"
        )
    if "/" in pattern or not pattern.endswith(".tar") or pattern.startswith("."):
        raise ValueError(
            f"shard pattern {pattern!r} must name a .tar file in the output folder "
            "(no '/', not hidden)"
        )
    try:
        pattern.format(0)
    except (ValueError, IndexError) as e:
        raise ValueError(f"bad shard pattern {pattern!r}: {e}") from None
    prefix = "".join(p[0] for p in parts[: parts.index(fields[0]) + 1])
    suffix = "".join(p[0] for p in parts[parts.index(fields[0]) + 1 :])
    return prefix, suffix


def temp_path(final: Path) -> Path:
    """Where a shard is written before it is complete: hidden, and not a ``.tar`` (so
    neither ``fastload index DIR`` nor a glob picks it up)."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


class ShardWriter:
    """Writes samples into numbered tar shards in ``out_dir``; a new shard starts when the
    next sample would take the current one past ``max_size`` bytes or ``max_count``
    samples (a sample larger than ``max_size`` gets a shard of its own).

    ``write(sample)`` takes a dict with ``"__key__"`` (a str: a relative path whose last
    component has no dot) and fields: bytes-like, str, int, float, numpy arrays (stored
    as ``.npy``), dicts and lists (JSON), or values of a type with a registered encoder
    (:func:`register_encoder`). Shards are written under hidden temporary names and
    renamed into place when full; ``close()`` writes the index (``index``, relative to
    ``out_dir``; None for none) and returns it. On an exception inside ``with``, the
    partial shard is removed and no index is written.

    ``out_dir`` may be an object-store prefix (``"s3://bucket/prefix/"``, with
    ``storage_options`` as for :func:`fastload.stage`): each shard is uploaded as soon as
    it is complete (several in flight) and removed locally, and ``close()`` uploads the
    index last, once every shard is there (and returns None); on an exception no index
    is uploaded.
    """

    def __init__(
        self,
        out_dir: PathLike,
        *,
        pattern: str = DEFAULT_PATTERN,
        max_size: Size = "1GB",
        max_count: int | None = None,
        start_shard: int = 0,
        index: str | None = DEFAULT_INDEX,
        sync: bool = True,
        _name: Callable[[int], str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        check_pattern(pattern)
        if max_count is not None and max_count < 1:
            raise ValueError(f"max_count must be at least 1, not {max_count}")
        self._uploader: Any = None
        self.url: str | None = None
        self._skeletons: list[Path] = []
        if isinstance(out_dir, str) and _upload.is_store_url(out_dir):
            # Shards go to a temporary folder, each uploaded once complete; only its
            # headers stay (for the index, uploaded last by close()).
            self._uploader = _upload.Uploader(out_dir, storage_options)
            self.url = self._uploader.url
            out_dir = tempfile.mkdtemp(prefix="fastload-shards-")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.pattern = pattern
        self.max_size = parse_size(max_size)
        self.max_count = max_count
        self._name = _name or pattern.format
        self._next = start_shard
        self._index_name = index
        self._sync = sync
        self._file: Any = None  # _core.ShardFile of the shard being written
        self._count = 0
        self._shards: list[Path] = []
        self._shard_samples: list[int] = []
        self._samples = 0
        self._bytes = 0
        self._closed = False
        self._index: ShardIndex | None = None

    # --- writing ---

    def write(self, sample: Mapping[str, Any]) -> None:
        """Appends one sample (see the class documentation)."""
        if self._closed:
            raise ValueError("write() on a closed ShardWriter")
        key, fields = encode_sample(sample)
        size = sample_bytes(key, fields)
        f = self._file
        if f is not None and (
            (self.max_count is not None and self._count >= self.max_count)
            or f.bytes + size + END_BYTES > self.max_size
        ):
            self._finish_shard()
            f = None
        if f is None:
            f = self._open_shard()
        f.add_sample(key, fields)
        self._count += 1
        self._samples += 1

    def _open_shard(self) -> Any:
        final = self.out_dir / self._name(self._next)
        self._next += 1
        self._file = _core.ShardFile(final, temp_path(final))
        self._count = 0
        return self._file

    def _finish_shard(self) -> None:
        f, self._file = self._file, None
        if f is None:
            return
        size = f.bytes + END_BYTES
        f.commit(self._sync and self._uploader is None)
        self._shards.append(Path(f.path))
        self._shard_samples.append(self._count)
        self._bytes += size
        if self._uploader is not None:
            shard = Path(f.path)
            self._skeletons.append(_upload.skeleton_of(shard, self.out_dir))
            self._uploader.submit(shard, shard.name)

    # --- ending ---

    def close(self) -> ShardIndex | None:
        """Finishes the last shard and writes the index; returns it (None when no index
        was asked for or nothing was written). Idempotent."""
        if self._closed:
            return self._index
        self._closed = True
        if self._uploader is not None:
            self._close_upload()
            return None
        self._finish_shard()
        if self._index_name and self._shards:
            self._index = ShardIndex.build(self._shards, self.out_dir / self._index_name)
        return self._index

    def _close_upload(self) -> None:
        """Finishes the last shard, waits for every upload, then uploads the index."""
        up = self._uploader
        try:
            self._finish_shard()
            up.wait()
            if self._index_name and self._shards:
                dest = self.out_dir / self._index_name
                _upload.index_from_skeletons(self._skeletons, [p.name for p in self._shards],
                                             dest)
                up.submit_index(dest, self._index_name)
                up.wait()
        finally:
            up.close()
            shutil.rmtree(self.out_dir, ignore_errors=True)

    def abort(self) -> None:
        """Removes the shard being written (complete shards stay); no index is written."""
        self._closed = True
        f, self._file = self._file, None
        if f is not None:
            f.abort()
        if self._uploader is not None:  # complete shards stay uploaded; no index
            self._uploader.close()
            shutil.rmtree(self.out_dir, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # --- facts ---

    @property
    def shards(self) -> list[Path]:
        """The shards completed so far, in order."""
        return list(self._shards)

    @property
    def shard_samples(self) -> list[int]:
        """Samples in each completed shard."""
        return list(self._shard_samples)

    @property
    def samples(self) -> int:
        return self._samples

    @property
    def bytes(self) -> int:
        """Bytes of the completed shards."""
        return self._bytes

    @property
    def index(self) -> ShardIndex | None:
        return self._index

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"ShardWriter({os.fspath(self.out_dir)!r}, {self.pattern!r}: {self._samples} "
            f"samples, {len(self._shards)} shards done, {state})"
        )


# --- packing ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackResult:
    """What a pack wrote."""

    out_dir: Path | str
    """The folder written, or the bucket URL (a ``str`` ending in ``/``) the shards were
    uploaded to."""
    shards: tuple[Path | str, ...]
    """The shards this call wrote (with ``num_tasks > 1``: this task's); URLs when packed
    into a bucket."""
    samples: int
    """Samples in those shards."""
    bytes: int
    """Bytes of those shards."""
    seconds: float
    index: Path | str | None
    """The index written, a URL when packed into a bucket (None with several tasks: join
    them with ``fastload index``)."""
    total_shards: int
    """Shards of the whole pack, all tasks together."""
    total_samples: int
    classes: tuple[str, ...] | None = None
    """ImageFolder sources: the class names, ``cls`` being the position in this list."""
    skipped: int = 0
    """Source files or members left out: no key or no field (``README``, ``.hidden``),
    or not regular files."""
    skipped_examples: tuple[str, ...] = ()
