"""ShardWriter, pack(iterable) and pack_dataset: what is written is what every reader
(fastload's index, webdataset, wids, Python's tarfile, GNU tar) reads back; the same
samples give the same bytes; limits; encoders; refusals; the pure planning functions.

The readers are kit.shards'.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload
from fastload import ShardIndex, ShardWriter, _core
from fastload.packing.plan import cut_shards, member_bytes, permutation, split_key, task_shards
from fastload.packing.writer import encoders, parse_size, register_encoder
from kit import tars
from kit.shards import (
    Fields,
    read_fastload,
    read_gnu_tar,
    read_tarfile,
    read_webdataset,
    read_wids,
)

pytestmark = pytest.mark.native

MTIME = 946684800

# --------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------


def mixed_samples(n: int, *, long_keys: bool = True) -> list[dict[str, Any]]:
    """Samples with every kind of value, keys in folders, and (long_keys) a key past
    100 bytes and one past 255 (pax), one non-ASCII."""
    rng = np.random.default_rng(n)
    out: list[dict[str, Any]] = []
    for i in range(n):
        key = f"part{i % 3}/s{i:05d}"
        if long_keys and i == 1:
            key = "d.v1/" + "k" * 150 + str(i)
        elif long_keys and i == 2:
            key = "deep/" + "/".join(["dir.x"] * 25) + "/" + "y" * 120
        elif i == 3:
            key = f"naïve/ключ{i}"
        out.append(
            {
                "__key__": key,
                "__url__": "ignored metadata",
                "jpg": rng.integers(0, 256, int(rng.integers(0, 2000)), dtype=np.uint8).tobytes(),
                "cls": int(i % 7),
                "txt": f"text {i} é",
                "seg.npy": np.arange(i % 5 * 3, dtype=np.float32).reshape(-1, 3),
                "json": {"i": i, "tags": ["a", "b"]},
                "empty": b"",
            }
        )
    return out


def expected(samples: Sequence[dict[str, Any]]) -> dict[str, Fields]:
    """What the writer must store for each sample."""
    out: dict[str, Fields] = {}
    for s in samples:
        fields: Fields = {}
        for k, v in s.items():
            if k.startswith("__"):
                continue
            if isinstance(v, np.ndarray):
                buf = io.BytesIO()
                np.save(buf, v, allow_pickle=False)
                fields[k] = buf.getvalue()
            elif isinstance(v, (dict, list)):
                fields[k] = json.dumps(v, ensure_ascii=False).encode()
            elif isinstance(v, str):
                fields[k] = v.encode()
            elif isinstance(v, int):
                fields[k] = str(v).encode()
            else:
                fields[k] = bytes(v)
        out[s["__key__"]] = fields
    return out


def write(out: Path, samples: Iterable[dict[str, Any]], **kw: Any) -> ShardWriter:
    with ShardWriter(out, **kw) as w:
        for s in samples:
            w.write(s)
    return w


# --------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------


def test_every_reader_reads_what_was_written(tmp_path: Path) -> None:
    samples = mixed_samples(40)
    w = write(tmp_path / "out", samples, max_count=9)
    assert w.index is not None and len(w.shards) == 5 and w.samples == 40
    assert w.shard_samples == [9, 9, 9, 9, 4]
    want = expected(samples)
    assert read_fastload(w.index) == want
    assert list(read_fastload(w.index)) == [s["__key__"] for s in samples]  # written order
    assert read_webdataset(w.shards) == want
    assert read_tarfile(w.shards) == want
    if tars.GNU_TAR is not None:
        assert read_gnu_tar(w.shards, tmp_path / "gnu") == want
    # Every member's metadata is fixed, and fields are in sorted order.
    with tarfile.open(w.shards[0]) as tf:
        members = tf.getmembers()
    assert [m.name for m in members[:7]] == [
        f"part0/s00000.{f}" for f in sorted(["jpg", "cls", "txt", "seg.npy", "json", "empty"])
    ] + ["d.v1/" + "k" * 150 + "1.cls"]
    for m in members:
        assert (m.mode, m.uid, m.gid, m.uname, m.gname, m.mtime) == (0o644, 0, 0, "", "", MTIME)
        assert m.type == tarfile.REGTYPE


def test_wids_reads_short_keys(tmp_path: Path) -> None:
    samples = mixed_samples(30, long_keys=False)
    w = write(tmp_path / "out", samples, max_count=8)
    assert w.index is not None
    assert read_wids(w.index.path) == expected(samples)


def test_same_samples_same_bytes(tmp_path: Path) -> None:
    samples = mixed_samples(25)
    reordered = [dict(reversed(list(s.items()))) for s in samples]  # field order differs
    a = write(tmp_path / "a", samples, max_size="20KB")
    b = write(tmp_path / "b", reordered, max_size="20KB")
    assert len(a.shards) > 1
    assert [p.read_bytes() for p in a.shards] == [p.read_bytes() for p in b.shards]
    # And the same as pack() of the same iterable.
    r = fastload.pack(iter(samples), tmp_path / "c", max_size="20KB")
    assert [p.read_bytes() for p in r.shards] == [p.read_bytes() for p in a.shards]
    assert r.index == tmp_path / "c" / "index.fidx"


def test_headers_are_what_tarfile_reads() -> None:
    for name, size in [("a.b", 0), ("x/" * 60 + "y.z", 7), ("k" * 100 + ".v", 512)]:
        h = _core.tar_header(name, size)
        body = h + b"x" * size + b"\0" * (-size % 512) + b"\0" * 1024
        with tarfile.open(fileobj=io.BytesIO(body)) as tf:
            (m,) = tf.getmembers()
            assert (m.name, m.size, m.mtime) == (name, size, MTIME)
    # A size past 8 GiB goes in a pax record (the ustar field holds 0).
    h = _core.tar_header("k.v", 8 << 30)
    assert b" size=8589934592\n" in h[512:-512]
    assert tarfile.TarInfo.frombuf(h[-512:], "utf-8", "surrogateescape").size == 0
    # The Python size arithmetic agrees with the native writer's.
    lens = np.array([1, 100, 101, 250, 999, 5, 5], dtype=np.uint64)
    sizes = np.array([0, 511, 512, 513, 1 << 20, 0o77777777777, 0o77777777777 + 1], np.uint64)
    assert (member_bytes(lens, sizes) == _core.tar_member_bytes(lens, sizes)).all()
    for n, s in zip(lens.tolist(), sizes.tolist(), strict=True):
        assert len(_core.tar_header("a" * n, s)) + s + (-s % 512) == int(
            member_bytes(np.array([n], np.uint64), np.array([s], np.uint64))[0]
        )


# --------------------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------------------


def test_max_size_and_max_count(tmp_path: Path) -> None:
    samples = [{"__key__": f"k{i:04d}", "bin": bytes(200 + 37 * i)} for i in range(60)]
    w = write(tmp_path / "s", samples, max_size=8000)
    sizes = [p.stat().st_size for p in w.shards]
    assert max(sizes) <= 8000 and len(w.shards) > 3
    # Greedy: a shard is cut only when the next sample would not fit.
    for p, nxt in zip(w.shards[:-1], w.shard_samples[1:], strict=True):
        first_next = samples[sum(w.shard_samples[: w.shards.index(p) + 1])]
        assert p.stat().st_size + 512 + -(-len(first_next["bin"]) // 512) * 512 > 8000
        assert nxt >= 1
    assert sum(w.shard_samples) == 60
    w2 = write(tmp_path / "c", samples, max_count=7, max_size="1GB")
    assert w2.shard_samples == [7] * 8 + [4]
    # A sample larger than max_size gets a shard of its own.
    big = [{"__key__": "a", "bin": bytes(100)}, {"__key__": "b", "bin": bytes(5000)},
           {"__key__": "c", "bin": bytes(100)}]  # fmt: skip
    w3 = write(tmp_path / "big", big, max_size=3000)
    assert w3.shard_samples == [1, 1, 1]
    assert [p.stat().st_size for p in w3.shards] == [2048, 6656, 2048]


def test_parse_size() -> None:
    assert parse_size("1GB") == 10**9
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("500 MB") == 500 * 10**6
    assert parse_size("1.5KiB") == 1536
    assert parse_size(3e9) == 3 * 10**9
    assert parse_size(1000) == 1000
    for bad in ("", "1XB", "-5", "0", "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(TypeError):
        parse_size(True)


# --------------------------------------------------------------------------------------
# Encoders and refusals
# --------------------------------------------------------------------------------------


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y


class Point3(Point):
    pass


def test_register_encoder(tmp_path: Path) -> None:
    register_encoder(Point, lambda p: f"{p.x},{p.y}".encode())
    try:
        assert Point in encoders()
        with pytest.raises(TypeError):
            encoders()[int] = str  # type: ignore[index]
        w = write(tmp_path / "o", [{"__key__": "a", "pt": Point(1, 2)},
                                   {"__key__": "b", "pt": Point3(3, 4)}])  # fmt: skip
        assert w.index is not None
        assert read_fastload(w.index) == {"a": {"pt": b"1,2"}, "b": {"pt": b"3,4"}}
        register_encoder(Point, lambda p: 42)  # type: ignore[arg-type,return-value]
        with pytest.raises(TypeError, match="returned int"), ShardWriter(tmp_path / "p") as w2:
            w2.write({"__key__": "a", "pt": Point(1, 2)})
        with pytest.raises(TypeError):
            register_encoder("Point", bytes)  # type: ignore[arg-type]
    finally:
        fastload.packing.writer._ENCODERS.pop(Point, None)


@pytest.mark.parametrize(
    ("sample", "error", "match"),
    [
        ({"__key__": "a/b.c", "x": b""}, ValueError, "dot in its last component"),
        ({"__key__": "", "x": b""}, ValueError, "invalid sample key"),
        ({"__key__": "../x", "x": b""}, ValueError, "invalid sample key"),
        ({"__key__": "/abs", "x": b""}, ValueError, "invalid sample key"),
        ({"__key__": "a//b", "x": b""}, ValueError, "invalid sample key"),
        ({"__key__": 7, "x": b""}, TypeError, "must be a str"),
        ({"x": b""}, ValueError, "no '__key__'"),
        ({"__key__": "a"}, ValueError, "no fields"),
        ({"__key__": "a", "a/b": b""}, ValueError, "invalid field name"),
        ({"__key__": "a", "": b""}, ValueError, "invalid field name"),
        ({"__key__": "a", "x": object()}, TypeError, "register_encoder"),
        ({"__key__": "a", "x": np.array([object()])}, ValueError, "pickle"),
    ],
)
def test_refused_samples(tmp_path: Path, sample: dict[str, Any], error: type, match: str) -> None:
    with ShardWriter(tmp_path) as w:
        with pytest.raises(error, match=match):
            w.write(sample)
        w.write({"__key__": "ok", "x": b"1"})  # the writer is still usable
    assert w.samples == 1


def test_exception_inside_with_removes_the_partial_shard(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), ShardWriter(tmp_path, max_count=2) as w:
        for i in range(5):
            w.write({"__key__": f"k{i}", "x": b"abc"})
        raise RuntimeError("stop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.tar", "shard-000001.tar"]
    with pytest.raises(ValueError, match="closed"):
        w.write({"__key__": "z", "x": b""})


def test_bad_arguments(tmp_path: Path) -> None:
    for pattern in ("shard.tar", "a/{:03d}.tar", "{:03d}.tgz", "{}-{}.tar", ".{}.tar", "{x}.tar"):
        with pytest.raises(ValueError, match="pattern"):
            ShardWriter(tmp_path, pattern=pattern)
    with pytest.raises(ValueError, match="max_count"):
        ShardWriter(tmp_path, max_count=0)
    with pytest.raises(ValueError, match="shuffle"):
        fastload.pack(iter([]), tmp_path, shuffle=True)
    w = ShardWriter(tmp_path / "empty")
    assert w.close() is None and w.shards == []  # nothing written, no index


# --------------------------------------------------------------------------------------
# pack_dataset
# --------------------------------------------------------------------------------------


class TupleDataset:
    """A map-style dataset of (bytes, label) tuples, like torchvision's."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        if i == self.fail_at:
            raise KeyError(f"broken item {i}")
        return bytes([i % 251]) * (50 + (i * 7919) % 900), i % 5


