"""Deterministic benchmark data sets, generated once and cached.

Every generator writes to the exact path it is given and is idempotent: the parameters
are recorded beside the output (``.NAME.params.json``), and a second call with the same
parameters returns at once. Output is built under a temporary name and renamed into
place, so an interrupted run never leaves a half-made data set that looks complete.
Use :func:`keyed` to get a cache path named by the parameters, under
``$FASTLOAD_BENCH_DATA`` (default ``/tmp/fastload-bench-data``).

Content is random bytes from a seeded generator (SFC64: ~1.5 GB/s), so two runs with
the same seed produce identical files on any machine.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = [
    "cache_dir",
    "imagenet_like_tar",
    "imagenet_like_tree",
    "keyed",
    "large_files",
    "lognormal_sizes",
    "small_record_shards",
    "tar_of_tars",
    "tree_stats",
]

_JPEG_HEAD = bytes.fromhex("ffd8ffe000104a46494600010101004800480000")  # SOI + JFIF APP0
_JPEG_TAIL = bytes.fromhex("ffd9")  # EOI
_BLOCK = 16 << 20  # generation block for large files
_FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}


def cache_dir() -> Path:
    """Where generated data sets live (``$FASTLOAD_BENCH_DATA``)."""
    return Path(os.environ.get("FASTLOAD_BENCH_DATA", "/tmp/fastload-bench-data"))


def keyed(kind: str, **params: Any) -> Path:
    """A cache path named by ``kind`` and the parameters, e.g. ``tree-n300-c10-kb8-s0``."""
    parts = [kind] + [f"{k}{v}" for k, v in sorted(params.items())]
    return cache_dir() / "-".join(str(p).replace("/", "_") for p in parts)


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


def _cached(path: Path, params: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """Runs ``build(tmp)`` unless ``path`` already holds output made with ``params``."""
    path = Path(path)
    record = _params_file(path)
    want = json.dumps(params, sort_keys=True)
    try:
        if path.exists() and record.read_text() == want:
            return path
    except OSError:
        pass
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
