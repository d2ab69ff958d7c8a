"""The data generators: deterministic, cached, and producing what they claim (tiny sizes)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import threading
from pathlib import Path

import pytest

import data
from _guard import missing


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTLOAD_BENCH_DATA", str(tmp_path / "cache"))


def _digest_tree(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            p = Path(dirpath, name)
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_tree_is_deterministic_and_cached(tmp_path: Path) -> None:
    a = data.imagenet_like_tree(tmp_path / "a", 40, 4, mean_kb=4, seed=3)
    b = data.imagenet_like_tree(tmp_path / "b", 40, 4, mean_kb=4, seed=3)
    assert _digest_tree(a) == _digest_tree(b)
    assert data.tree_stats(a)[0] == 40
    assert len([p for p in a.iterdir() if p.is_dir()]) == 4
    first = next(a.rglob("*.JPEG")).read_bytes()
    assert first.startswith(b"\xff\xd8\xff") and first.endswith(b"\xff\xd9")
    mtime = a.stat().st_mtime_ns
    assert data.imagenet_like_tree(a, 40, 4, mean_kb=4, seed=3) == a
    assert a.stat().st_mtime_ns == mtime  # cached, not rebuilt
    c = data.imagenet_like_tree(tmp_path / "a", 40, 4, mean_kb=4, seed=4)  # new params
    assert _digest_tree(c) != _digest_tree(b)


def test_keyed_paths_differ_by_params() -> None:
    assert data.keyed("tree", n=1, s=0) != data.keyed("tree", n=1, s=1)
    assert data.keyed("tree", n=1).parent.parent == data.cache_dir()


def test_the_default_cache_is_in_the_build_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTLOAD_BENCH_DATA")
    assert data.cache_dir() == Path(data.__file__).resolve().parents[1] / "build" / "bench-data"


def test_a_changed_generator_makes_new_data(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 51: data were keyed by their parameters only, so a generator that changed
    what it writes reused the older one's files. The key and the record now name the
    generators' content: here, a copy of data.py with one more line."""
    key = data.keyed("tree", n=10, c=2, kb=1, s=0)
    a = data.imagenet_like_tree(key, 10, 2, 1, seed=0)
    mtime = a.stat().st_mtime_ns
    assert key.parent.name == f"gen-{data.generator_digest()}"
    changed = tmp_path / "data.py"
    changed.write_text(Path(data.__file__).read_text() + "\n# changed\n")
    monkeypatch.setattr(data, "_GENERATORS", (changed, *data._GENERATORS[1:]))
    assert data.keyed("tree", n=10, c=2, kb=1, s=0) != key
    # At a path the caller chose, the older generator's output is rebuilt, not reused.
    data.imagenet_like_tree(a, 10, 2, 1, seed=0)
    assert a.stat().st_mtime_ns != mtime


def test_a_run_that_finds_another_building_waits_and_takes_its_data(tmp_path: Path) -> None:
    """Two runs at once: the second one finds the first one's lock and waits, then uses
    what the first one made, removing nothing (it used to remove a data set it found
    without its record: one that the other run had just renamed into place)."""
    path = data.keyed("large", n=1, size=4096, s=0)
    got: list[Path] = []
    with data._locked(path):
        t = threading.Thread(target=lambda: got.append(data.large_files(path, 1, 4096, 0)))
        t.start()
        # The other run, holding the lock, makes the data set and then its record.
        made = data.large_files(tmp_path / "made", 1, 4096, 0)
        shutil.copytree(made, path)
        shutil.copy(made.parent / ".made.params.json", path.parent / f".{path.name}.params.json")
        inode = (path / "large-000.bin").stat().st_ino
    t.join()
    assert got == [path]
    assert (path / "large-000.bin").stat().st_ino == inode  # taken, not rebuilt


def test_large_files(tmp_path: Path) -> None:
    root = data.large_files(tmp_path / "l", 2, (1 << 20) + 5, seed=1)
    files = sorted(root.iterdir())
    assert [f.stat().st_size for f in files] == [(1 << 20) + 5] * 2
    assert files[0].read_bytes() != files[1].read_bytes()


def test_sizes_are_lognormal_around_mean() -> None:
    sizes = data.lognormal_sizes(20_000, 100 * 1024, seed=0)
    assert 90 * 1024 < sizes.mean() < 110 * 1024
    assert sizes.min() >= 1024


