"""Shards of samples: the samples the index, data and packing tests share, shards of them
written by every writer (Python's tarfile, GNU tar, webdataset), and each reader's view of
a set of shards as {key: {field: bytes}} (fastload's index, webdataset, wids, tarfile, GNU
tar), in the order it met the samples.
"""

from __future__ import annotations

import importlib.util
import random
import shutil
import subprocess
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import fastload
from fastload import ShardIndex
from fastload.packing.plan import split_key
from kit import tars
from kit.tools import require_module

Sample = tuple[str, dict[str, bytes]]
Fields = dict[str, bytes]

HAVE_TORCH = importlib.util.find_spec("torch") is not None


class _Reader:
    """ShardIndexDataset's fetch path where torch (its base class) is not installed."""

    def __init__(self, idx: ShardIndex, fields: list[str] | None = None, copy: bool = False,
                 access: str = "mmap") -> None:
        self.native, self.args = idx._native, (fields, copy, access)

    def __len__(self) -> int:
        return len(self.native)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return self.native.fetch(indices, *self.args)  # type: ignore[no-any-return]


def reader(source: ShardIndex | Path, **kwargs: Any) -> Any:
    """A ShardIndexDataset, or (without torch) the same native fetch behind it."""
    if HAVE_TORCH:
        return fastload.ShardIndexDataset(source, **kwargs)
    idx = source if isinstance(source, ShardIndex) else ShardIndex.open(source)
    return _Reader(idx, **kwargs)

# --------------------------------------------------------------------------------------
# Samples and shard writers
# --------------------------------------------------------------------------------------


def make_samples(
    n: int, *, seed: int = 0, long_keys: str = "pax", prefix: str = ""
) -> list[Sample]:
    """``n`` samples: keys in dotted directories, three fields (one with a dot in its
    name), empty payloads, and (``long_keys``) keys past 100 bytes ("ustar": split at a
    slash so a ustar prefix holds them) or past 255 ("pax": any layout)."""
    rng = random.Random(seed)
    out: list[Sample] = []
    for i in range(n):
        if long_keys == "pax" and i == 1:
            key = f"{prefix}d.v1/" + "k" * 150 + f"{i}"  # base name alone > 100
        elif long_keys == "pax" and i == 2:
            key = f"{prefix}deep/" + "/".join(["dir.x"] * 20) + "/" + "y" * 120 + str(i)  # > 255
        elif long_keys == "ustar" and i == 1:
            key = f"{prefix}" + "p" * 90 + "/" + "q" * 60 + str(i)  # > 100, fits prefix+name
        else:
            key = f"{prefix}dir.with.dots/s{i:05d}"
        fields = {
            "jpg": rng.randbytes(rng.randrange(0, 3000)),
            "cls": str(i).encode(),
            "seg.png": b"" if i % 3 == 0 else rng.randbytes(rng.randrange(1, 700)),
        }
        out.append((key, fields))
    return out


def _members(samples: Sequence[Sample]) -> list[tuple[str, bytes]]:
    return [(f"{key}.{field}", data) for key, fields in samples for field, data in fields.items()]


def write_tarfile(path: Path, samples: Sequence[Sample], fmt: str = "pax") -> Path:
    members = []
    for name, data in _members(samples):
        ti = tarfile.TarInfo(name)
        ti.mtime = 1_700_000_000
        members.append((ti, data))
    return tars.members_archive(path, members, tars.PY_FORMATS[fmt])


def write_gnutar(path: Path, samples: Sequence[Sample], fmt: str = "posix") -> Path:
    """GNU tar, members in sample order (a file list, no recursion)."""
    tars.need_gnu_tar()
    src = path.parent / f".{path.name}.src"
    names = []
    for name, data in _members(samples):
        p = src / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        names.append(name)
    listing = path.parent / f".{path.name}.list"
    listing.write_text("\n".join(names) + "\n")
    subprocess.run(
        ["tar", "-C", str(src), "-cf", str(path), f"--format={fmt}", "--no-recursion",
         "-T", str(listing)],
        check=True,
    )
    shutil.rmtree(src)
    listing.unlink()
    return path


