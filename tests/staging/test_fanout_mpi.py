"""stage(fanout=True) over MPI: the ranks of one ``mpiexec -n 3`` (the mpich wheel's
hydra, on loopback), each with the variables of its own node and its own destination,
no torchrun or SLURM job variables (so the group is MPI's); the source behind netsim
(``NETSIM_DIRECT=1``: no page cache shared between the "nodes") counting the bytes it
serves. Without mpi4py the package and fan-out over gloo work as before
(test_fanout.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable

import pytest

from fastload.staging.fanout import over_mpi as run_mpi
from fastload.staging.fanout import run
from kit.netsim import Mount
from kit.nodes import data_bytes, fanout_tree, mpi_line, mpi_outcomes, mpiexec, start_mpi_nodes
from kit.procs import child_env
from kit.tools import missing, require_module
from kit.trees import assert_same_tree, build_small_files, write_patterned

require_module("mpi4py")
if mpiexec() is None:
    missing("no mpiexec beside this Python (pip install mpich)", module=True)

MiB = 1 << 20


def build_tree(root: Path, *, small: int = 200, big: int = 12 * MiB) -> Path:
    return fanout_tree(root, small=small, big=big)




def staged(src: Path | str, dsts: list[Path], *args: str) -> list[dict[str, object]]:
    docs = mpi_outcomes(start_mpi_nodes(src, dsts, args=args), timeout=180)
    assert sorted(docs) == [0, 1, 2], docs
    for d in docs.values():
        assert "result" in d, d
    return [docs[k]["result"] for k in range(3)]  # type: ignore[misc]


# A tree, and a tar (one file dealt in chunks, extracted on every node). A single big
# file is one file dealt in chunks too: tests/staging/test_fanout.py stages one over
# torch.distributed, and what MPI carries is the same chunks.
@pytest.mark.parametrize("kind", ["tree", "tar"])
def test_three_ranks_read_the_store_once(
    tmp_path: Path, netsim: Callable[..., Mount], kind: str
) -> None:
    src = tmp_path / "src"
    if kind == "tree":
        build_tree(src)
        name = ""
    elif kind == "file":
        src.mkdir()
        write_patterned(src / "model.bin", 20 * MiB + 4321, seed=3)
        name = "model.bin"
    else:
        tree = build_tree(tmp_path / "tree", small=150, big=6 * MiB)
        src.mkdir()
        with tarfile.open(src / "data.tar", "w", format=tarfile.PAX_FORMAT) as t:
            t.add(tree, arcname="tree")
        name = "data.tar"
    store = netsim(src, 100, 100, direct=True)
    dsts = [tmp_path / f"node{k}" / ("model.bin" if kind == "file" else "data") for k in range(3)]
    got = staged(store.path / name, dsts, "--stripe", str(4 * MiB))
    served = store.unmount()["read_bytes"]
    total = data_bytes(src / name)
    assert served <= 1.1 * total, (served, total)
    assert [r["nodes"] for r in got] == [3, 3, 3]
    assert sum(r["read_bytes"] for r in got) == total  # type: ignore[misc]
    for d in dsts:
        if kind == "tree":
            assert_same_tree(src, d)
        elif kind == "file":
            assert d.read_bytes() == (src / name).read_bytes()
        else:
            # (tarfile keeps mtimes to the microsecond)
            assert_same_tree(tmp_path / "tree", d / "tree", mtimes=False)


def _stop_mid_way(proc: object, rank: int, sig: int) -> int:
    """Reads the ranks' lines until ``rank`` has written something, sends it ``sig``;
    its pid."""
    pid = 0
    stdout = proc.stdout  # type: ignore[attr-defined]
    for line in stdout:
        got = mpi_line(line)
        if got is None or got[0] != rank:
            continue
        if "pid" in got[1]:
            pid = int(got[1]["pid"])
        elif got[1].get("progress", 0) > 0:
            os.kill(pid, sig)
            return pid
    raise AssertionError(f"rank {rank} ended before it wrote anything")


def _tree_for_failures(src: Path) -> int:
    build_small_files(src / "small", 300, per_dir=100)
    (src / "big").mkdir()
    for k in range(4):
        write_patterned(src / "big" / f"part{k}.bin", 6 * MiB, seed=k)
    return data_bytes(src)


def _rerun_reads_what_is_missing(
    netsim: Callable[..., Mount], src: Path, dsts: list[Path], total: int
) -> None:
    held = 0
    for d in dsts[:1]:  # node 0 keeps what it finished: those files are not read again
        held = sum(
            (src / p.relative_to(d)).stat().st_size
            for p in d.rglob("*")
            if p.is_file() and not p.name.endswith(".fl-tmp")
        )
    store = netsim(src, 300, 300, direct=True)
    got = staged(store.path, dsts)
    second = store.unmount()["read_bytes"]
    for d in dsts:
        assert_same_tree(src, d)
    assert sum(r["read_bytes"] for r in got) == second  # type: ignore[misc]
    assert second <= total - held + 8 * MiB, (second, held, total)


def test_a_rank_that_hangs_is_named_then_a_rerun_completes(
    tmp_path: Path, netsim: Callable[..., Mount]
) -> None:
    """Rank 1 stops (SIGSTOP) mid-way: ranks 0 and 2 fail within the timeout naming node
    1; MPI_Finalize would wait for rank 1 forever, so they end themselves a few seconds
    later and mpiexec ends the job; a rerun completes."""
    src = tmp_path / "src"
    total = _tree_for_failures(src)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    env = {"FASTLOAD_FANOUT_TIMEOUT": "4", "FASTLOAD_FANOUT_ROUND": str(256 << 10)}
    store = netsim(src, 300, 300, direct=True)
    proc = start_mpi_nodes(store.path, dsts, env=env)
    pid = _stop_mid_way(proc, 1, signal.SIGSTOP)  # alive, silent
    t0 = time.monotonic()
    try:
        docs = mpi_outcomes(proc, timeout=60)  # returns once mpiexec ended the job
        ended = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()
    assert sorted(docs) == [0, 2], docs
    for f in docs.values():
        err = f["error"]
        assert err["type"] == "FanoutError", f
        assert "node 1" in err["message"], f
    assert ended < 4 + run_mpi.FINALIZE_GRACE + 15, ended
    assert store.unmount()["read_bytes"] < total
    _rerun_reads_what_is_missing(netsim, src, dsts, total)


def test_a_killed_rank_ends_the_job_then_a_rerun_completes(
    tmp_path: Path, netsim: Callable[..., Mount]
) -> None:
    """Rank 2 is killed (SIGKILL) mid-way: MPI's launcher ends the job at once (MPICH's
    hydra does; the ranks cannot name the node: MPI kills them first), and what each node
    finished stays: a rerun completes."""
    src = tmp_path / "src"
    total = _tree_for_failures(src)
    dsts = [tmp_path / f"node{k}" / "data" for k in range(3)]
    env = {"FASTLOAD_FANOUT_TIMEOUT": "30", "FASTLOAD_FANOUT_ROUND": str(256 << 10)}
    store = netsim(src, 300, 300, direct=True)
    proc = start_mpi_nodes(store.path, dsts, env=env)
    _stop_mid_way(proc, 2, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        docs = mpi_outcomes(proc, timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    assert time.monotonic() - t0 < 30
    assert proc.returncode != 0
    assert not any("result" in d for d in docs.values()), docs
    assert store.unmount()["read_bytes"] < total
    _rerun_reads_what_is_missing(netsim, src, dsts, total)


def test_a_failure_on_one_rank_is_named_on_the_others(
    tmp_path: Path, small_fs: Callable[..., Path]
) -> None:
    """Node 1's disk is too small: it fails with its own error, the others with one that
    names node 1 and says why, before the launcher ends the job."""
    src = build_tree(tmp_path / "src", small=50, big=4 * MiB)
    small = small_fs("1m")
    dsts = [tmp_path / "node0" / "d", small / "d", tmp_path / "node2" / "d"]
    docs = mpi_outcomes(start_mpi_nodes(src, dsts), timeout=120)
    assert docs[1]["error"]["type"] == "NotEnoughSpaceError", docs
    for k in (0, 2):
        err = docs[k]["error"]
        assert err["type"] == "FanoutError", docs
        assert "node 1" in err["message"] and "space" in err["message"], docs


def test_transport_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MPI launcher's variables and mpi4py pick MPI; an initialised torch group, or
    fanout="torch", still wins; a word that is no transport is refused."""
    for v in run.MPI_SIZE_VARIABLES:
        monkeypatch.delenv(v, raising=False)
    assert not run.mpi_launched()
    monkeypatch.setenv("PMI_SIZE", "1")
    assert not run.mpi_launched()
    monkeypatch.setenv("PMI_SIZE", "3")
    assert run.mpi_launched()
    chosen: list[str] = []
    monkeypatch.setattr(run, "_mpi_world", lambda comm: chosen.append("mpi"))
    monkeypatch.setattr(
        run, "_torch_world", lambda group, timeout: chosen.append("torch") or "a group"
    )
    monkeypatch.setattr(run, "_torch_group_initialized", lambda: False)
    run.open_world(None, 1.0)
    run.open_world("torch", 1.0)
    monkeypatch.setattr(run, "_torch_group_initialized", lambda: True)
    run.open_world(None, 1.0)
    run.open_world("mpi", 1.0)
    assert chosen == ["mpi", "torch", "torch", "mpi"]
    with pytest.raises(ValueError, match="nccl"):
        run.open_world("nccl", 1.0)