def test_pack_dataset_same_shards_for_any_worker_count(tmp_path: Path) -> None:
    ds = TupleDataset(300)
    runs = {}
    for workers in (0, 1, 3):
        r = fastload.pack_dataset(
            ds, tmp_path / f"w{workers}", fields=("bin", "cls"), shuffle=True, seed=5,
            max_size="20KB", workers=workers,
        )  # fmt: skip
        runs[workers] = [p.read_bytes() for p in r.shards]
        assert r.samples == 300 and r.index is not None
        assert all(p.stat().st_size <= 20_000 for p in r.shards)
        got = read_fastload(r.index)
        assert len(got) == 300
        assert got["000007"] == {"bin": ds[7][0], "cls": b"2"}
    assert runs[0] == runs[1] == runs[3] and len(runs[0]) > 3
    # Shuffled: the first shard is not the first items.
    first = list(read_fastload(ShardIndex.open(tmp_path / "w0" / "index.fidx")))[:10]
    assert first != [f"{i:06d}" for i in range(10)]
    assert not [p for p in (tmp_path / "w3").iterdir() if p.name.startswith(".")]


def test_pack_dataset_dicts_to_sample_and_errors(tmp_path: Path) -> None:
    dicts = [{"x": i, "__key__": f"id{i}"} for i in range(20)]
    r = fastload.pack_dataset(dicts, tmp_path / "d", max_count=6, workers=2)
    assert [int(p.stat().st_size > 0) for p in r.shards] == [1, 1, 1, 1]
    assert r.index is not None and read_fastload(r.index)["id3"] == {"x": b"3"}
    r2 = fastload.pack_dataset(
        TupleDataset(10), tmp_path / "t", max_count=4,
        to_sample=lambda i, it: {"__key__": f"n{i}", "v": it[1]},
    )  # fmt: skip
    assert r2.index is not None and read_fastload(r2.index)["n6"] == {"v": b"1"}
    with pytest.raises(TypeError, match="fields="):
        fastload.pack_dataset(TupleDataset(3), tmp_path / "e", workers=0)
    with pytest.raises(KeyError, match="broken item 37"):
        fastload.pack_dataset(TupleDataset(80, fail_at=37), tmp_path / "f", max_count=10,
                              fields=("bin", "cls"), workers=2)  # fmt: skip
    assert not list((tmp_path / "f").iterdir())  # no parts, no shards left


