"""fastload.pack of a path and ``fastload pack``: a tree, a tar and a tar of tars round
trip through the shard index and webdataset; same seed, same bytes; the shuffle is a
full one (class mix of the first shard); limits; tasks joined by ``fastload index``
equal one task; refusals (compressed, not a tar, stale shards). A full disk, a source
changed under a pack and Ctrl-C: tests/test_full_disk.py, with real processes.
"""

from __future__ import annotations

import gzip
import io
import os
import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastload
from fastload import ShardIndex, TarFormatError
from fastload.cli import main as cli
from fastload.packing import folder as _pack
from kit import tars
from kit.shards import Fields, read_fastload, read_gnu_tar, read_webdataset

pytestmark = pytest.mark.native

CLASSES = [f"n{c:04d}" for c in range(6)]
PER_CLASS = 30


def _tree(root: Path) -> dict[str, Fields]:
    """An ImageFolder tree (6 classes x 30 files of 0-5,000 bytes; one sample with a
    second field), plus files that are not samples. Returns what a pack must hold."""
    rng = random.Random(7)
    want: dict[str, Fields] = {}
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for i in range(PER_CLASS):
            data = rng.randbytes(rng.choice([0, 10, 511, 512, 513, rng.randrange(5000)]))
            (root / name / f"{name}_{i:04d}.JPEG").write_bytes(data)
            want[f"{name}/{name}_{i:04d}"] = {"JPEG": data, "cls": str(c).encode()}
    (root / "n0002" / "n0002_0003.seg.png").write_bytes(b"mask")
    want["n0002/n0002_0003"]["seg.png"] = b"mask"
    (root / "n0001" / "README").write_text("no field")
    (root / "n0001" / ".DS_Store").write_bytes(b"hidden")
    return want


def _tar(tree: Path, path: Path) -> Path:
    """The tree as one tar, members in key order (as `tar --sort=name` writes)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for p in sorted(tree.rglob("*")):
            tf.add(p, arcname=str(p.relative_to(tree)), recursive=False)
    return path


def _tar_of_tars(tree: Path, path: Path) -> Path:
    """ImageNet's layout: one member tar per class, holding that class's files."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as outer:
        for d in sorted(tree.iterdir()):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as inner:
                for p in sorted(d.iterdir()):
                    inner.add(p, arcname=p.name)
            ti = tarfile.TarInfo(d.name + ".tar")
            ti.size = len(buf.getvalue())
            outer.addfile(ti, io.BytesIO(buf.getvalue()))
    return path


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("src")
    want = _tree(root / "tree")
    return {
        "want": want,
        "tree": root / "tree",
        "tar": _tar(root / "tree", root / "train.tar"),
        "tar_of_tars": _tar_of_tars(root / "tree", root / "train_tot.tar"),
    }


def _shard_bytes(r: fastload.PackResult) -> list[bytes]:
    return [p.read_bytes() for p in r.shards]


# --------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tree", "tar", "tar_of_tars"])
def test_round_trip(src: dict[str, Any], tmp_path: Path, kind: str) -> None:
    r = fastload.pack(src[kind], tmp_path / "out", shuffle=True, seed=1, max_size="40KB")
    assert r.total_samples == r.samples == 6 * PER_CLASS and r.total_shards == len(r.shards) > 3
    assert r.classes == tuple(CLASSES)
    assert r.skipped == 2 and "n0001/README" in r.skipped_examples[0] + r.skipped_examples[-1]
    assert r.index == tmp_path / "out" / "index.fidx"
    assert read_fastload(r.index) == src["want"]
    assert read_webdataset(r.shards) == src["want"]
    assert (tmp_path / "out" / "classes.txt").read_text().split() == CLASSES
    assert (tmp_path / "out" / "classes.json").read_text().count('"n0005": 5') == 1
    assert all(p.stat().st_size <= 40_000 for p in r.shards)


def test_sources_in_key_order_give_the_same_shards(src: dict[str, Any], tmp_path: Path) -> None:
    runs = {
        kind: _shard_bytes(fastload.pack(src[kind], tmp_path / kind, shuffle=True, seed=9,
                                         max_count=17))
        for kind in ("tree", "tar", "tar_of_tars")
    }
    assert runs["tree"] == runs["tar"] == runs["tar_of_tars"]


def test_gnu_tar_extracts_the_shards(src: dict[str, Any], tmp_path: Path) -> None:
    tars.need_gnu_tar()
    r = fastload.pack(src["tree"], tmp_path / "out", shuffle=True, max_size="100KB")
    assert read_gnu_tar(r.shards, tmp_path / "x") == src["want"]