def test_one_process_over_mpi_is_a_plain_stage(tmp_path: Path) -> None:
    """fanout="mpi" without a launcher: MPI's world of one (a singleton), a plain stage."""
    import fastload

    src = build_tree(tmp_path / "src", small=30, big=MiB)
    r = fastload.stage(src, tmp_path / "a", fanout="mpi")
    assert r.nodes == 1 and not r.skipped
    assert_same_tree(src, tmp_path / "a")
    cli = [sys.executable, "-m", "fastload", "stage", "--fanout-transport", "mpi"]
    subprocess.run([*cli, str(src), str(tmp_path / "b")], env=child_env(), check=True)
    assert_same_tree(src, tmp_path / "b")


def test_without_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    """mpi4py absent: an MPI launcher's variables do not pick MPI, fanout="mpi" says what
    to install, and where nothing else describes the job, stage() warns that every
    process stages alone."""
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py fails
    monkeypatch.setenv("PMI_SIZE", "3")
    assert not run.mpi_launched()
    with pytest.raises(ImportError, match=r"fastload\[mpi\]"):
        run.open_world("mpi", 1.0)
    monkeypatch.setattr(run, "_torch_world", lambda group, timeout: None)
    with pytest.warns(RuntimeWarning, match="every process stages alone"):
        assert run.open_world(None, 1.0) is None
