"""stage(fanout=True): several "nodes" on this machine (processes with the variables of
a multi-node torchrun job, each its own destination, a gloo group on loopback), the
source behind netsim with no page cache shared between them (``NETSIM_DIRECT=1``, like
separate nodes) counting the bytes it serves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable

import pytest

import fastload
from kit.netsim import Mount
from kit.nodes import data_bytes, fanout_tree, kill_once_writing, outcome, results, start_nodes
from kit.procs import child_env
from kit.tars import gnu_extract, need_gnu_tar
from kit.tools import require_module
from kit.trees import assert_same_tree, build_small_files, write_patterned

require_module("torch.distributed")

MiB = 1 << 20


def build_tree(root: Path, *, small: int = 200, big: int = 12 * MiB) -> Path:
    return fanout_tree(root, small=small, big=big)


@pytest.mark.parametrize("fanout", [True, False])
def test_three_nodes_read_the_store_once(
    tmp_path: Path, netsim: Callable[..., Mount], fanout: bool
) -> None:
    src = build_tree(tmp_path / "src")
    store = netsim(src, 100, 100, direct=True)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    if fanout:
        # 4 MiB chunks: the big file is dealt in several units.
        got = results(start_nodes(store.path, dsts, args=("--stripe", str(4 * MiB))))
    else:
        env = child_env()
        code = "import sys, fastload; fastload.stage(sys.argv[1], sys.argv[2])"
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(store.path), str(d)], env=env)
            for d in dsts
        ]
        assert [p.wait(timeout=240) for p in procs] == [0, 0, 0]
        got = []
    served = store.unmount()["read_bytes"]
    total = data_bytes(src)
    for d in dsts:
        assert_same_tree(src, d)
    if fanout:
        assert served <= 1.1 * total, (served, total)
        assert [r["nodes"] for r in got] == [3, 3, 3]
        # Each node read its share and wrote everything.
        assert all(r["copied_bytes"] == total for r in got)
        assert sum(r["read_bytes"] for r in got) == total
        assert max(r["read_bytes"] for r in got) < 0.6 * total
    else:
        assert served >= 2.9 * total, (served, total)


def test_fanned_out_copy_is_a_complete_stage(tmp_path: Path) -> None:
    """A plain stage() and verify() afterwards accept each node's copy as their own; the
    same fanned-out call again copies nothing."""
    src = build_tree(tmp_path / "src", small=120, big=3 * MiB)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    results(start_nodes(src, dsts))
    for d in dsts:
        assert fastload.verify(d).ok
        assert fastload.stage(src, d).skipped
    again = results(start_nodes(src, dsts))
    assert all(r["skipped"] and r["copied_files"] == 0 for r in again)


def test_one_big_file(tmp_path: Path, netsim: Callable[..., Mount]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_patterned(src / "model.bin", 16 * MiB + 12345, seed=9)
    store = netsim(src, 100, 100, direct=True)
    dsts = [tmp_path / f"node{k}" / "model.bin" for k in range(3)]
    got = results(start_nodes(store.path / "model.bin", dsts, args=("--stripe", str(2 * MiB))))
    served = store.unmount()["read_bytes"]
    size = (src / "model.bin").stat().st_size
    assert served <= 1.1 * size
    for d in dsts:
        assert d.read_bytes() == (src / "model.bin").read_bytes()
    # Cut in chunks: every node read about a third.
    assert all(0.2 * size < r["read_bytes"] < 0.45 * size for r in got), got


def make_tars(tmp_path: Path) -> dict[str, Path]:
    """A tar (Python), a .tar.gz (GNU tar) and a tar of tars (GNU tar)."""
    tree = build_tree(tmp_path / "tree", small=100, big=2 * MiB)
    out = tmp_path / "archives"
    out.mkdir()
    with tarfile.open(out / "plain.tar", "w", format=tarfile.PAX_FORMAT) as t:
        t.add(tree, arcname="tree")
    gnu = need_gnu_tar()
    subprocess.run([gnu, "-czf", str(out / "gnu.tar.gz"), "-C", str(tree), "."], check=True)
    inner = tmp_path / "inner"
    inner.mkdir()
    for k, part in enumerate(["small", "big"]):
        subprocess.run(
            [gnu, "-cf", str(inner / f"class{k}.tar"), "-C", str(tree / part), "."], check=True
        )
    subprocess.run([gnu, "-cf", str(out / "tot.tar"), "-C", str(inner), "."], check=True)
    return {"plain": out / "plain.tar", "gz": out / "gnu.tar.gz", "nested": out / "tot.tar"}


def test_archives(tmp_path: Path, netsim: Callable[..., Mount]) -> None:
    tars = make_tars(tmp_path)
    store = netsim(tars["plain"].parent, 100, 100, direct=True)
    total = 0
    for kind, archive in tars.items():
        dsts = [tmp_path / kind / f"node{k}" for k in range(2)]
        args = ("--nested",) if kind == "nested" else ()
        got = results(start_nodes(store.path / archive.name, dsts, args=args))
        total += archive.stat().st_size
        assert sum(r["read_bytes"] for r in got) == archive.stat().st_size
        ref = tmp_path / kind / "gnu"
        if kind == "nested":
            # A plain stage's extraction of the tar of tars (GNU tar has no such mode).
            fastload.stage(archive, ref, unpack="nested")
        else:
            gnu_extract(archive, ref)
        for d in dsts:
            assert_same_tree(ref, d)
    served = store.unmount()["read_bytes"]
    assert served <= 1.1 * total, (served, total)


def test_node_killed_then_rerun_reads_only_what_is_missing(
    tmp_path: Path, netsim: Callable[..., Mount]
) -> None:
    src = tmp_path / "src"
    build_small_files(src / "small", 600, per_dir=100)
    (src / "big").mkdir()
    for k in range(6):
        write_patterned(src / "big" / f"part{k}.bin", 6 * MiB, seed=k)
    total = data_bytes(src)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    env = {"FASTLOAD_FANOUT_TIMEOUT": "30", "FASTLOAD_FANOUT_ROUND": str(256 << 10)}
    store = netsim(src, 300, 300, direct=True)
    procs = start_nodes(store.path, dsts, env=env)
    kill_once_writing(procs[1])  # node 1 dies (kill -9) once it has written something
    t0 = time.monotonic()
    failed = [outcome(p, timeout=120) for p in procs[:1]]
    waited = time.monotonic() - t0
    for f in failed:
        assert "error" in f, f
        assert "node 1" in f["error"]["message"], f
        assert f["error"]["type"] == "FanoutError"
    assert waited < 60
    first = store.unmount()["read_bytes"]
    assert first < total  # it did stop half-way
    # What some node already holds whole is not read from the store again.
    held: set[str] = set()
    for d in dsts:
        for p in d.rglob("*"):
            if p.is_file() and not p.name.endswith(".fl-tmp"):
                held.add(str(p.relative_to(d)))
    missing = total - sum((src / p).stat().st_size for p in held)
    store = netsim(src, 300, 300, direct=True)
    results(start_nodes(store.path, dsts))
    second = store.unmount()["read_bytes"]
    for d in dsts:
        assert_same_tree(src, d)
    assert second <= missing + MiB, (second, missing, total)


def test_failure_on_one_node_is_named_on_the_others(
    tmp_path: Path, small_fs: Callable[..., Path]
) -> None:
    """Node 1's disk is too small: it fails with its own error, the other with one that
    names node 1 and says why."""
    src = build_tree(tmp_path / "src", small=50, big=4 * MiB)
    small = small_fs("1m")
    dsts = [tmp_path / "node0" / "d", small / "d"]
    docs = [outcome(p) for p in start_nodes(src, dsts)]
    assert docs[1]["error"]["type"] == "NotEnoughSpaceError", docs[1]
    for d in docs[:1]:
        assert d["error"]["type"] == "FanoutError", d
        assert "node 1" in d["error"]["message"] and "space" in d["error"]["message"], d


def test_two_processes_per_node(tmp_path: Path, netsim: Callable[..., Mount]) -> None:
    """The second process of each node waits on its node's lock and finds the copy."""
    src = build_tree(tmp_path / "src", small=200, big=8 * MiB)
    store = netsim(src, 100, 100, direct=True)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    got = results(start_nodes(store.path, dsts, per_node=2))
    served = store.unmount()["read_bytes"]
    assert served <= 1.1 * data_bytes(src)
    for d in dsts:
        assert_same_tree(src, d)
    assert [r["nodes"] for r in got[::2]] == [2, 2]