# --------------------------------------------------------------------------------------
# The pure planning functions
# --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 2**64 - 1))
def test_permutation_is_a_fixed_permutation(n: int, seed: int) -> None:
    p = permutation(n, seed)
    assert p.dtype == np.int64 and sorted(p.tolist()) == list(range(n))
    assert (permutation(n, seed) == p).all()
    if n >= 20:
        assert (permutation(n, seed ^ 1) != p).any()


def test_permutation_is_pinned() -> None:
    # The permutation is part of the on-disk contract (tasks on other nodes, later
    # reruns): these values must never change.
    assert permutation(10, 0).tolist() == PINNED_0
    assert permutation(10, 12345).tolist() == PINNED_12345


PINNED_0 = [2, 4, 6, 8, 5, 1, 7, 0, 9, 3]
PINNED_12345 = [8, 1, 5, 4, 0, 2, 9, 6, 7, 3]


def test_permutation_is_uniform() -> None:
    # Where element 0 lands over 2,000 seeds: uniform over 10 positions (chi-square, 9
    # degrees of freedom, 99.9% quantile 27.9).
    counts = np.zeros(10)
    for seed in range(2000):
        counts[int(np.flatnonzero(permutation(10, seed) == 0)[0])] += 1
    chi2 = float(((counts - 200) ** 2 / 200).sum())
    assert chi2 < 27.9, counts


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(512, 20_000), min_size=0, max_size=200),
    st.integers(1024, 60_000),
    st.one_of(st.none(), st.integers(1, 30)),
)
def test_cut_shards(sizes: list[int], max_size: int, max_count: int | None) -> None:
    cuts = cut_shards(np.array(sizes, dtype=np.int64), max_size, max_count)
    assert cuts[0] == 0 and cuts[-1] == len(sizes) and (np.diff(cuts) >= 1).all()
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        total = sum(sizes[a:b]) + 1024
        assert total <= max_size or b - a == 1
        assert max_count is None or b - a <= max_count
        if b < len(sizes) and (max_count is None or b - a < max_count):
            assert total + sizes[b] > max_size  # greedy: the next one did not fit


def test_task_shards_and_split_key() -> None:
    assert task_shards(7, 0, 3) == [0, 3, 6] and task_shards(7, 2, 3) == [2, 5]
    assert sorted(task_shards(10, 0, 4) + task_shards(10, 1, 4) + task_shards(10, 2, 4)
                  + task_shards(10, 3, 4)) == list(range(10))  # fmt: skip
    for bad in ((0, 3, 3), (0, -1, 2), (0, 0, 0)):
        with pytest.raises(ValueError):
            task_shards(*bad)
    assert split_key("a.b/c.seg.png") == ("a.b/c", "seg.png")
    assert split_key("README") is None and split_key(".x") is None and split_key("x.") is None
    assert split_key("d/.hidden") is None


def test_no_stray_files(tmp_path: Path) -> None:
    write(tmp_path, mixed_samples(5), max_count=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.fidx", "shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]  # fmt: skip
