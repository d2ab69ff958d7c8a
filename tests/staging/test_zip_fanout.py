"""stage(x.zip, fanout=True) (issue 53): several "nodes" on this machine (processes with
the variables of a multi-node torchrun job, each its own destination, a gloo group on
loopback), the zip behind netsim with no page cache shared between them
(``NETSIM_DIRECT=1``, like separate nodes) counting the bytes it serves: node 0 reads
the central directory, each node extracts its share of the members and the files are
exchanged, so the store serves the zip about once and every node's tree is unzip's."""

from __future__ import annotations

import shutil
import struct
import zipfile
from pathlib import Path
from typing import Callable

import pytest

import fastload
from kit import tars, trees, zips
from kit.netsim import Mount
from kit.nodes import kill_once_writing, outcome, results, start_nodes
from kit.tools import require_module

require_module("torch.distributed")

MiB = 1 << 20


def build_zip(tmp_path: Path, *args: str) -> Path:
    """Info-ZIP's zip of a tree of every kind of member, 400 small files and a member
    of 2 MiB (in several chunks of 1 MiB)."""
    src = zips.build_tree(tmp_path / "tree")
    trees.build_small_files(src / "small", 400, per_dir=100)
    trees.write_patterned(src / "big.bin", 2 * MiB + 123, seed=3)
    out = tmp_path / "store"
    out.mkdir()
    return zips.infozip(src, out / "data.zip", *args)


@pytest.mark.parametrize("method", ["deflated", "stored"])
def test_three_nodes_read_the_zip_once(tmp_path: Path, netsim: Callable[..., Mount],
                                       method: str) -> None:  # fmt: skip
    archive = build_zip(tmp_path, *(("-0",) if method == "stored" else ()))
    ref = zips.unzip_ref(archive, tmp_path / "ref")
    store = netsim(archive.parent, 100, 100, direct=True)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    args = ("--stripe", str(MiB))
    got = results(start_nodes(store.path / archive.name, dsts, args=args))
    # Fanned out again: every node's copy is complete, nothing is read or copied.
    again = results(start_nodes(store.path / archive.name, dsts, args=args))
    assert all(r["skipped"] and r["copied_files"] == 0 for r in again), again
    served = store.unmount()["read_bytes"]
    size = archive.stat().st_size
    for d in dsts:
        zips.assert_same_extraction(archive, ref, d)
        assert fastload.verify(d).ok
    # The central directory once (node 0), each member's data once (one node).
    assert served <= 1.15 * size, (served, size)
    assert [r["nodes"] for r in got] == [3, 3, 3]
    total = sum(p.stat().st_size for p in ref.rglob("*") if p.is_file() and not p.is_symlink())
    assert all(r["copied_bytes"] == total and r["bytes"] == total for r in got), got
    # Each node read its share of the members' data: together about the zip.
    assert sum(r["read_bytes"] for r in got) <= size
    assert max(r["read_bytes"] for r in got) < 0.6 * size, got


def test_a_new_node_takes_the_members_from_the_others(
    tmp_path: Path, netsim: Callable[..., Mount]
) -> None:
    """Two nodes hold the zip's tree, a third has nothing: its files come from the
    others' disks, the store serves only the central directory."""
    archive = build_zip(tmp_path)
    ref = zips.unzip_ref(archive, tmp_path / "ref")
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    for d in dsts[:2]:
        fastload.stage(archive, d)
    # One of node 1's files lost: node 0 sends it.
    lost = next(p for p in sorted((dsts[1] / "small").rglob("*")) if p.is_file())
    lost.unlink()
    store = netsim(archive.parent, 100, 100, direct=True)
    got = results(start_nodes(store.path / archive.name, dsts))
    served = store.unmount()["read_bytes"]
    assert served < 0.1 * archive.stat().st_size, served
    for d in dsts:
        zips.assert_same_extraction(archive, ref, d)
        assert fastload.verify(d).ok
    assert got[2]["copied_files"] == len(trees.regular_files(ref))
    assert all(r["read_bytes"] == 0 for r in got), got


