"""Under real srun: fastload.env.detect(), world() and ``fastload env`` from the
variables SLURM itself sets (three nodes, two tasks each)."""

from __future__ import annotations

import json

from kit.procs import rendezvous
from kit.slurm import NODES, TASK, Cluster


def test_detect_and_world_under_srun(slurm: Cluster) -> None:
    tasks = slurm.task(["-N", "3", "--ntasks-per-node=2"], "env")
    assert sorted(t["rank"] for t in tasks) == list(range(6))
    job = tasks[0]["job"]
    for t in tasks:
        node = t["nodename"]
        assert t["environment"] == "slurm" and t["source"] == "slurm"
        assert t["world_size"] == 6 and t["num_nodes"] == 3
        assert t["node"] == NODES.index(node)  # SLURM_NODEID: n1 is node 0
        assert t["local_rank"] in (0, 1)
        # The prolog's node-local directory, made for this job on this node.
        assert t["tmpdir"] == t["slurm_tmpdir"] == str(slurm.local(node, job))
        assert t["cpus"] == int(t["cpus_on_node"]) == 2
        assert t["nodelist"] == "n[1-3]"
    by_node = {n: sorted(t["local_rank"] for t in tasks if t["nodename"] == n) for n in NODES}
    assert by_node == {n: [0, 1] for n in NODES}
    # Every node's tmpdir is its own.
    assert len({t["tmpdir"] for t in tasks}) == 3


def test_fastload_env_command(slurm: Cluster) -> None:
    # Each task prints an indented report; --label keeps the two tasks' lines apart
    # (srun writes the lines as they come, interleaved).
    out = slurm.srun("-N", "2", "--ntasks-per-node=1", "--cpus-per-task=3", "--label",
                     slurm.python, "-m", "fastload", "env", "--json").stdout  # fmt: skip
    lines: dict[str, list[str]] = {}
    for line in out.splitlines():
        task, _, text = line.partition(": ")
        lines.setdefault(task.strip(), []).append(text)
    reports = [json.loads("\n".join(v)) for v in lines.values()]
    assert len(reports) == 2
    for r in reports:
        node = r["node"]
        assert r["environment"] == "slurm" and r["cpus"] == 3
        assert r["cpus_from"] == "SLURM_CPUS_ON_NODE"
        assert node["num_nodes"] == 2 and node["node"] == int(node["node_id"])
        assert r["tmpdir"]["path"] == str(slurm.local(node["name"], node["job_id"]))
        assert r["tmpdir"]["exists"] is True
        assert r["world"]["source"] == "slurm" and r["world"]["world_size"] == 2
    # Two of the three nodes (whichever were idle), numbered 0 and 1 in the job.
    assert len({r["node"]["name"] for r in reports}) == 2
    assert sorted(r["node"]["node"] for r in reports) == [0, 1]
    text = slurm.srun("-N", "1", "-n", "1", "--nodelist=n2",
                      slurm.python, "-m", "fastload", "env").stdout  # fmt: skip
    assert "environment    slurm" in text and "(n2), node 0, job" in text


def test_world_under_torchrun_in_srun(slurm: Cluster) -> None:
    # One torchrun agent per node, two workers each, started the usual way on a SLURM
    # cluster. The agents meet through a store this test serves on a port the kernel
    # picked (c10d rendezvous; no port is chosen free and bound again). They number the
    # nodes by their local addresses, which the command line gives in the reverse of
    # SLURM's order (127.0.0.2 on SLURM's node 0), so that the test tells which one
    # world() took: torchrun gave the rank, its GROUP_RANK wins.
    store, _ = rendezvous(4)
    tasks = slurm.task_lines(slurm.srun(
        "-N", "2", "--ntasks-per-node=1", "--cpus-per-task=2", "bash", "-c",
        f"exec {slurm.python} -m torch.distributed.run --nnodes 2 --nproc-per-node 2"
        f" --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{store.port} --rdzv-id world"
        f" --rdzv-conf is_host=false --local-addr 127.0.0.$((2 - SLURM_NODEID))"
        f" {TASK} env",
    ).stdout)  # fmt: skip
    del store
    assert sorted(t["rank"] for t in tasks) == [0, 1, 2, 3]
    for t in tasks:
        assert t["source"] == "torchrun" and t["world_size"] == 4
        assert t["num_nodes"] == 2 and t["node"] == 1 - int(t["slurm_nodeid"])
        assert t["environment"] == "slurm" and t["tmpdir"] == t["slurm_tmpdir"]
    assert sorted(t["slurm_nodeid"] for t in tasks) == ["0", "0", "1", "1"]