def test_unshuffled_order(src: dict[str, Any], tmp_path: Path) -> None:
    r = fastload.pack(src["tar_of_tars"], tmp_path / "o", max_count=50, classes=False)
    assert r.index is not None and r.classes is None
    keys = ShardIndex.open(r.index).keys()
    assert keys == sorted(src["want"])  # archive order, here key order
    assert "cls" not in ShardIndex.open(r.index).fields


def test_long_names_symlinks_and_big_files(tmp_path: Path) -> None:
    root = tmp_path / "src"
    deep = root / ("d" * 80) / ("e" * 80)
    deep.mkdir(parents=True)
    big = os.urandom(5 << 20)  # larger than the writer's buffer
    (deep / "x.bin").write_bytes(big)
    (root / "small.txt").write_bytes(b"hi")
    (root / "link.txt").symlink_to("small.txt")
    want = {f"{'d' * 80}/{'e' * 80}/x": {"bin": big}, "small": {"txt": b"hi"},
            "link": {"txt": b"hi"}}  # fmt: skip
    r = fastload.pack(root, tmp_path / "o1", max_size="2MB")
    assert r.index is not None and read_fastload(r.index) == want
    assert read_webdataset(r.shards) == want
    # The same from a tar: a member past the 16 MiB read batch, copied in pieces.
    huge = os.urandom(17 << 20)
    with tarfile.open(tmp_path / "big.tar", "w") as tf:
        for name, data in [("a.bin", b"1"), ("b.bin", huge), ("c" * 120 + ".bin", b"3")]:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    r2 = fastload.pack(tmp_path / "big.tar", tmp_path / "o2", shuffle=True, seed=3)
    assert r2.index is not None
    assert read_fastload(r2.index) == {"a": {"bin": b"1"}, "b": {"bin": huge},
                                       "c" * 120: {"bin": b"3"}}  # fmt: skip


def test_output_inside_the_source_is_left_out(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"s{i}.txt").write_text(str(i))
    r1 = fastload.pack(tmp_path, tmp_path / "packed")
    r2 = fastload.pack(tmp_path, tmp_path / "packed")  # again: its own shards not packed
    assert r1.samples == r2.samples == 5
    assert _shard_bytes(r1) == _shard_bytes(r2)


# --------------------------------------------------------------------------------------
# Determinism and the shuffle
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tree", "tar"])
def test_same_seed_same_bytes(src: dict[str, Any], tmp_path: Path, kind: str) -> None:
    a = fastload.pack(src[kind], tmp_path / "a", shuffle=True, seed=4, max_size="30KB")
    b = fastload.pack(src[kind], tmp_path / "b", shuffle=True, seed=4, max_size="30KB",
                      workers=1)  # fmt: skip
    fastload.pack(src[kind], tmp_path / "c", shuffle=True, seed=5, max_size="30KB")
    assert _shard_bytes(a) == _shard_bytes(b)
    ka = ShardIndex.open(tmp_path / "a" / "index.fidx").keys()
    kc = ShardIndex.open(tmp_path / "c" / "index.fidx").keys()
    assert sorted(ka) == sorted(kc) and ka != kc


def _first_shard_chi2(index: Path, classes: int) -> float:
    idx = ShardIndex.open(index)
    first = idx.shards[0]
    counts = np.zeros(classes)
    for i in range(first.first_sample, first.first_sample + first.samples):
        counts[int(idx[i].key[1:3])] += 1
    expect = first.samples / classes
    return float(((counts - expect) ** 2 / expect).sum())


def test_first_shard_has_every_class(tmp_path: Path) -> None:
    """A full permutation: the class counts of the first shard follow the whole set's
    (uniform here) within a chi-square bound (9 degrees of freedom, 99.9%: 27.9); a
    class-ordered source left unshuffled fails it by far."""
    root = tmp_path / "src"
    for c in range(10):
        (root / f"c{c:02d}").mkdir(parents=True)
        for i in range(100):
            (root / f"c{c:02d}" / f"{i:03d}.txt").write_bytes(b"")
    for seed in range(3):
        r = fastload.pack(root, tmp_path / f"s{seed}", shuffle=True, seed=seed, max_count=100)
        assert r.index is not None
        assert _first_shard_chi2(r.index, 10) < 27.9
    r = fastload.pack(root, tmp_path / "plain", max_count=100)
    assert r.index is not None and _first_shard_chi2(r.index, 10) > 500


