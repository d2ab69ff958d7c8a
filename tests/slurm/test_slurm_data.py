"""Under real sbatch: ``fastload pack`` split over a job array, with the flags or the
array's own variables (a failed task re-run alone). The IterableDataset's rank x worker
split under srun is in test_slurm_readme.py (docs/cluster.md's training script)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import fastload
from fastload import ShardIndex
from kit.slurm import Cluster


def make_samples(root: Path, n: int = 120) -> None:
    for i in range(n):
        d = root / f"class{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"s{i:04d}.bin").write_bytes(hashlib.sha256(str(i).encode()).digest() * (i + 1))


ARRAY_SCRIPT = """#!/bin/bash
set -e
if [ "$SLURM_ARRAY_TASK_ID" = 2 ] && [ ! -e {flag} ]; then
  touch {flag}; echo "task 2 fails once"; exit 3
fi
{python} -m fastload pack {src} {out} --shuffle --seed 7 --max-count 9 --no-progress {flags}
"""


def test_pack_over_a_job_array(slurm: Cluster, tmp_path: Path) -> None:
    shared = slurm.root / "shared" / tmp_path.name
    src = shared / "src"
    make_samples(src)
    one = fastload.pack(src, shared / "one", shuffle=True, seed=7, max_count=9, progress=False)
    want = sorted(p.name for p in one.shards)
    assert len(want) >= 8
    for name, flags in [
        ("flags", "--task-index $SLURM_ARRAY_TASK_ID --num-tasks 4"),
        ("env", ""),  # no flags: the array's task and count
    ]:
        out = shared / name
        script = ARRAY_SCRIPT.format(flag=shared / f"{name}.failed", python=slurm.python,
                                     src=src, out=out, flags=flags)  # fmt: skip
        _, code = slurm.sbatch(script, "--array=0-3", "-o", str(shared / f"{name}-%a.txt"))
        assert code == 3  # task 2 failed...
        assert "task 2 fails once" in (shared / f"{name}-2.txt").read_text()
        mine = set(want[2::4])
        assert mine and not any((out / n).exists() for n in mine)
        assert sorted(p.name for p in out.glob("*.tar")) == sorted(set(want) - mine)
        if name == "flags":  # ...and runs again alone: its own shards, no other's
            _, code = slurm.sbatch(script, "--array=2", "-o", str(shared / f"{name}-rerun.txt"))
        else:  # alone, the array is one task: say which
            _, code = slurm.sbatch(
                script.replace("--no-progress ", "--no-progress --num-tasks 4 "),
                "--array=2", "-o", str(shared / f"{name}-rerun.txt"),
            )  # fmt: skip
        assert code == 0
        assert "task 2 of 4" in (shared / f"{name}-rerun.txt").read_text()
        slurm.run([slurm.python, "-m", "fastload", "index", str(out)])
        assert sorted(p.name for p in out.glob("*.tar")) == want
        for n in want:  # the same samples in the same order, byte for byte
            assert (out / n).read_bytes() == (shared / "one" / n).read_bytes(), n
        assert one.index is not None
        assert ShardIndex.open(out / "index.fidx").keys() == ShardIndex.open(one.index).keys()
