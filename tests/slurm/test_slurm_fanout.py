"""Fan-out staging launched by ``srun -N3`` alone: no torchrun variables, the group comes
from SLURM's (SLURM_PROCID, SLURM_NTASKS, the job's first node as the rendezvous)."""

from __future__ import annotations

import json
from pathlib import Path

from kit.slurm import Cluster
from kit.trees import assert_same_tree, build_small_files, write_patterned

CHILD = Path(__file__).resolve().parents[1] / "kit" / "fanout_child.py"


def test_srun_three_nodes(slurm: Cluster, tmp_path: Path) -> None:
    src = slurm.root / "shared" / tmp_path.name / "src"  # "network" storage all nodes see
    build_small_files(src / "small", 200, per_dir=50)
    write_patterned(src / "big.bin", 20 << 20, seed=3)
    out = slurm.srun(
        "-N", "3", "--ntasks-per-node=1", slurm.python, str(CHILD), str(src),
        str(tmp_path / "node{node}" / "data"), timeout=240,
    )  # fmt: skip
    docs = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    got = [d["result"] for d in docs if "result" in d]
    assert len(got) == 3, out.stdout + out.stderr
    assert all(r["nodes"] == 3 for r in got)
    total = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert sum(r["read_bytes"] for r in got) == total
    for k in range(3):
        assert_same_tree(src, tmp_path / f"node{k}" / "data")
