"""Fan-out staging of an archive object: three "nodes" (kit/nodes.py) extract
s3://bucket/data.tar, each reading a third of it in ranged GETs, and the store serves
the archive about once (counted by the proxy in front of the real S3 server)."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import pytest
from s3server import upload_file

import fastload
from kit.nodes import results, start_nodes
from kit.tools import require_module
from kit.trees import assert_same_tree, build_small_files, write_patterned

require_module("torch.distributed")


def _upload_tree(s3: Any, bucket: str, tree: Path, prefix: str) -> int:
    """Each file of ``tree`` put under ``prefix/`` in ``bucket``; returns their bytes."""
    files = [p for p in sorted(tree.rglob("*")) if p.is_file()]
    for p in files:
        upload_file(s3, bucket, f"{prefix}/{p.relative_to(tree)}", p)
    return sum(p.stat().st_size for p in files)


@pytest.mark.parametrize("gz", [False, True])
def test_archive_object_three_nodes(
    s3: Any, bucket: str, proxy: Any, tmp_path: Path, gz: bool
) -> None:
    tree = tmp_path / "tree"
    build_small_files(tree / "small", 300, per_dir=100)
    (tree / "big").mkdir()
    write_patterned(tree / "big" / "w.bin", 40 << 20, seed=4)
    name = "data.tar.gz" if gz else "data.tar"
    archive = tmp_path / name
    with tarfile.open(archive, "w:gz" if gz else "w") as t:
        t.add(tree, arcname=".")
    upload_file(s3, bucket, name, archive)
    ref = tmp_path / "ref"
    fastload.stage(archive, ref)
    proxy.reset_counts()
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    got = results(start_nodes(f"s3://{bucket}/{name}", dsts))
    size = archive.stat().st_size
    assert proxy.bytes_out <= 1.1 * size + (1 << 20), (proxy.bytes_out, size)
    assert sum(r["read_bytes"] for r in got) == size
    assert all(r["nodes"] == 3 for r in got)
    for d in dsts:
        assert_same_tree(ref, d)
    # The manifest is the one a plain stage writes: the same call again is a no-op.
    proxy.reset_counts()
    assert fastload.stage(f"s3://{bucket}/{name}", dsts[0]).skipped
    assert proxy.gets() == 0


def test_prefix_three_nodes(s3: Any, bucket: str, proxy: Any, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    build_small_files(tree / "small", 200, per_dir=50)
    (tree / "big").mkdir()
    write_patterned(tree / "big" / "w.bin", 24 << 20, seed=4)
    total = _upload_tree(s3, bucket, tree, "ds")
    proxy.reset_counts()
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    got = results(start_nodes(f"s3://{bucket}/ds/", dsts))
    assert proxy.requests["LIST"] == 1  # node 0 lists the prefix (one page), the others not
    assert proxy.bytes_out <= 1.1 * total + (1 << 20), (proxy.bytes_out, total)
    assert sum(r["read_bytes"] for r in got) == total
    for d in dsts:
        assert_same_tree(tree, d, mtimes=False)
    proxy.reset_counts()
    assert fastload.stage(f"s3://{bucket}/ds/", dsts[1]).skipped
    assert proxy.gets() == 0


def test_zip_object_three_nodes(s3: Any, bucket: str, proxy: Any, tmp_path: Path) -> None:
    """A zip object: node 0 reads its central directory, each node its share of the
    members by ranged GETs; the store serves the zip about once; every node's tree is
    unzip's."""
    from kit import zips

    tree = zips.build_tree(tmp_path / "tree")
    build_small_files(tree / "small", 300, per_dir=100)
    write_patterned(tree / "w.bin", 3 << 20, seed=4)
    archive = zips.infozip(tree, tmp_path / "data.zip")
    upload_file(s3, bucket, "data.zip", archive)
    ref = zips.unzip_ref(archive, tmp_path / "ref")
    proxy.reset_counts()
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    got = results(start_nodes(f"s3://{bucket}/data.zip", dsts))
    size = archive.stat().st_size
    assert proxy.bytes_out <= 1.1 * size + (1 << 20), (proxy.bytes_out, size)
    assert sum(r["read_bytes"] for r in got) <= size
    assert all(r["nodes"] == 3 and r["read_bytes"] > 0 for r in got), got
    for d in dsts:
        zips.assert_same_extraction(archive, ref, d)
    proxy.reset_counts()
    assert fastload.stage(f"s3://{bucket}/data.zip", dsts[2]).skipped


def test_a_prefix_of_zips_nested_three_nodes(s3: Any, bucket: str, proxy: Any,
                                             tmp_path: Path) -> None:  # fmt: skip
    """unpack="nested" over a prefix holding zips, fanned out over three nodes: node 0
    lists the prefix once (its zips taken out of that listing, not listed again), the
    store serves the objects about once, and every node holds the files and each zip
    extracted into the folder of its name."""
    from kit import zips

    tree = tmp_path / "tree"
    build_small_files(tree / "small", 120, per_dir=40)
    inner = tmp_path / "inner"
    build_small_files(inner, 150, per_dir=50)
    (tree / "scans").mkdir()
    zips.infozip(inner, (tree / "scans" / "a.zip").resolve())
    zips.py_zip(inner, tree / "scans" / "b.zip")
    total = _upload_tree(s3, bucket, tree, "nz")
    proxy.reset_counts()
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    got = results(start_nodes(f"s3://{bucket}/nz/", dsts, args=("--nested",)))
    assert proxy.requests["LIST"] == 1, proxy.requests
    assert proxy.bytes_out <= 1.1 * total + (1 << 20), (proxy.bytes_out, total)
    assert all(r["nodes"] == 3 and r["files"] == 120 + 2 * 150 for r in got), got
    for d in dsts:
        assert not list(d.rglob("*.zip"))
        assert_same_tree(tree / "small", d / "small", mtimes=False)
        for name in ("a", "b"):
            assert_same_tree(inner, d / "scans" / name, mtimes=False)
