"""Who takes part in a fanned-out stage: the process group and its transport (the job's
torch.distributed group, MPI's world under an MPI launcher, or a gloo group made from
torchrun's or SLURM's variables), one leader per destination, the node lock, and a
failure recorded for the node's other processes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._util import write_json_atomic
from ..destination import Destination, run_locked
from ..result import StageResult
from ..state import state_dir
from .archive import fan_archive
from .exchange import Exchange, fanout_error, timeout_from_env
from .tree import fan_tree


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _slurm_first_host(nodelist: str) -> str:
    """The address of the job's first node: the rendezvous of a group made from
    SLURM's variables (its name, or its NodeAddr where the name does not resolve)."""
    names = _scontrol("show", "hostnames", nodelist).split()
    if names:
        host = names[0]
    else:
        # "n[1-3,7],m2" -> "n1": the first name of a compressed list, without scontrol.
        head = nodelist.split(",")[0]
        if "[" in head:
            prefix, rest = head.split("[", 1)
            head = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
        host = head
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        pass
    for word in _scontrol("show", "node", host).split():
        if word.startswith("NodeAddr="):
            return word[len("NodeAddr=") :]
    return host


def _init_from_env(dist: Any, timeout: float) -> bool:
    """Initialises the default group from torchrun's or SLURM's variables; False where
    they describe a single process (or none)."""
    import datetime

    env = os.environ
    pg_timeout = datetime.timedelta(seconds=max(timeout, 1800.0))
    if "RANK" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) < 2:
            return False
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ValueError(
                "fanout=True under torchrun's variables needs MASTER_ADDR and MASTER_PORT"
            )
        dist.init_process_group("gloo", init_method="env://", timeout=pg_timeout)
        return True
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        host = env.get("MASTER_ADDR") or _slurm_first_host(env.get("SLURM_JOB_NODELIST", ""))
        port = env.get("FASTLOAD_FANOUT_PORT") or str(
            29500 + 1 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            timeout=pg_timeout,
        )
        return True
    return False


def node_key() -> str:
    """Which node this process is on: SLURM's node number, else torchrun's group rank,
    else the host name (several "nodes" can so share one machine in tests)."""
    env = os.environ
    if "SLURM_NODEID" in env:
        return f"slurm:{env['SLURM_NODEID']}"
    if "GROUP_RANK" in env:
        return f"torchrun:{env['GROUP_RANK']}"
    return f"host:{socket.gethostname()}"


def destination_id(dst: Path) -> str:
    """An id of the directory ``dst`` lands in, the same for every process that sees
    that directory: a random word kept beside it (created once, atomically, also on
    NFS). Processes with the same id share one copy (the same node, or a destination on
    a shared file system); different ids are different disks."""
    path = dst.parent / f".{dst.name}.fastload.id"
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        pass
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(uuid.uuid4().hex, encoding="ascii")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text(encoding="ascii").strip()


# The job's size as MPI launchers tell it: Open MPI's mpirun; PMI's (MPICH's and Intel
# MPI's hydra, srun --mpi=pmi2). Under srun --mpi=pmix none is set: SLURM's variables
# make a gloo group there, or fanout="mpi" asks for MPI.
MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def mpi_launched() -> bool:
    """Whether an MPI launcher started this process as one of several (its variables:
    Open MPI's, PMI's as MPICH's hydra and ``srun --mpi=pmi2`` set them) and mpi4py is
    installed. Nothing is imported: importing mpi4py's MPI initialises MPI."""
    return _mpi_size_from_env() > 1 and importlib.util.find_spec("mpi4py") is not None


def _mpi_size_from_env() -> int:
    return max(_int(os.environ.get(v)) for v in MPI_SIZE_VARIABLES)


def _int(text: str | None) -> int:
    try:
        return int(text or "")
    except ValueError:
        return 0


def _torch_group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")  # never initialised if not imported
    return dist is not None and dist.is_available() and dist.is_initialized()


def _is_mpi_comm(group: Any) -> bool:
    return type(group).__module__.startswith("mpi4py")


def _mpi_world(comm: Any) -> Any:
    try:
        from .over_mpi import MpiWorld

        return MpiWorld(comm)
    except ImportError:
        raise ImportError(
            "fan-out over MPI needs mpi4py (and an MPI library): pip install 'fastload[mpi]' "
            "(a bundled MPICH for tests and laptops), or mpi4py built against the cluster's MPI"
        ) from None