# --------------------------------------------------------------------------------------
# Limits and windows
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tree", "tar"])
def test_limits(src: dict[str, Any], tmp_path: Path, kind: str) -> None:
    r = fastload.pack(src[kind], tmp_path / "s", shuffle=True, max_size=12_000)
    sizes = [p.stat().st_size for p in r.shards]
    assert max(sizes) <= 12_000 and sum(sizes) == r.bytes
    r = fastload.pack(src[kind], tmp_path / "c", shuffle=True, max_count=13)
    assert r.index is not None
    counts = [s.samples for s in ShardIndex.open(r.index).shards]
    assert counts == [13] * 13 + [180 - 13 * 13]


def test_scatter_in_several_windows(src: dict[str, Any], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """More shards than may be open at once: the archive is read once per window."""
    want = _shard_bytes(fastload.pack(src["tar"], tmp_path / "a", shuffle=True, max_count=10))
    monkeypatch.setattr(_pack, "_open_files_for", lambda n: 4)
    r = fastload.pack(src["tar"], tmp_path / "b", shuffle=True, max_count=10, workers=3)
    assert _shard_bytes(r) == want and len(want) == 18


# --------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------


def test_two_tasks_joined_equal_one(src: dict[str, Any], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    one = tmp_path / "one"
    two = tmp_path / "two"
    assert cli(["pack", str(src["tar_of_tars"]), str(one), "--shuffle", "--seed", "2",
                "--max-size", "25KB", "--no-progress"]) == 0  # fmt: skip
    for t in ("1", "0"):
        assert cli(["pack", str(src["tar_of_tars"]), str(two), "--shuffle", "--seed", "2",
                    "--max-size", "25KB", "--num-tasks", "2", "--task-index", t]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "task 1 of 2" in out and "fastload index" in out
    assert not (two / "index.fidx").exists()
    assert cli(["index", str(two)]) == 0
    names = sorted(p.name for p in one.glob("*.tar"))
    assert names == sorted(p.name for p in two.glob("*.tar")) and len(names) > 4
    for n in names:
        assert (one / n).read_bytes() == (two / n).read_bytes()
    a, b = ShardIndex.open(one / "index.fidx"), ShardIndex.open(two / "index.fidx")
    assert a.keys() == b.keys()
    assert read_fastload(a) == read_fastload(b) == src["want"]
    # A task with no shard of its own writes nothing, and says so.
    r = fastload.pack(src["tree"], tmp_path / "many", max_count=100, num_tasks=5, task_index=4)
    assert r.shards == () and r.total_shards == 2 and r.index is None


# --------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------


def test_refusals(src: dict[str, Any], tmp_path: Path) -> None:
    # A compressed tar is not refused: packed as the tar it holds (issue 25).
    gz = tmp_path / "a.tar.gz"
    gz.write_bytes(gzip.compress(src["tar"].read_bytes()))
    from_gz = fastload.pack(gz, tmp_path / "gz", max_count=7)
    from_tar = fastload.pack(src["tar"], tmp_path / "tar", max_count=7)
    assert [p.read_bytes() for p in from_gz.shards] == [p.read_bytes() for p in from_tar.shards]
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="neither a directory nor a tar"):
        fastload.pack(tmp_path / "notes.txt", tmp_path / "o")
    with pytest.raises(FileNotFoundError):
        fastload.pack(tmp_path / "missing", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no samples"):
        fastload.pack(tmp_path / "empty", tmp_path / "o")
    cut = tmp_path / "cut.tar"
    cut.write_bytes(src["tar"].read_bytes()[:20_000])
    with pytest.raises(TarFormatError, match=r"cut\.tar"):
        fastload.pack(cut, tmp_path / "o")
    with pytest.raises(ValueError, match="task_index"):
        fastload.pack(src["tree"], tmp_path / "o", num_tasks=2, task_index=2)
    # Shards of another pack in the folder: `fastload index OUT` would join them in.
    fastload.pack(src["tree"], tmp_path / "s", max_count=10)
    with pytest.raises(FileExistsError, match=r"9 shard.*shard-000009\.tar"):
        fastload.pack(src["tree"], tmp_path / "s", max_count=20)
    assert cli(["pack", str(tmp_path / "notes.txt"), str(tmp_path / "o")]) == 1
    with pytest.raises(ValueError, match="cannot add classes"):
        fastload.pack(tmp_path / "s", tmp_path / "o", classes=True)