def test_a_damaged_member_stops_every_node(tmp_path: Path) -> None:
    """A member whose CRC-32 differs fails the node that extracts it, naming the
    archive and the member; the others stop with its message; nothing of it is at
    its final name anywhere, and a rerun on a sound zip completes."""
    archive = build_zip(tmp_path)
    data = bytearray(archive.read_bytes())
    with zipfile.ZipFile(archive) as zf:
        at = zf.getinfo("big.bin").header_offset
    n_name, n_extra = struct.unpack_from("<HH", data, at + 26)
    data[at + 30 + n_name + n_extra + 2 * MiB] ^= 0xFF  # a byte in its last chunk
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(data))
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    docs = [outcome(p) for p in start_nodes(bad, dsts)]
    assert all("error" in d for d in docs), docs
    assert any("big.bin" in d["error"]["message"] and "bad.zip" in d["error"]["message"]
               for d in docs), docs  # fmt: skip
    for d in dsts:
        assert not (d / "big.bin").exists()
    shutil.copyfile(archive, bad)
    results(start_nodes(bad, dsts))
    ref = zips.unzip_ref(archive, tmp_path / "ref")
    for d in dsts:
        zips.assert_same_extraction(archive, ref, d)


@pytest.mark.parametrize("outer", ["zip", "tree"])
def test_nested_zips_fanned_out(tmp_path: Path, netsim: Callable[..., Mount],
                                outer: str) -> None:  # fmt: skip
    """unpack="nested" with fanout: a zip of zips, and a tree of zips (ScanNet's layout),
    fanned out: the outer source, then each inner zip in turn, so the store serves
    everything about once; each node's tree is the unzipped one (they failed:
    AttributeError); a rerun copies nothing and reads only the central directories."""
    top = tmp_path / "src"
    for k in range(3):
        files = tmp_path / f"files{k}"
        trees.build_small_files(files, 60, per_dir=20, seed=k)
        (top / f"scene{k}").mkdir(parents=True)
        zips.infozip(files, (top / f"scene{k}" / "label.zip").resolve())
        (top / f"scene{k}" / "axis.txt").write_bytes(b"axis %d\n" % k)
    (tmp_path / "store").mkdir()
    if outer == "zip":
        src = zips.infozip(top, tmp_path / "store" / "scans.zip", "-0")  # inner zips stored
        total = src.stat().st_size
    else:
        src = shutil.copytree(top, tmp_path / "store" / "scans")
        total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    store = netsim(tmp_path / "store", 100, 100, direct=True)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    got = results(start_nodes(store.path / src.name, dsts, args=("--nested",)))
    served = store.unmount()["read_bytes"]
    # Once, but for the ends of the zips read to find their central directories (up
    # to 64 KiB each), on node 0.
    tails = 4 * (66 << 10)
    assert served <= 1.1 * total + tails, (served, total)
    store = netsim(tmp_path / "store", 100, 100, direct=True)
    again = results(start_nodes(store.path / src.name, dsts, args=("--nested",)))
    # (a new mount: another source path) the central directories and local headers only
    assert store.unmount()["read_bytes"] <= tails + (64 << 10)
    assert all(r["files"] == 3 * 61 for r in got + again), (got, again)
    assert all(r["copied_files"] == 0 for r in again), again
    for d in dsts:
        assert not list(d.rglob("*.zip"))
        for k in range(3):
            assert (d / f"scene{k}" / "axis.txt").read_bytes() == b"axis %d\n" % k
            trees.assert_same_tree(tmp_path / f"files{k}", d / f"scene{k}" / "label",
                                   mtimes=False)  # fmt: skip