def _torch_world(group: Any, timeout: float) -> Any:
    """The job's torch.distributed group, or one made from torchrun's or SLURM's
    variables; None where it describes a single process."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise ImportError(
            "stage(..., fanout=True) exchanges data over torch.distributed (or MPI under an "
            "MPI launcher): pip install torch (or fastload[mpi]), or drop fanout=True"
        ) from None
    from .over_torch import TorchWorld

    if not dist.is_available():
        return None
    created = False
    if not dist.is_initialized():
        created = _init_from_env(dist, timeout)
        if not created:
            return None
    return TorchWorld(dist, group, created, timeout)


def open_world(fanout: Any, timeout: float) -> Any:
    """Every process of the job, over the transport ``fanout`` asks for: ``"torch"`` or
    ``"mpi"``, a torch.distributed group or an mpi4py communicator; else (``None``) an
    initialised torch.distributed group, else MPI where an MPI launcher started the job
    and mpi4py is installed, else a group made from torchrun's or SLURM's variables.
    None: a single process."""
    if isinstance(fanout, str):
        if fanout not in ("torch", "mpi"):
            raise ValueError(
                f"fanout must be True, False, 'torch', 'mpi' or a group, not {fanout!r}"
            )
        if fanout == "mpi":
            return _mpi_world(None)
        return _torch_world(None, timeout)
    if _is_mpi_comm(fanout):
        return _mpi_world(fanout)
    if fanout is None and not _torch_group_initialized() and mpi_launched():
        return _mpi_world(None)
    world = _torch_world(fanout, timeout)
    if world is None and fanout is None and (n := _mpi_size_from_env()) > 1:
        warnings.warn(
            f"fanout=True: an MPI launcher started {n} processes, but mpi4py is not "
            "installed (pip install mpi4py) and no torch.distributed group or torchrun/SLURM "
            "variables describe the job: every process stages alone",
            RuntimeWarning,
            stacklevel=2,
        )
    return world


def _plain(source: Any, dest: Destination) -> StageResult:
    with dest.locked():
        return run_locked(dest, source)


def stage_fanout(source: Any, dest: Destination, group: Any = None) -> StageResult:
    """Stages ``source`` into ``dest`` across the nodes of the job (see the module's
    description); ``group`` picks the transport (see :func:`open_world`)."""
    timeout = timeout_from_env()
    world = open_world(group, timeout)
    if world is None:
        return _plain(source, dest)
    try:
        if world.size < 2:
            return _plain(source, dest)
        return _stage_in_group(world, source, dest, timeout)
    finally:
        world.close()


def _stage_in_group(world: Any, source: Any, dest: Destination, timeout: float) -> StageResult:
    # One leader per destination, not per node name: three "nodes" whose destination
    # is one directory of a shared file system are one copy (and one node lock).
    me = (node_key(), destination_id(dest.path), socket.gethostname(), uuid.uuid4().hex)
    everyone = world.all_gather_object(me)
    leaders: dict[str, int] = {}
    for r, (_, dest_id, _, _) in enumerate(everyone):
        leaders.setdefault(dest_id, r)
    order = sorted(leaders.values())
    token = everyone[0][3]
    hosts = [everyone[r][2] for r in order]
    me_leader = leaders[everyone[world.rank][1]] == world.rank
    transport = world.leaders(order, me_leader)
    if len(order) == 1:
        # One node: its processes share the node lock as in a plain stage.
        if transport is not None:
            transport.close(True)
        return _plain(source, dest)
    if not me_leader:
        world.barrier()  # the leaders hold their node locks from here on
        with dest.locked():
            failed = _read_failure(dest.path, token)
        if failed is not None:
            raise fanout_error(failed, source.name)
        return _plain(source, dest)
    with dest.locked():
        t0 = time.monotonic()
        # unpack="nested" (zipnested.py): the outer source fanned out, then its inner
        # archives (a tar's zips: on each node from its own disk).
        outer = source.fan_outer(dest) if hasattr(source, "fan_outer") else None
        fanned = source if outer is None else outer
        world.barrier()
        x = Exchange(transport, hosts, source.name, timeout)
        ok = False
        try:
            fan: Callable[[Exchange, Any, Destination], StageResult] = fan_tree
            if getattr(fanned, "fan_kind", None) == "zip":
                from .zips import fan_zip  # (a tree's stage imports no zip module)

                fan = fan_zip
            elif hasattr(fanned, "with_data"):
                fan = fan_archive
            result = fan(x, fanned, dest)
            if outer is not None:  # its inner archives, on every leader alike
                result = source.run_inner(dest.req, dest, result, t0, x)
            ok = True
        except BaseException as e:
            x.abort(e)
            _write_failure(dest.path, token, str(e))
            raise
        finally:
            x.close(ok)
        return result


def _write_failure(dst: Path, token: str, text: str) -> None:
    with contextlib.suppress(OSError):
        state_dir(dst).mkdir(exist_ok=True)
        write_json_atomic(state_dir(dst) / "fanout-failed.json", {"token": token, "error": text})


def _read_failure(dst: Path, token: str) -> str | None:
    try:
        with open(state_dir(dst) / "fanout-failed.json", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("token") == token:
        return str(data.get("error"))
    return None
