"""Under real srun: fastload.env.detect(), world() and ``fastload env`` from the
variables SLURM itself sets (three nodes, two tasks each)."""

from __future__ import annotations

import json

from conftest import NODES, Cluster


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
    out = slurm.srun("-N", "2", "--ntasks-per-node=1", "--cpus-per-task=3",
                     slurm.python, "-m", "fastload", "env", "--json").stdout  # fmt: skip
    decoder, reports, i = json.JSONDecoder(), [], 0
    while i < len(out):
        if out[i].isspace():
            i += 1
            continue
        r, i = decoder.raw_decode(out, i)
        reports.append(r)
    assert len(reports) == 2
    for r in reports:
        node = r["node"]
        assert r["environment"] == "slurm" and r["cpus"] == 3
        assert r["cpus_from"] == "SLURM_CPUS_ON_NODE"
        assert node["num_nodes"] == 2 and node["node"] == NODES.index(node["name"])
        assert r["tmpdir"]["path"] == str(slurm.local(node["name"], node["job_id"]))
        assert r["tmpdir"]["exists"] is True
        assert r["world"]["source"] == "slurm" and r["world"]["world_size"] == 2
    assert sorted(r["node"]["name"] for r in reports) == ["n1", "n2"]
    text = slurm.srun("-N", "1", "-n", "1", "--nodelist=n2",
                      slurm.python, "-m", "fastload", "env").stdout  # fmt: skip
    assert "environment    slurm" in text and "(n2), node 0, job" in text
