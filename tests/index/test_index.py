"""The shard index: shards from every writer and tar format, long keys, lookups, and
every refusal (malformed, compressed and missing shards, duplicate keys, members without
a key, corrupt, truncated, foreign and stale indexes), plus the CLI.

The samples and shard writers are kit.shards' (the data and packing tests use them too).
"""

from __future__ import annotations

import io
import os
import pickle
import random
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import pytest

import fastload
from fastload import IndexFormatError, ShardIndex, TarFormatError
from fastload.cli import main as cli
from kit.shards import (
    HAVE_TORCH,
    Sample,
    check_samples,
    make_samples,
    reader,
    write_gnutar,
    write_tarfile,
    write_wds,
    write_wds_shards,
)
from kit.tools import missing, require_module

pytestmark = pytest.mark.native


WRITERS: dict[str, Callable[[Path, Sequence[Sample]], Path]] = {
    "tarfile-ustar": lambda p, s: write_tarfile(p, s, "ustar"),
    "tarfile-gnu": lambda p, s: write_tarfile(p, s, "gnu"),
    "tarfile-pax": lambda p, s: write_tarfile(p, s, "pax"),
    "gnutar-ustar": lambda p, s: write_gnutar(p, s, "ustar"),
    "gnutar-gnu": lambda p, s: write_gnutar(p, s, "gnu"),
    "gnutar-posix": lambda p, s: write_gnutar(p, s, "posix"),
    "webdataset": write_wds,
}


# --------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_writer_and_format_reads_back(tmp_path: Path, writer: str) -> None:
    long_keys = "ustar" if writer.endswith("ustar") else "pax"
    a = make_samples(12, seed=1, long_keys=long_keys, prefix="a/")
    b = make_samples(7, seed=2, long_keys="none", prefix="b/")
    shards = [WRITERS[writer](tmp_path / "a.tar", a), WRITERS[writer](tmp_path / "b.tar", b)]
    idx = ShardIndex.build(shards, tmp_path / "i.fidx")
    samples = a + b
    assert len(idx) == len(samples)
    assert set(idx.fields) == {"jpg", "cls", "seg.png"}
    for i, (key, fields) in enumerate(samples):
        info = idx[i]
        assert info.key == key and idx.position(key) == i and key in idx
        assert sorted(info.fields) == sorted(fields)
        raw = Path(info.shard).read_bytes()
        for m in info.members:
            assert raw[m.offset : m.offset + m.size] == fields[m.field]
    for access in ("mmap", "read"):
        for copy in (False, True):
            ds = reader(idx, copy=copy, access=access)
            check_samples(ds, samples)


def test_shard_writer_and_sources(tmp_path: Path) -> None:
    samples = make_samples(25, seed=3)
    paths = write_wds_shards(tmp_path / "d", samples, per_shard=10)
    assert len(paths) == 3
    by_list = ShardIndex.build(paths, tmp_path / "list.fidx")
    by_dir = ShardIndex.build(tmp_path / "d", tmp_path / "dir.fidx")
    by_glob = ShardIndex.build(str(tmp_path / "d" / "shard-*.tar"), tmp_path / "glob.fidx")
    braces = str(tmp_path / "d" / "shard-{000000..000002}.tar")
    by_brace = ShardIndex.build(braces, tmp_path / "b.fidx")
    for idx in (by_list, by_dir, by_glob, by_brace):
        assert [s.path for s in idx.shards] == [str(p) for p in paths]
        assert [s.samples for s in idx.shards] == [10, 10, 5]
        assert idx.keys() == [k for k, _ in samples]
    check_samples(reader(by_glob), samples)


def test_brace_expansion() -> None:
    from fastload.index import expand_braces

    assert expand_braces("s-{008..011}.tar") == ["s-008.tar", "s-009.tar", "s-010.tar", "s-011.tar"]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]
    assert expand_braces("plain.tar") == ["plain.tar"]


def test_lookup_and_pickle(tmp_path: Path) -> None:
    samples = make_samples(30, seed=4)
    idx = ShardIndex.build([write_tarfile(tmp_path / "s.tar", samples)], tmp_path / "s.fidx")
    for i, (key, _) in enumerate(samples):
        assert idx.lookup(key).position == i
    with pytest.raises(KeyError):
        idx.lookup("dir.with.dots/s9")
    assert "nope" not in idx
    assert idx[-1].key == samples[-1][0]
    with pytest.raises(IndexError):
        idx[len(samples)]
    again = pickle.loads(pickle.dumps(idx))
    assert again.keys() == idx.keys() and again.path == idx.path
    info = idx.info()
    assert info["samples"] == 30 and info["version"] == 1 and info["on_duplicate"] == "error"


