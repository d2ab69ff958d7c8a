"""Who this process is among the readers of a data set: its rank in the job and its
worker in the rank's DataLoader.

:func:`world` is pure: it reads only the mapping and the objects it is given (and, when
no ``dist`` is given, whether ``torch.distributed`` is already imported and initialised).
It never imports torch.

Where the rank comes from, first match wins:

1. ``torch.distributed``, when it is initialised (passed as ``dist``, or found already
   imported): its rank and world size are what the job actually runs with.
2. ``RANK`` and ``WORLD_SIZE`` (torchrun, torch.distributed.launch, accelerate,
   Lightning): checked before SLURM's variables, which are also set in a SLURM job whose
   ranks another launcher started.
3. ``SLURM_PROCID`` and ``SLURM_NTASKS`` (ranks started by ``srun``).
4. Otherwise a single process: rank 0 of 1.

The local rank comes from ``LOCAL_RANK``, else ``SLURM_LOCALID``, else 0. The node (its
number in the job, for one-per-node work such as staging) comes from ``SLURM_NODEID``
with ``SLURM_NNODES`` (or ``SLURM_JOB_NUM_NODES``), else torchrun's ``GROUP_RANK`` (else
0) of ``GROUP_WORLD_SIZE``, else ``NNODES``, else ``WORLD_SIZE // LOCAL_WORLD_SIZE``;
torchrun's come first when torchrun gave the rank. Else node 0 of 1. The worker comes
from the DataLoader's ``get_worker_info()`` (``None`` in the main process: worker 0 of 1).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["World", "world"]


@dataclasses.dataclass(frozen=True)
class World:
    """One reader of a data set: rank ``rank`` of ``world_size``, worker ``worker_id`` of
    the ``num_workers`` reading for that rank (``num_workers`` is 1 when the rank reads in
    its main process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    worker_id: int = 0
    num_workers: int = 1
    source: str = "single"
    """Where rank and world size came from: ``"dist"``, ``"torchrun"``, ``"slurm"`` or
    ``"single"``."""
    node: int = 0
    """This process's node among the job's (``SLURM_NODEID``, torchrun's ``GROUP_RANK``)."""
    num_nodes: int = 1
    """Nodes in the job (``SLURM_NNODES``, torchrun's ``GROUP_WORLD_SIZE``)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of size {self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"worker {self.worker_id} is not one of {self.num_workers} workers")
        if self.local_rank < 0:
            raise ValueError(f"local rank {self.local_rank} is negative")
        if self.num_nodes < 1 or not 0 <= self.node < self.num_nodes:
            raise ValueError(f"node {self.node} is not one of {self.num_nodes} nodes")

    @property
    def consumers(self) -> int:
        """Readers in the whole job: ``world_size * num_workers``."""
        return self.world_size * self.num_workers

    @property
    def consumer(self) -> int:
        """This reader's number among them, rank-major: ``rank * num_workers + worker_id``."""
        return self.rank * self.num_workers + self.worker_id


def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ[name]
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer") from None


def _initialised(dist: Any) -> bool:
    try:
        return bool(dist.is_available() and dist.is_initialized())
    except AttributeError:
        return False


def _local_rank(environ: Mapping[str, str], slurm: bool) -> int:
    if "LOCAL_RANK" in environ:
        return _int(environ, "LOCAL_RANK")
    if slurm and "SLURM_LOCALID" in environ:
        return _int(environ, "SLURM_LOCALID")
    return 0


def _slurm_nodes(environ: Mapping[str, str]) -> tuple[int, int] | None:
    if "SLURM_NODEID" not in environ:
        return None
    node = _int(environ, "SLURM_NODEID")
    for name in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if name in environ:
            return node, _int(environ, name)
    return node, node + 1  # a node number without a count counts the nodes up to it


def _torchrun_nodes(environ: Mapping[str, str]) -> tuple[int, int] | None:
    per_node = "LOCAL_WORLD_SIZE" in environ and "WORLD_SIZE" in environ
    if not per_node and not any(n in environ for n in ("GROUP_RANK", "GROUP_WORLD_SIZE", "NNODES")):
        return None
    node = _int(environ, "GROUP_RANK") if "GROUP_RANK" in environ else 0
    for name in ("GROUP_WORLD_SIZE", "NNODES"):
        if name in environ:
            return node, _int(environ, name)
    if per_node and (local := _int(environ, "LOCAL_WORLD_SIZE")) > 0:
        return node, max(_int(environ, "WORLD_SIZE") // local, 1)
    return node, node + 1


def _node(environ: Mapping[str, str], torchrun_first: bool) -> tuple[int, int]:
    """(node, num_nodes) from the first family of variables that names the node."""
    families = [_slurm_nodes, _torchrun_nodes]
    if torchrun_first:
        families.reverse()
    for family in families:
        if (found := family(environ)) is not None:
            return found
    return 0, 1


def world(environ: Mapping[str, str], worker_info: Any = None, dist: Any = None) -> World:
    """The :class:`World` of this process.

    ``environ``: the environment (``os.environ``). ``worker_info``: what
    ``torch.utils.data.get_worker_info()`` returned (anything with ``id`` and
    ``num_workers``), ``None`` in the main process. ``dist``: the ``torch.distributed``
    module (or any object with ``is_available``, ``is_initialized``, ``get_rank`` and
    ``get_world_size``); ``None`` looks for an already imported ``torch.distributed``.
    ``node``/``num_nodes``: see the module's description.

    Raises ``ValueError`` for an environment that names half a world (``RANK`` without
    ``WORLD_SIZE``, or the other way round, and no SLURM task to fall back on), a
    non-integer variable, or a rank outside its world.
    """
    if dist is None:
        dist = sys.modules.get("torch.distributed")
    if worker_info is None:
        worker_id, num_workers = 0, 1
    else:
        worker_id, num_workers = int(worker_info.id), int(worker_info.num_workers)

    if dist is not None and _initialised(dist):
        rank, size = int(dist.get_rank()), int(dist.get_world_size())
        source = "dist"
        local = _local_rank(environ, slurm=True)
    elif "RANK" in environ and "WORLD_SIZE" in environ:
        rank, size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        source = "torchrun"
        local = _local_rank(environ, slurm=False)
    elif "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        rank, size = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
        source = "slurm"
        local = _local_rank(environ, slurm=True)
    elif "RANK" in environ or "WORLD_SIZE" in environ:
        have, lack = ("RANK", "WORLD_SIZE") if "RANK" in environ else ("WORLD_SIZE", "RANK")
        raise ValueError(f"environment variable {have} is set but {lack} is not")
    else:
        rank, size, source, local = 0, 1, "single", 0
    # torchrun's node first wherever torchrun (or a launcher like it) started the ranks.
    node, num_nodes = _node(environ, "RANK" in environ and "WORLD_SIZE" in environ)
    return World(rank, size, local, worker_id, num_workers, source, node, num_nodes)