def test_zips_in_a_fanned_out_tar(tmp_path: Path, netsim: Callable[..., Mount]) -> None:
    """unpack="nested" on a tar holding zips, fanned out: the tar is read about once in
    total, and each node extracts the zips from its own copy into their folders (they
    stayed files); a rerun is skipped on every node."""
    files = tmp_path / "files"
    trees.build_small_files(files, 200, per_dir=50)
    outer = tmp_path / "outer"
    (outer / "scans").mkdir(parents=True)
    zips.infozip(files, (outer / "scans" / "a.zip").resolve())
    zips.py_zip(files, outer / "scans" / "b.zip")
    (outer / "scans" / "a.txt").write_bytes(b"axis\n")
    archive = tars.gnu_create(outer, tmp_path / "store" / "scans.tar", "posix")
    store = netsim(archive.parent, 100, 100, direct=True)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    got = results(start_nodes(store.path / archive.name, dsts, args=("--nested",)))
    again = results(start_nodes(store.path / archive.name, dsts, args=("--nested",)))
    served = store.unmount()["read_bytes"]
    assert served <= 1.1 * archive.stat().st_size, served
    assert [r["nodes"] for r in got] == [2, 2]
    assert all(r["files"] == 401 for r in got + again), (got, again)
    assert all(r["skipped"] for r in again), again
    for d in dsts:
        assert (d / "scans" / "a.txt").read_bytes() == b"axis\n"
        assert not list(d.rglob("*.zip"))
        for name in ("a", "b"):
            trees.assert_same_tree(files, d / "scans" / name, mtimes=False)


def test_node_killed_then_rerun_reads_only_what_is_missing(
    tmp_path: Path, netsim: Callable[..., Mount]
) -> None:
    """Node 1 is killed (-9) while extracting its share: node 0 stops naming it; the
    rerun reads from the store only the members neither node holds whole."""
    src = tmp_path / "tree"
    trees.build_small_files(src / "small", 600, per_dir=100)
    for k in range(6):
        trees.write_patterned(src / f"part{k}.bin", 2 * MiB, seed=k)
    (tmp_path / "store").mkdir()
    archive = zips.infozip(src, tmp_path / "store" / "data.zip")
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    env = {"FASTLOAD_FANOUT_TIMEOUT": "30"}
    store = netsim(archive.parent, 300, 50_000, direct=True)  # slow: killed on the way
    # One member run at a time (workers=1): node 1 reports its first run whole while
    # the next still waits on the store, so the kill lands half-way through its share
    # (with 32 in flight its whole share could land between two reports; CI saw it).
    procs = start_nodes(store.path / archive.name, dsts, env=env,
                        args=("--pid", "--workers", "1"))  # fmt: skip
    kill_once_writing(procs[1])  # node 1 dies (kill -9) once it has written something
    failed = outcome(procs[0], timeout=120)
    assert "error" in failed and "node 1" in failed["error"]["message"], failed
    assert failed["error"]["type"] == "FanoutError"
    store.unmount()
    held = {str(p.relative_to(d)) for d in dsts if d.is_dir() for p in d.rglob("*")
            if p.is_file() and not p.name.endswith(".fl-tmp")}  # fmt: skip
    with zipfile.ZipFile(archive) as zf:
        missing = sum(i.compress_size + 30 + len(i.filename) + len(i.extra)
                      for i in zf.infolist() if not i.is_dir() and i.filename not in held)
    assert missing > 0  # node 1 did stop half-way
    store = netsim(archive.parent, 300, 300, direct=True)
    results(start_nodes(store.path / archive.name, dsts))
    second = store.unmount()["read_bytes"]
    ref = zips.unzip_ref(archive, tmp_path / "ref")
    for d in dsts:
        zips.assert_same_extraction(archive, ref, d)
    assert second <= missing + MiB, (second, missing, archive.stat().st_size)


def test_a_hostile_inner_zip_stops_every_node(tmp_path: Path) -> None:
    """A tree of zips fanned out with unpack="nested", one zip climbing out: every node
    fails naming the zip and the member; nothing lands outside."""
    src = tmp_path / "src"
    (src / "s1").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"a\n")
    with zipfile.ZipFile(src / "s1" / "bad.zip", "w") as zf:
        zf.writestr("ok.txt", b"fine")
        zf.writestr("../evil.txt", b"evil")
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    docs = [outcome(p) for p in start_nodes(src, dsts, args=("--nested",))]
    for d in docs:
        assert "error" in d, docs
        assert "bad.zip', member '../evil.txt'" in d["error"]["message"], d
    assert not list(tmp_path.rglob("evil*"))