@pytest.mark.parametrize("access", ["mmap", "read"])
def test_payloads(tmp_path: Path, access: str) -> None:
    """A Payload is a read-only zero-copy buffer that keeps its memory alive, has a
    length, converts and pickles to bytes, and cannot be made from Python."""
    import gc

    samples = make_samples(12, seed=9)
    idx = ShardIndex.build([write_tarfile(tmp_path / "p.tar", samples)], tmp_path / "p.fidx")
    got = idx._native.fetch([3, 7], None, False, access)
    key, fields = samples[3]
    payload = got[0]["jpg"]
    assert type(payload) is fastload._core.Payload and got[0]["__key__"] == key
    assert len(payload) == len(fields["jpg"])
    assert bytes(payload) == payload.tobytes() == fields["jpg"]
    assert pickle.loads(pickle.dumps(payload)) == fields["jpg"]
    assert repr(payload) == f"<fastload.Payload of {len(fields['jpg'])} bytes>"
    view = memoryview(payload)
    assert view.readonly and view.format == "B" and view.tobytes() == fields["jpg"]
    with pytest.raises((BufferError, TypeError)):
        memoryview(payload).cast("B")[0] = 1  # read-only
    with pytest.raises(TypeError):
        type(payload)()
    del payload, got, idx
    gc.collect()
    assert view.tobytes() == fields["jpg"]  # the view keeps the mapping (or buffer) alive


def test_index_moves_with_its_shards(tmp_path: Path) -> None:
    samples = make_samples(5, seed=5)
    (tmp_path / "a" / "shards").mkdir(parents=True)
    write_tarfile(tmp_path / "a" / "shards" / "s.tar", samples)
    ShardIndex.build(tmp_path / "a" / "shards", tmp_path / "a" / "i.fidx")
    (tmp_path / "a").rename(tmp_path / "b")
    idx = ShardIndex.open(tmp_path / "b" / "i.fidx")
    assert idx.shards[0].stored_path == "shards/s.tar"
    check_samples(reader(idx), samples)


def test_ignored_members_and_empty_shards(tmp_path: Path) -> None:
    p = tmp_path / "m.tar"
    with tarfile.open(p, "w", format=tarfile.GNU_FORMAT) as tf:
        for name, data, kind in [
            ("./", b"", tarfile.DIRTYPE),
            ("./__meta__", b"{}", tarfile.REGTYPE),
            ("./x/", b"", tarfile.DIRTYPE),
            ("./x/a.txt", b"A", tarfile.REGTYPE),
            ("./x/a.lnk", b"", tarfile.SYMTYPE),
            ("./x/b.txt", b"", tarfile.REGTYPE),
        ]:
            ti = tarfile.TarInfo(name)
            ti.type = kind
            ti.size = len(data)
            if kind == tarfile.SYMTYPE:
                ti.linkname = "a.txt"
            tf.addfile(ti, io.BytesIO(data) if data else None)
    with tarfile.open(tmp_path / "empty.tar", "w"):
        pass
    idx = ShardIndex.build([p, tmp_path / "empty.tar"], tmp_path / "m.fidx")
    assert idx.keys() == ["x/a", "x/b"]
    assert [s.samples for s in idx.shards] == [2, 0]
    ds = reader(idx)
    assert bytes(ds[0]["txt"]) == b"A" and bytes(ds[1]["txt"]) == b""


# --------------------------------------------------------------------------------------
# Refusals while building
# --------------------------------------------------------------------------------------


def test_duplicate_keys(tmp_path: Path) -> None:
    a = write_tarfile(tmp_path / "a.tar", make_samples(4, seed=6, long_keys="none"))
    b = write_tarfile(tmp_path / "b.tar", make_samples(6, seed=7, long_keys="none"))
    with pytest.raises(TarFormatError) as e:
        ShardIndex.build([a, b], tmp_path / "d.fidx")
    assert "duplicate sample key 'dir.with.dots/s00000'" in str(e.value)
    assert "a.tar" in str(e.value) and "b.tar" in str(e.value)
    assert not (tmp_path / "d.fidx").exists()
    idx = ShardIndex.build([a, b], tmp_path / "d.fidx", on_duplicate="first")
    assert len(idx) == 6
    assert idx.lookup("dir.with.dots/s00001").shard == str(a)
    assert idx.lookup("dir.with.dots/s00005").shard == str(b)
    assert idx.info()["on_duplicate"] == "first"
    with pytest.raises(ValueError, match="on_duplicate"):
        ShardIndex.build([a], tmp_path / "x.fidx", on_duplicate="last")


def test_member_without_key(tmp_path: Path) -> None:
    p = tmp_path / "k.tar"
    with tarfile.open(p, "w") as tf:
        for name in ("s0.jpg", "data/README"):
            ti = tarfile.TarInfo(name)
            ti.size = 1
            tf.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(TarFormatError, match=r"member 'data/README' has no sample key"):
        ShardIndex.build([p], tmp_path / "k.fidx")