@pytest.mark.parametrize("fmt", ["ustar", "gnu", "pax"])
@pytest.mark.parametrize("tool", ["python", "gnu"])
def test_imagenet_tar(tmp_path: Path, fmt: str, tool: str) -> None:
    if tool == "gnu" and not data._gnu_tar_available():
        missing("GNU tar is not installed")
    p = data.imagenet_like_tar(tmp_path / f"{tool}-{fmt}.tar", 30, 3, 2, seed=5, fmt=fmt, tool=tool)
    with tarfile.open(p) as tf:
        members = [m for m in tf.getmembers() if m.isfile()]
    assert len(members) == 30
    tree = data.imagenet_like_tree(tmp_path / "t", 30, 3, 2, seed=5)
    assert sum(m.size for m in members) == data.tree_stats(tree)[1]


def test_tar_of_tars(tmp_path: Path) -> None:
    p = data.tar_of_tars(tmp_path / "tt.tar", 3, 5, 2, seed=0)
    with tarfile.open(p) as outer:
        inner_names = outer.getnames()
        assert inner_names == [f"n{c:05d}.tar" for c in range(3)]
        f = outer.extractfile(inner_names[1])
        assert f is not None
        with tarfile.open(fileobj=f) as inner:
            assert len(inner.getnames()) == 5


def test_small_record_shards(tmp_path: Path) -> None:
    root = data.small_record_shards(tmp_path / "s", 25, 1, 10, seed=0)
    shards = sorted(root.iterdir())
    assert [s.name for s in shards] == [f"shard-{i:06d}.tar" for i in range(3)]
    with tarfile.open(shards[2]) as tf:
        names = tf.getnames()
    assert names[:3] == ["sample00000020.jpg", "sample00000020.cls", "sample00000020.json"]
    assert len(names) == 15


def test_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> bytes:
        raise RuntimeError("disk full")

    monkeypatch.setattr(data, "_jpeg_like", boom)
    with pytest.raises(RuntimeError):
        data.imagenet_like_tree(tmp_path / "x", 5, 1, 1, seed=0)
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x")]
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_shard_records(tmp_path: Path) -> None:
    root = data.small_record_shards(tmp_path / "s", 25, 1, 10, seed=0)
    records = list(data.shard_records(sorted(root.glob("shard-*.tar"))))
    assert [r["__key__"] for r in records] == [f"sample{i:08d}" for i in range(25)]
    assert set(records[3]) == {"__key__", "jpg", "cls", "json"}
    assert json.loads(records[3]["json"]) == {
        "key": "sample00000003",
        "label": int(records[3]["cls"]),
    }


@pytest.mark.parametrize("fmt", ["mds", "litdata", "arrow"])
def test_peer_formats_hold_the_same_samples(tmp_path: Path, fmt: str) -> None:
    """Each peer's copy, read back with the peer, is the tar shards' samples in order."""
    import _peers

    root = data.small_record_shards(tmp_path / "s", 25, 1, 10, seed=0)
    want = list(data.shard_records(sorted(root.glob("shard-*.tar"))))
    if fmt == "mds":
        _peers.import_streaming()
        path = data.mds_records(tmp_path / "mds", root, size_limit=20_000)
        with _peers.quiet():
            ds = _peers.import_streaming().LocalDataset(local=str(path))
    elif fmt == "litdata":
        path = data.litdata_records(tmp_path / "ld", root, chunk_size=10)
        with _peers.quiet():
            ds = _peers.import_litdata().StreamingDataset(input_dir=str(path))
    else:
        path = data.arrow_records(tmp_path / "arrow", root)
        ds = _peers.import_datasets().load_from_disk(str(path))
    assert len(ds) == len(want)
    assert [dict(ds[i]) for i in range(len(want))] == want


def test_large_deletion_makes_the_next_round_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    import _harness

    monkeypatch.setattr(_harness, "_settle_until", 0.0)
    small, large = tmp_path / "small", tmp_path / "large"
    for root, n in ((small, 10), (large, _harness.LARGE_DELETION)):
        root.mkdir()
        for i in range(n):
            (root / f"f{i}").touch()
    _harness.remove_tree(small)
    assert not small.exists() and _harness._settle_until == 0.0
    no_journal = _harness._ext4_without_journal(tmp_path)
    t0 = time.monotonic()
    _harness.remove_tree(large)
    assert not large.exists()
    if no_journal:  # (this VM's root; elsewhere a deletion makes no round wait)
        assert _harness._settle_until >= t0 + _harness.RECENTLY_DELETED_S
    else:
        assert _harness._settle_until == 0.0
