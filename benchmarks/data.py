"""Deterministic benchmark data sets, generated once and cached.

Every generator writes to the exact path it is given and is idempotent: the parameters
are recorded beside the output (``.NAME.params.json``), and a second call with the same
parameters returns at once. Output is built under a temporary name and renamed into
place, so an interrupted run never leaves a half-made data set that looks complete.
Use :func:`keyed` to get a cache path named by the parameters, under a folder named by
the generators' own content (:func:`generator_digest`: a changed generator never reuses
what an older one made), under ``$FASTLOAD_BENCH_DATA`` (default ``build/bench-data`` in
the checkout: nothing outside it, and ``rm -rf build`` takes it). A data set is built
under a lock of its own: a run that finds another one building it waits, then takes
that; nothing complete that another run may be reading is ever removed.

Content is random bytes from a seeded generator (SFC64: ~1.5 GB/s), so two runs with
the same seed produce identical files on any machine. The peers' copies of the record
shards (:func:`mds_records`, :func:`litdata_records`, :func:`arrow_records`) are written
from those shards, so every tool reads the very same samples.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = [
    "arrow_records",
    "cache_dir",
    "generator_digest",
    "imagenet_like_tar",
    "imagenet_like_tree",
    "keyed",
    "large_files",
    "litdata_records",
    "lognormal_sizes",
    "mds_records",
    "shard_records",
    "small_record_shards",
    "tar_of_tars",
    "tree_stats",
]

_JPEG_HEAD = bytes.fromhex("ffd8ffe000104a46494600010101004800480000")  # SOI + JFIF APP0
_JPEG_TAIL = bytes.fromhex("ffd9")  # EOI
_BLOCK = 16 << 20  # generation block for large files
_FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}


_HERE = Path(__file__).resolve().parent
# What makes the data: this file, and the peers' imports their copies are written with.
_GENERATORS = (_HERE / "data.py", _HERE / "_peer_imports.py")


def cache_dir() -> Path:
    """Where generated data sets live (``$FASTLOAD_BENCH_DATA``, else build/bench-data)."""
    default = _HERE.parent / "build" / "bench-data"
    return Path(os.environ.get("FASTLOAD_BENCH_DATA", default))


def generator_digest() -> str:
    """12 hex digits of SHA-256 over the generators' source: the key of what they make."""
    h = hashlib.sha256()
    for p in _GENERATORS:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def keyed(kind: str, **params: Any) -> Path:
    """A cache path named by ``kind`` and the parameters, e.g. ``tree-n300-c10-kb8-s0``,
    in the folder of this generator (``gen-`` and :func:`generator_digest`)."""
    parts = [kind] + [f"{k}{v}" for k, v in sorted(params.items())]
    name = "-".join(str(p).replace("/", "_") for p in parts)
    return cache_dir() / f"gen-{generator_digest()}" / name


def _rng(seed: int, stream: int = 0) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64([seed, stream]))


def _random_bytes(rng: np.random.Generator, n: int) -> bytes:
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.tobytes()[:n]


def lognormal_sizes(n: int, mean_bytes: float, seed: int, sigma: float = 0.7) -> np.ndarray:
    """``n`` file sizes, log-normal with the given mean (ImageNet's train set is close to
    mean 110 KB, sigma 0.7), clipped to [1 KiB, 20 x mean]."""
    mu = np.log(mean_bytes) - sigma * sigma / 2
    sizes = _rng(seed, 1).lognormal(mu, sigma, size=n)
    return np.clip(sizes, 1024, 20 * mean_bytes).astype(np.int64)


def _jpeg_like(rng: np.random.Generator, size: int) -> bytes:
    body = max(0, size - len(_JPEG_HEAD) - len(_JPEG_TAIL))
    return (_JPEG_HEAD + _random_bytes(rng, body) + _JPEG_TAIL)[:size]