@pytest.mark.parametrize("mode,kind", [("w:gz", "gzip"), ("w:bz2", "bzip2"), ("w:xz", "xz")])
def test_compressed_shard(tmp_path: Path, mode: str, kind: str) -> None:
    p = tmp_path / "c.tar.x"
    with tarfile.open(p, mode) as tf:
        ti = tarfile.TarInfo("a.txt")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(TarFormatError) as e:
        ShardIndex.build([p], tmp_path / "c.fidx")
    assert kind in str(e.value) and "fastload stage" in str(e.value) and str(p) in str(e.value)


def test_malformed_and_missing_shards(tmp_path: Path) -> None:
    good = write_tarfile(tmp_path / "g.tar", make_samples(3, seed=8))
    raw = good.read_bytes()
    (tmp_path / "noise.tar").write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(TarFormatError, match=r"noise\.tar"):
        ShardIndex.build([tmp_path / "noise.tar"], tmp_path / "n.fidx")
    (tmp_path / "cut.tar").write_bytes(raw[: 512 + 100])  # inside the first member's data
    with pytest.raises(TarFormatError, match=r"cut\.tar"):
        ShardIndex.build([good, tmp_path / "cut.tar"], tmp_path / "c.fidx")
    bad = bytearray(raw)
    bad[148:156] = b"0000000\0"  # header checksum
    (tmp_path / "sum.tar").write_bytes(bytes(bad))
    with pytest.raises(TarFormatError, match=r"sum\.tar"):
        ShardIndex.build([tmp_path / "sum.tar"], tmp_path / "s.fidx")
    with pytest.raises(FileNotFoundError):
        ShardIndex.build([good, tmp_path / "absent.tar"], tmp_path / "a.fidx")
    with pytest.raises(FileNotFoundError):
        ShardIndex.build(str(tmp_path / "nothing-*.tar"), tmp_path / "a.fidx")
    assert not any(p.name.endswith(".fidx") for p in tmp_path.iterdir())


# --------------------------------------------------------------------------------------
# Refusals while opening
# --------------------------------------------------------------------------------------


@pytest.fixture
def built(tmp_path: Path) -> tuple[Path, Path, bytes]:
    shard = write_tarfile(tmp_path / "s.tar", make_samples(20, seed=9))
    idx = tmp_path / "s.fidx"
    ShardIndex.build([shard], idx)
    return idx, shard, idx.read_bytes()


