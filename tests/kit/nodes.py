"""Several "nodes" on this machine for fan-out staging: one process per rank of a
multi-node torchrun job (its variables in the environment), each running
kit/fanout_child.py, a gloo group on loopback; or the ranks of one ``mpiexec`` (the
mpich wheel's), each given its own node's variables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kit.procs import child_env, rendezvous
from kit.trees import build_small_files, write_patterned

CHILD = Path(__file__).resolve().with_name("fanout_child.py")


def start_nodes(
    src: Path | str,
    dsts: list[Path],
    *,
    per_node: int = 1,
    init: bool = True,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    launcher: list[str] | None = None,
) -> list[subprocess.Popen[str]]:
    """One process per rank of a ``len(dsts)``-node torchrun job, ``per_node`` ranks
    per node; node k's processes stage into ``dsts[k]``. This process serves their
    rendezvous, as torchrun's agent does. ``launcher`` replaces ``python
    kit/fanout_child.py`` (``[python, "-m", "fastload", "stage", "--fanout"]``, say);
    SRC, DST and ``args`` follow it."""
    nodes = len(dsts)
    store, where = rendezvous(nodes * per_node)
    procs = []
    for rank in range(nodes * per_node):
        node, local = divmod(rank, per_node)
        e = child_env(
            RANK=str(rank),
            WORLD_SIZE=str(nodes * per_node),
            GROUP_RANK=str(node),
            GROUP_WORLD_SIZE=str(nodes),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(per_node),
            **where,
            **(env or {}),
        )
        cmd = [*(launcher or [sys.executable, str(CHILD)]), str(src), str(dsts[node]), *args]
        if init:
            cmd.append("--init")
        procs.append(
            subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
        procs[-1].rendezvous = store  # type: ignore[attr-defined]  # lives as they do
    return procs


def outcome(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    for line in reversed(out.splitlines()):
        doc = json.loads(line)
        if "result" in doc or "error" in doc:
            return doc
    raise AssertionError(f"no result from a node (exit {proc.returncode}):\n{out}\n{err}")


def kill_once_writing(proc: subprocess.Popen[str]) -> None:
    """Kills ``proc`` (a node of :func:`start_nodes`, -9) once it reports progress: it
    has written something; waits for it to be gone."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if json.loads(line).get("progress", 0) > 0:
            break
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


def results(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    docs = [outcome(p) for p in procs]
    for d in docs:
        assert "result" in d, d
    return [d["result"] for d in docs]


def mpiexec() -> Path | None:
    """The mpiexec beside this Python (the mpich wheel's hydra, in the venv), if any."""
    path = Path(sys.executable).with_name("mpiexec")
    return path if path.exists() else None


def start_mpi_nodes(
    src: Path | str,
    dsts: list[Path],
    *,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """One ``mpiexec`` of ``len(dsts)`` ranks on this machine, each with the variables of
    its own node (``SLURM_NODEID``, no torchrun or SLURM job variables: the group is
    MPI's) and staging into ``dsts[rank]``; their lines come prefixed ``[rank] ``."""
    exe = mpiexec()
    assert exe is not None
    cmd: list[str] = [str(exe), "-prepend-rank"]
    for k, d in enumerate(dsts):
        if k:
            cmd.append(":")
        cmd += ["-n", "1", "-env", "SLURM_NODEID", str(k)]
        cmd += [sys.executable, str(CHILD), str(src), str(d), "--pid", *args]
    return subprocess.Popen(
        cmd, env=child_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def mpi_line(line: str) -> tuple[int, dict[str, Any]] | None:
    """``[rank] {json}`` -> (rank, the document); None for MPI's own lines. (hydra
    prefixes each chunk it reads, so a line may end in a stray ``[rank] ``.)"""
    head, _, rest = line.partition("] ")
    if not head.startswith("[") or not head[1:].isdigit() or not rest.startswith("{"):
        return None
    try:
        doc, _ = json.JSONDecoder().raw_decode(rest)
    except ValueError:
        return None
    return int(head[1:]), doc


def mpi_outcomes(proc: subprocess.Popen[str], timeout: float = 240) -> dict[int, dict[str, Any]]:
    """Each rank's last result or error (ranks that printed neither are missing)."""
    out, _ = proc.communicate(timeout=timeout)
    docs: dict[int, dict[str, Any]] = {}
    for line in out.splitlines():
        got = mpi_line(line)
        if got is not None and ("result" in got[1] or "error" in got[1]):
            docs[got[0]] = got[1]
    return docs


# --------------------------------------------------------------------------------------
# What the nodes stage
# --------------------------------------------------------------------------------------


def fanout_tree(root: Path, *, small: int, big: int) -> Path:
    """``small`` small files (100 per directory, one directory 0o750), one big file of
    ``big`` bytes, an empty file and a symlink."""
    build_small_files(root / "small", small, per_dir=100)
    (root / "big").mkdir(parents=True)
    write_patterned(root / "big" / "weights.bin", big, seed=5)
    (root / "empty.txt").write_bytes(b"")
    (root / "link").symlink_to("big/weights.bin")
    os.chmod(root / "small", 0o750)
    return root


def data_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (or of ``root``, a file)."""
    if root.is_file():
        return root.stat().st_size
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