def write_wds(path: Path, samples: Sequence[Sample]) -> Path:
    wds = require_module("webdataset")
    with wds.TarWriter(str(path)) as w:
        for key, fields in samples:
            w.write({"__key__": key, **fields})
    return path


def write_wds_shards(folder: Path, samples: Sequence[Sample], per_shard: int) -> list[Path]:
    wds = require_module("webdataset")
    folder.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(folder / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as w:
        for key, fields in samples:
            w.write({"__key__": key, **fields})
    return sorted(folder.glob("shard-*.tar"))


def check_samples(ds: Any, samples: Sequence[Sample]) -> None:
    """Every sample of ``ds`` equals the one written, in order, by position and key."""
    assert len(ds) == len(samples)
    got = ds.__getitems__(list(range(len(ds))))
    ones = (ds[i] for i in range(len(ds)))
    for (key, fields), one, batch in zip(samples, ones, got, strict=True):
        for s in (one, batch):
            assert s["__key__"] == key
            assert {k: bytes(v) for k, v in s.items() if k != "__key__"} == fields


# --------------------------------------------------------------------------------------
# Readers: each returns {key: {field: bytes}} in the order it met the samples.
# --------------------------------------------------------------------------------------


def read_fastload(index: Path | ShardIndex) -> dict[str, Fields]:
    """Through ShardIndexDataset (or its native fetch where torch is missing)."""
    ds = reader(index if isinstance(index, ShardIndex) else ShardIndex.open(index))
    out: dict[str, Fields] = {}
    for s in ds.__getitems__(list(range(len(ds)))):
        out[s["__key__"]] = {k: bytes(v) for k, v in s.items() if k != "__key__"}
    return out


def read_webdataset(shards: Iterable[Path]) -> dict[str, Fields]:
    """webdataset's own tar reader and key grouping (suffixes kept in their case)."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    out: dict[str, Fields] = {}
    for p in shards:
        with open(p, "rb") as f:
            members = tar_file_expander([{"url": str(p), "stream": f}])
            for s in group_by_keys(members, lcase=False):
                out[s["__key__"]] = {k: v for k, v in s.items() if not k.startswith("__")}
    return out


def read_wids(index: Path) -> dict[str, Fields]:
    """wids's ShardListDataset over the shards (its own header parser, ustar names only)."""
    wids = require_module("wids")
    idx = ShardIndex.open(index)
    desc = [{"url": s.path, "nsamples": s.samples} for s in idx.shards]
    ds = wids.ShardListDataset(desc, localname=_identity, transformations=[])
    out: dict[str, Fields] = {}
    try:
        for i in range(len(ds)):
            s = ds[i]
            out[s["__key__"]] = {
                k[1:]: v.getvalue() for k, v in s.items() if not k.startswith("__")
            }
    finally:
        ds.close()
    return out


def _identity(url: str) -> str:
    return url


def read_tarfile(shards: Iterable[Path]) -> dict[str, Fields]:
    out: dict[str, Fields] = {}
    for p in shards:
        with tarfile.open(p) as tf:
            for m in tf:
                key, field = split_key(m.name) or ("?", "?")
                f = tf.extractfile(m)
                assert f is not None
                out.setdefault(key, {})[field] = f.read()
    return out


def read_gnu_tar(shards: Iterable[Path], work: Path) -> dict[str, Fields]:
    """Extracted by GNU tar, which must not warn; then read from the files."""
    out: dict[str, Fields] = {}
    for i, p in enumerate(shards):
        d = work / f"x{i}"
        d.mkdir(parents=True)
        r = subprocess.run(["tar", "-xf", str(p), "-C", str(d)], capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        listed = subprocess.run(["tar", "-tf", str(p)], capture_output=True, text=True, check=True)
        for name in listed.stdout.splitlines():
            key, field = split_key(name) or ("?", "?")
            out.setdefault(key, {})[field] = (d / name).read_bytes()
    return out