def test_corrupt_index(built: tuple[Path, Path, bytes], tmp_path: Path) -> None:
    _, _, good = built
    bad = tmp_path / "bad.fidx"
    rng = random.Random(1)
    spots = [0, 9, 20, 60, 140, 150, len(good) // 2, len(good) - 1]
    spots += [rng.randrange(len(good)) for _ in range(20)]
    for at in spots:
        b = bytearray(good)
        b[at] ^= 0x21
        bad.write_bytes(bytes(b))
        with pytest.raises(IndexFormatError):
            ShardIndex.open(bad)
    for n in (0, 5, 100, 143, 144, len(good) // 2, len(good) - 1):
        bad.write_bytes(good[:n])
        with pytest.raises(IndexFormatError) as e:
            ShardIndex.open(bad)
        assert str(bad) in str(e.value)
        if n >= 144:
            assert "truncated" in str(e.value)
    bad.write_bytes(b"#!/bin/sh\necho this is not an index\n")
    with pytest.raises(IndexFormatError, match="not a fastload index"):
        ShardIndex.open(bad)
    # A corrupt index cannot be rebuilt: its shard list is unreadable.
    bad.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(IndexFormatError, match="checksum"):
        ShardIndex.open(bad, rebuild=True)
    with pytest.raises(FileNotFoundError):
        ShardIndex.open(tmp_path / "absent.fidx")


def test_foreign_version(built: tuple[Path, Path, bytes], tmp_path: Path) -> None:
    _, _, good = built
    b = bytearray(good)
    b[8:12] = (7).to_bytes(4, "little")
    # Re-seal the header checksum so the version check, not the checksum, speaks.
    seed = 0x666C2D6964782D31
    b[136:144] = fastload._core.fl64(bytes(b[:136]), seed).to_bytes(8, "little")
    p = tmp_path / "v7.fidx"
    p.write_bytes(bytes(b))
    with pytest.raises(IndexFormatError, match="version 7"):
        ShardIndex.open(p)


def test_stale_index(built: tuple[Path, Path, bytes]) -> None:
    idx_path, shard, _ = built
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with pytest.raises(IndexFormatError) as e:
        ShardIndex.open(idx_path)
    assert str(shard) in str(e.value) and "modified" in str(e.value) and " UTC" in str(e.value)
    assert str(idx_path) in str(e.value)
    ShardIndex.open(idx_path, check=False)  # still readable, on request
    idx = ShardIndex.open(idx_path, rebuild=True)
    assert len(idx) == 20
    ShardIndex.open(idx_path)  # fresh again

    samples = make_samples(60, seed=10)
    write_tarfile(shard, samples)
    with pytest.raises(IndexFormatError, match="size"):
        ShardIndex.open(idx_path)
    check_samples(reader(ShardIndex.open(idx_path, rebuild=True)), samples)

    shard.unlink()
    with pytest.raises(IndexFormatError, match="cannot be found"):
        ShardIndex.open(idx_path)
    with pytest.raises(FileNotFoundError):
        ShardIndex.open(idx_path, rebuild=True)


def test_shard_changed_after_open(built: tuple[Path, Path, bytes]) -> None:
    idx_path, shard, _ = built
    ds = reader(idx_path)
    with open(shard, "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(IndexFormatError, match="changed since it was indexed"):
        ds[0]


# --------------------------------------------------------------------------------------
# 64-bit offsets: a member past 4 GiB (a sparse file: the hole costs no disk)
# --------------------------------------------------------------------------------------


def write_sparse_tar(path: Path, hole: int, tail: bytes) -> None:
    big = tarfile.TarInfo("a.hole")
    big.size = hole
    small = tarfile.TarInfo("a.tail")
    small.size = len(tail)
    with open(path, "wb") as f:
        f.write(big.tobuf(tarfile.GNU_FORMAT))
        f.seek(512 + (hole + 511) // 512 * 512)
        f.write(small.tobuf(tarfile.GNU_FORMAT))
        f.write(tail + b"\0" * ((512 - len(tail) % 512) % 512) + b"\0" * 1024)


def test_member_past_4gib(tmp_path: Path) -> None:
    p = tmp_path / "big.tar"
    try:
        write_sparse_tar(p, (5 << 30) + 7, b"after the hole")
    except OSError as e:
        missing(f"no sparse 5 GiB file here: {e}")
    if p.stat().st_blocks * 512 > 64 << 20:
        p.unlink()
        missing("this file system does not keep holes")
    idx = ShardIndex.build([p], tmp_path / "big.fidx")
    (info,) = list(idx)
    hole, tail = info.members
    assert hole.size == (5 << 30) + 7 and tail.offset > 1 << 32
    for access in ("mmap", "read"):
        ds = reader(idx, fields=["tail"], access=access)
        assert bytes(ds[0]["tail"]) == b"after the hole"


# --------------------------------------------------------------------------------------
# Payloads, import hygiene, CLI
# --------------------------------------------------------------------------------------


def test_payload_buffer(tmp_path: Path) -> None:
    np = require_module("numpy")
    samples = make_samples(3, seed=11)
    idx = ShardIndex.build([write_tarfile(tmp_path / "s.tar", samples)], tmp_path / "s.fidx")
    ds = reader(idx, fields=["jpg"])
    v = ds[1]["jpg"]
    arr = np.frombuffer(v, np.uint8)
    mv = memoryview(v)
    assert mv.readonly and not arr.flags.writeable and len(v) == len(samples[1][1]["jpg"])
    with pytest.raises(TypeError):
        mv[0] = 1
    assert pickle.loads(pickle.dumps(v)) == samples[1][1]["jpg"]
    del ds, idx, v  # the array keeps the mapping alive
    import gc

    gc.collect()
    assert arr.tobytes() == samples[1][1]["jpg"] and mv.tobytes() == arr.tobytes()


def test_import_does_not_import_torch() -> None:
    code = (
        "import sys, fastload; assert 'torch' not in sys.modules; "
        "fastload.ShardIndex; assert 'torch' not in sys.modules; "
    )
    if HAVE_TORCH:
        code += "fastload.ShardIndexDataset; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths = write_wds_shards(tmp_path / "d", make_samples(15, seed=12), per_shard=5)
    out = tmp_path / "cli.fidx"
    rest = str(tmp_path / "d" / "shard-00000[12].tar")
    assert cli(["index", str(paths[0]), rest, "-o", str(out)]) == 0
    assert "15 samples in 3 shards" in capsys.readouterr().out
    assert cli(["index", "--info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "samples  15" in text and "jpg" in text and "unchanged" in text
    os.utime(paths[1], ns=(0, 0))
    assert cli(["index", "--info", str(out)]) == 1
    assert "stale" in capsys.readouterr().out
    assert cli(["index", "-o", str(out)]) == 2
    (tmp_path / "z.tar").write_bytes(b"\x1f\x8b\x08" + b"\0" * 100)
    assert cli(["index", str(tmp_path / "z.tar"), "-o", str(out)]) == 1
    assert "gzip" in capsys.readouterr().err