def _params_file(path: Path) -> Path:
    return path.parent / f".{path.name}.params.json"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Held while ``path`` is checked and built: one builder at a time, across processes.
    The lock files live in the cache's ``.locks`` (kept: removing one races its users),
    named by the path, so nothing is left beside the data."""
    locks = cache_dir() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    with open(locks / name, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _complete(path: Path, record: Path, want: str) -> bool:
    try:
        return path.exists() and record.read_text() == want
    except OSError:
        return False


def _cached(path: Path, params: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """Runs ``build(tmp)`` unless ``path`` already holds output made with ``params`` by
    this generator. Under the lock, an output without its record is the leftover of an
    interrupted build (a builder writes the record before it lets go), so it is replaced;
    one with other parameters or of another generator is replaced only at a path the
    caller chose (:func:`keyed` paths differ by both)."""
    path = Path(path)
    record = _params_file(path)
    want = json.dumps({**params, "generator": generator_digest()}, sort_keys=True)
    if _complete(path, record, want):
        return path
    with _locked(path):
        if _complete(path, record, want):  # another run built it while this one waited
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove(path)
        record.unlink(missing_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
        _remove(tmp)
        try:
            build(tmp)
            os.replace(tmp, path)
        finally:
            _remove(tmp)
        # The record is written last: its presence means the output is complete.
        rec_tmp = record.with_name(record.name + ".tmp")
        rec_tmp.write_text(want)
        os.replace(rec_tmp, record)
    return path


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def _tree_members(
    n_files: int, n_classes: int, mean_kb: float, seed: int
) -> Iterator[tuple[str, int, int]]:
    """(relative path, size, index) for each file of an ImageNet-like tree."""
    sizes = lognormal_sizes(n_files, mean_kb * 1024, seed)
    for i in range(n_files):
        cls = _class_dir(i % n_classes, n_classes)
        yield f"{cls}/{cls}_{i:08d}.JPEG", int(sizes[i]), i


def _class_dir(c: int, n_classes: int) -> str:
    return f"n{c:0{max(4, len(str(n_classes - 1)))}d}"


def imagenet_like_tree(
    root: Path, n_files: int, n_classes: int, mean_kb: float = 100, seed: int = 0
) -> Path:
    """Class directories of JPEG-like files (random bytes behind a JPEG header), sizes
    log-normal around ``mean_kb``. Returns ``root``."""
    params = {"kind": "tree", "n": n_files, "classes": n_classes, "kb": mean_kb, "seed": seed}

    def build(tmp: Path) -> None:
        rng = _rng(seed)
        for c in range(n_classes):
            (tmp / _class_dir(c, n_classes)).mkdir(parents=True)
        for rel, size, _ in _tree_members(n_files, n_classes, mean_kb, seed):
            (tmp / rel).write_bytes(_jpeg_like(rng, size))

    return _cached(root, params, build)


def large_files(root: Path, n: int, size_bytes: int, seed: int = 0) -> Path:
    """A directory of ``n`` files of ``size_bytes`` random bytes each. Returns ``root``."""
    params = {"kind": "large", "n": n, "size": size_bytes, "seed": seed}

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        for i in range(n):
            rng = _rng(seed, 100 + i)
            with open(tmp / f"large-{i:03d}.bin", "wb") as f:
                left = size_bytes
                while left > 0:
                    k = min(left, _BLOCK)
                    f.write(_random_bytes(rng, k))
                    left -= k

    return _cached(root, params, build)


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 1_700_000_000
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    return ti


def _gnu_tar_available() -> bool:
    try:
        out = subprocess.run(["tar", "--version"], capture_output=True, text=True, check=False)
    except OSError:
        return False
    return "GNU tar" in out.stdout


def imagenet_like_tar(
    path: Path,
    n_files: int,
    n_classes: int,
    mean_kb: float = 100,
    seed: int = 0,
    *,
    fmt: str = "gnu",
    tool: str = "python",
) -> Path:
    """One tar of an ImageNet-like tree (the same files as :func:`imagenet_like_tree`),
    in ``fmt`` (``ustar``, ``gnu``, ``pax``), written by Python ``tarfile`` or GNU ``tar``
    (``tool="gnu"``, deterministic: sorted names, fixed mtime and owner)."""
    if fmt not in _FORMATS:
        raise ValueError(f"unknown tar format {fmt!r}; expected one of {sorted(_FORMATS)}")
    if tool not in ("python", "gnu"):
        raise ValueError(f"unknown tar tool {tool!r}; expected 'python' or 'gnu'")
    params = {
        "kind": "tar",
        "n": n_files,
        "classes": n_classes,
        "kb": mean_kb,
        "seed": seed,
        "fmt": fmt,
        "tool": tool,
    }

    def build(tmp: Path) -> None:
        if tool == "gnu":
            if not _gnu_tar_available():
                raise RuntimeError("GNU tar is not installed")
            tree = imagenet_like_tree(
                keyed("tree", n=n_files, c=n_classes, kb=mean_kb, s=seed),
                n_files,
                n_classes,
                mean_kb,
                seed,
            )
            fmt_arg = {"ustar": "ustar", "gnu": "gnu", "pax": "posix"}[fmt]
            subprocess.run(
                [
                    "tar",
                    "-C",
                    str(tree),
                    "-cf",
                    str(tmp),
                    f"--format={fmt_arg}",
                    "--sort=name",
                    "--mtime=@1700000000",
                    "--owner=0",
                    "--group=0",
                    "--numeric-owner",
                    ".",
                ],
                check=True,
            )
            return
        rng = _rng(seed)
        with tarfile.open(tmp, "w", format=_FORMATS[fmt]) as tf:
            for rel, size, _ in _tree_members(n_files, n_classes, mean_kb, seed):
                tf.addfile(_tarinfo(rel, size), io.BytesIO(_jpeg_like(rng, size)))

    return _cached(path, params, build)


def tar_of_tars(
    path: Path,
    n_inner: int,
    files_per_inner: int,
    mean_kb: float = 100,
    seed: int = 0,
    *,
    fmt: str = "gnu",
) -> Path:
    """A tar whose members are tars (ImageNet's ILSVRC2012_img_train.tar: one tar per
    class), each holding ``files_per_inner`` JPEG-like files. Python ``tarfile``."""
    if fmt not in _FORMATS:
        raise ValueError(f"unknown tar format {fmt!r}; expected one of {sorted(_FORMATS)}")
    params = {
        "kind": "tar_of_tars",
        "inner": n_inner,
        "per": files_per_inner,
        "kb": mean_kb,
        "seed": seed,
        "fmt": fmt,
    }

    def build(tmp: Path) -> None:
        rng = _rng(seed)
        sizes = lognormal_sizes(n_inner * files_per_inner, mean_kb * 1024, seed)
        with tarfile.open(tmp, "w", format=_FORMATS[fmt]) as outer:
            for c in range(n_inner):
                buf = io.BytesIO()
                with tarfile.open(fileobj=buf, mode="w", format=_FORMATS[fmt]) as inner:
                    for j in range(files_per_inner):
                        size = int(sizes[c * files_per_inner + j])
                        name = f"n{c:05d}_{j:08d}.JPEG"
                        inner.addfile(_tarinfo(name, size), io.BytesIO(_jpeg_like(rng, size)))
                data = buf.getvalue()
                outer.addfile(_tarinfo(f"n{c:05d}.tar", len(data)), io.BytesIO(data))

    return _cached(path, params, build)


def small_record_shards(
    root: Path,
    n_samples: int,
    record_kb: float,
    samples_per_shard: int,
    seed: int = 0,
    *,
    fmt: str = "gnu",
) -> Path:
    """webdataset-style shards ``shard-NNNNNN.tar`` in ``root``: per sample a ``KEY.jpg``
    of about ``record_kb`` (log-normal), a ``KEY.cls`` (class number as text) and a
    ``KEY.json``, grouped by key in order. Returns ``root``."""
    if samples_per_shard < 1:
        raise ValueError("samples_per_shard must be at least 1")
    params = {
        "kind": "shards",
        "n": n_samples,
        "kb": record_kb,
        "per": samples_per_shard,
        "seed": seed,
        "fmt": fmt,
    }

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        rng = _rng(seed)
        sizes = lognormal_sizes(n_samples, record_kb * 1024, seed)
        labels = _rng(seed, 2).integers(0, 1000, size=n_samples)
        n_shards = (n_samples + samples_per_shard - 1) // samples_per_shard
        for s in range(n_shards):
            with tarfile.open(tmp / f"shard-{s:06d}.tar", "w", format=_FORMATS[fmt]) as tf:
                for i in range(s * samples_per_shard, min(n_samples, (s + 1) * samples_per_shard)):
                    key = f"sample{i:08d}"
                    label = int(labels[i])
                    members = [
                        (f"{key}.jpg", _jpeg_like(rng, int(sizes[i]))),
                        (f"{key}.cls", str(label).encode()),
                        (f"{key}.json", json.dumps({"key": key, "label": label}).encode()),
                    ]
                    for name, data in members:
                        tf.addfile(_tarinfo(name, len(data)), io.BytesIO(data))

    return _cached(root, params, build)


# --- the same records in the peers' own formats -------------------------------------------
#
# Each is written from the tar shards of small_record_shards (read back with tarfile, so the
# bytes are the very same), cached beside them like every data set here: per sample the
# key as ``__key__`` (a string) and ``jpg``, ``cls`` and ``json`` as raw bytes, exactly the
# payloads fastload and webdataset read from the tars. The peers' packages are imported
# only here and only when such a data set is built.

_RECORD_FIELDS = ("jpg", "cls", "json")


def shard_records(paths: list[Path] | list[str]) -> Iterator[dict[str, Any]]:
    """The samples of webdataset-style tar shards in order: ``{"__key__": str, ext: bytes}``
    per key (members grouped by key, as small_record_shards writes them)."""
    for path in paths:
        sample: dict[str, Any] = {}
        with tarfile.open(path, "r|") as tf:
            for m in tf:
                if not m.isfile():
                    continue
                key, ext = m.name.split(".", 1)
                if sample and sample["__key__"] != key:
                    yield sample
                    sample = {}
                f = tf.extractfile(m)
                assert f is not None
                sample["__key__"] = key
                sample[ext] = f.read()
        if sample:
            yield sample


def _shard_paths(shards: Path) -> list[Path]:
    return sorted(Path(shards).glob("shard-*.tar"))


def _source_params(shards: Path) -> Any:
    try:
        return json.loads(_params_file(Path(shards)).read_text())
    except OSError:
        return str(shards)


def mds_records(root: Path, shards: Path, size_limit: int | str = 1 << 26) -> Path:
    """The records of ``shards`` as a MosaicML streaming MDS data set (``MDSWriter``,
    uncompressed, its default 64 MiB shard size limit unless given). Returns ``root``."""
    from _peer_imports import import_streaming, quiet

    streaming = import_streaming()
    params = {
        "kind": "mds",
        "source": _source_params(shards),
        "size_limit": size_limit,
        "version": streaming.__version__,
    }

    def build(tmp: Path) -> None:
        columns = {"__key__": "str", **dict.fromkeys(_RECORD_FIELDS, "bytes")}
        with (
            quiet(),
            streaming.MDSWriter(out=str(tmp), columns=columns, size_limit=size_limit) as w,
        ):
            for sample in shard_records(_shard_paths(shards)):
                w.write(sample)

    return _cached(root, params, build)


def _litdata_shard(path: str) -> Iterator[dict[str, Any]]:
    yield from shard_records([path])


def litdata_records(
    root: Path,
    shards: Path,
    *,
    chunk_bytes: str | None = "64MB",
    chunk_size: int | None = None,
    workers: int = 1,
) -> Path:
    """The records of ``shards`` as a litdata data set: ``litdata.optimize`` over the tar
    shards (each input yields its shard's samples), 64 MB chunks unless ``chunk_size``
    (samples per chunk) is given. One worker by default, so the chunks keep the shards'
    order. Returns ``root``."""
    from _peer_imports import import_litdata, quiet

    ld = import_litdata()
    params = {
        "kind": "litdata",
        "source": _source_params(shards),
        "chunk_bytes": chunk_bytes,
        "chunk_size": chunk_size,
        "workers": workers,
        "version": ld.__version__,
    }

    def build(tmp: Path) -> None:
        size = {"chunk_size": chunk_size} if chunk_size else {"chunk_bytes": chunk_bytes}
        with quiet():  # e.g. "an item was larger than the target chunk size"
            ld.optimize(
                fn=_litdata_shard,
                inputs=[str(p) for p in _shard_paths(shards)],
                output_dir=str(tmp),
                num_workers=workers,
                reorder_files=False,
                start_method="fork",  # its default, spawn, would re-import the caller
                verbose=False,
                **size,
            )
        # optimize() reports a failed worker but returns: count what it wrote.
        index = json.loads((tmp / "index.json").read_text())
        written = sum(c["chunk_size"] for c in index["chunks"])
        expected = _source_params(shards)
        if isinstance(expected, dict) and written != expected.get("n"):
            raise RuntimeError(f"litdata.optimize wrote {written} samples, not {expected['n']}")

    return _cached(root, params, build)


def arrow_records(root: Path, shards: Path) -> Path:
    """The records of ``shards`` as a Hugging Face ``datasets`` data set on disk
    (``Dataset.from_generator(...).save_to_disk``: Arrow files, memory-mapped by
    ``load_from_disk``). Returns ``root``."""
    from _peer_imports import import_datasets, quiet

    hf = import_datasets()
    params = {"kind": "arrow", "source": _source_params(shards), "version": hf.__version__}
    features = hf.Features(
        {"__key__": hf.Value("string"), **{f: hf.Value("binary") for f in _RECORD_FIELDS}}
    )

    def build(tmp: Path) -> None:
        scratch = tmp.parent / f"{tmp.name}.hfcache"
        try:
            with quiet():
                ds = hf.Dataset.from_generator(
                    shard_records,
                    features=features,
                    gen_kwargs={"paths": _shard_paths(shards)},
                    cache_dir=str(scratch),
                    keep_in_memory=False,
                )
                ds.save_to_disk(str(tmp))
                del ds
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    return _cached(root, params, build)


def tree_stats(root: Path) -> tuple[int, int]:
    """(regular files, total bytes) under ``root``, symlinks not followed."""
    files = total = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                files += 1
                total += st.st_size
    return files, total
