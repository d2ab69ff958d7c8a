"""World.node and World.num_nodes from each launcher's variables (no cluster needed):
SLURM's names, torchrun's, and which wins where both are set."""

from __future__ import annotations

import pytest

from fastload.env import world

# What srun sets on the second of three nodes, second task there (of 2 per node).
SRUN = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_NNODES": "3", "SLURM_JOB_NUM_NODES": "3"}  # fmt: skip
# What torchrun sets in a worker on its second node of two, 4 workers a node.
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({}, (0, 1)),
        (SRUN, (1, 3)),
        ({**SRUN, "SLURM_NNODES": "4"}, (1, 4)),  # SLURM_NNODES before SLURM_JOB_NUM_NODES
        ({k: v for k, v in SRUN.items() if k != "SLURM_NNODES"}, (1, 3)),
        ({"SLURM_NODEID": "2"}, (2, 3)),  # no count: the nodes up to this one
        (TORCHRUN, (1, 2)),
        ({**TORCHRUN, "GROUP_WORLD_SIZE": "3"}, (1, 3)),
        ({k: v for k, v in TORCHRUN.items() if k != "GROUP_WORLD_SIZE"}, (1, 2)),  # 8 // 4
        ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "NNODES": "3"}, (0, 3)),
        ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}, (0, 2)),
        ({"RANK": "0", "WORLD_SIZE": "2"}, (0, 1)),
        # torchrun under an sbatch allocation: torchrun gave the rank, its node wins.
        ({**SRUN, **TORCHRUN, "SLURM_NODEID": "0"}, (1, 2)),
        # srun's tasks in a job whose environment has a stray GROUP_RANK: SLURM's wins.
        ({**SRUN, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"}, (1, 3)),
    ],
)
def test_node_and_num_nodes(environ: dict[str, str], want: tuple[int, int]) -> None:
    w = world(environ, dist=False)
    assert (w.node, w.num_nodes) == want


def test_srun_rank_and_local_rank_are_distinct() -> None:
    w = world(SRUN, dist=False)
    assert (w.rank, w.world_size, w.local_rank, w.source) == (3, 6, 1, "slurm")


@pytest.mark.parametrize(
    "environ",
    [
        {"SLURM_NODEID": "3", "SLURM_NNODES": "3"},
        {"SLURM_NODEID": "x", "SLURM_NNODES": "3"},
        {"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "2"},
    ],
)
def test_a_node_outside_its_count_is_an_error(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"node|integer"):
        world(environ, dist=False)