def test_without_init_the_group_comes_from_torchrun_variables(tmp_path: Path) -> None:
    src = build_tree(tmp_path / "src", small=60, big=2 * MiB)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    got = results(start_nodes(src, dsts, init=False))
    assert [r["nodes"] for r in got] == [2, 2]
    for d in dsts:
        assert_same_tree(src, d)


def test_one_process_is_a_plain_stage(tmp_path: Path) -> None:
    src = build_tree(tmp_path / "src", small=50, big=2 * MiB)
    r = fastload.stage(src, tmp_path / "a", fanout=True)
    assert r.nodes == 1 and r.read_bytes is None and not r.skipped
    assert_same_tree(src, tmp_path / "a")
    assert fastload.stage(src, tmp_path / "a").skipped  # the manifest a plain stage writes
    plain = fastload.stage(src, tmp_path / "b")
    assert (r.files, r.bytes) == (plain.files, plain.bytes)


def test_a_node_that_hangs_is_named_within_the_timeout(tmp_path: Path) -> None:
    src = build_tree(tmp_path / "src", small=400, big=24 * MiB)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    env = {"FASTLOAD_FANOUT_TIMEOUT": "5", "FASTLOAD_FANOUT_ROUND": str(64 << 10)}
    procs = start_nodes(src, dsts, env=env)
    assert procs[1].stdout is not None
    for line in procs[1].stdout:
        if json.loads(line).get("progress", 0) > 0:
            break
    procs[1].send_signal(signal.SIGSTOP)  # alive, silent
    try:
        t0 = time.monotonic()
        failed = [outcome(p, timeout=120) for p in procs[:1]]
        waited = time.monotonic() - t0
    finally:
        procs[1].send_signal(signal.SIGKILL)
        procs[1].communicate()
    for f in failed:
        assert f["error"]["type"] == "FanoutError", f
        assert "node 1" in f["error"]["message"], f
    assert waited < 60


def test_a_node_with_a_complete_copy_serves_the_others(
    tmp_path: Path, netsim: Callable[..., Mount]
) -> None:
    """Node 0 already holds the data: the others get it from node 0's disk, and the store
    serves nothing."""
    src = build_tree(tmp_path / "src", small=200, big=8 * MiB)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    fastload.stage(src, dsts[0])
    store = netsim(src, 100, 100, direct=True)
    got = results(start_nodes(store.path, dsts))
    served = store.unmount()["read_bytes"]
    for d in dsts:
        assert_same_tree(src, d)
    assert served == 0
    assert got[0]["copied_files"] == 0 and got[1]["copied_bytes"] == data_bytes(src)


def test_include_exclude(tmp_path: Path) -> None:
    src = build_tree(tmp_path / "src", small=100, big=2 * MiB)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(2)]
    args = ("--include", "small/dir000/*", "--exclude", "*5.dat")
    results(start_nodes(src, dsts, args=args))
    want = fastload.stage(src, tmp_path / "plain", include="small/dir000/*", exclude="*5.dat")
    for d in dsts:
        assert_same_tree(tmp_path / "plain", d)
    assert want.files == sum(1 for p in dsts[0].rglob("*") if p.is_file())
