"""An index built from shards scanned one at a time (what remote shard sets do: each
shard is scanned while it is pinned in the cache, then may be evicted) is the index the
builder makes of the same files; and an opened index lets go of one shard's mapping
(``forget_shard``) and maps it again by its path when it is read next."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fastload import ShardIndex, TarFormatError, _core
from kit.shards import make_samples, write_tarfile

pytestmark = pytest.mark.native


def shards(root: Path, n: int = 3) -> list[Path]:
    return [write_tarfile(root / f"s{i}.tar", make_samples(12, seed=i, prefix=f"p{i}/"))
            for i in range(n)]


def test_scanned_build_is_the_built_index(tmp_path: Path) -> None:
    paths = shards(tmp_path)
    names = [p.name for p in paths]
    built = tmp_path / "built.fidx"
    _core.build_index([os.fspath(p) for p in paths], names, os.fspath(built))
    scans = [_core.scan_shard(os.fspath(p)) for p in paths]
    image = _core.build_index_scanned(scans, [os.fspath(p) for p in paths], names)
    assert len(image) == built.stat().st_size
    out = tmp_path / "scanned.fidx"
    fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        image.write(fd, os.fspath(out))
    finally:
        os.close(fd)
    assert out.read_bytes() == built.read_bytes()
    ix = ShardIndex.open(out)
    assert len(ix) == 36 and ix.keys()[0].startswith("p0/")


def test_scanned_build_errors_name_the_shard(tmp_path: Path) -> None:
    paths = shards(tmp_path, 2)
    scans = [_core.scan_shard(os.fspath(p)) for p in paths]
    with pytest.raises(ValueError, match="differ in length"):
        _core.build_index_scanned(scans, ["a"], ["a", "b"])
    # The same shard twice: its keys twice, named by the names given.
    with pytest.raises(TarFormatError, match=r"duplicate sample key .*'s3://b/one\.tar'"):
        _core.build_index_scanned([scans[0], scans[0]], ["s3://b/one.tar", "s3://b/two.tar"],
                                  ["one.tar", "two.tar"])
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar" * 200)
    with pytest.raises(TarFormatError, match=r"bad\.tar"):
        _core.scan_shard(os.fspath(bad))


def test_forget_shard_maps_it_again_on_the_next_read(tmp_path: Path) -> None:
    paths = shards(tmp_path, 2)
    index = ShardIndex.build([os.fspath(p) for p in paths], tmp_path / "i.fidx")
    first = bytes(index._native.fetch([0])[0]["jpg"])
    assert any(str(paths[0]) in line for line in Path("/proc/self/maps").read_text().splitlines())
    index._native.forget_shard(0)
    assert not any(str(paths[0]) in line
                   for line in Path("/proc/self/maps").read_text().splitlines())
    # Replaced by another file of the same size at its path: the next read maps that one.
    data = paths[0].read_bytes()
    paths[0].unlink()
    paths[0].write_bytes(data)
    assert bytes(index._native.fetch([0])[0]["jpg"]) == first
    with pytest.raises(IndexError):
        index._native.forget_shard(2)
