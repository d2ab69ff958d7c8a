"""What one task of a test's job step does, run by srun as ``python slurm_task.py OP
ARGS``; prints one JSON line (the test reads every task's).

    env                     fastload.env.detect() and world() as this task sees them
    stage SRC NAME          fastload.stage(SRC, $SLURM_TMPDIR/NAME)
    resolve SRC CACHE       fastload.resolve(SRC, cache=CACHE) (into $SLURM_TMPDIR)
    iterate INDEX [WORKERS] the __key__ of every sample this rank's DataLoader yields
    list DIR                the files under DIR (hidden ones left out): their count and
                            the sha256 of their sorted names, one per line
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import fastload
from fastload.env import detect, world


def _who() -> dict[str, Any]:
    w = world(os.environ)
    return {
        "rank": w.rank, "world_size": w.world_size, "local_rank": w.local_rank,
        "node": w.node, "num_nodes": w.num_nodes, "source": w.source,
        "nodename": os.environ.get("SLURMD_NODENAME"),
        "slurm_nodeid": os.environ.get("SLURM_NODEID"), "job": os.environ.get("SLURM_JOB_ID"),
        "slurm_tmpdir": os.environ.get("SLURM_TMPDIR"),
    }  # fmt: skip


def names_digest(names: list[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def main(op: str, *args: str) -> dict[str, Any]:
    out = _who()
    if op == "env":
        e = detect(os.environ)
        out.update(environment=e.name, tmpdir=str(e.tmpdir), cpus=e.cpus,
                   cpus_on_node=os.environ.get("SLURM_CPUS_ON_NODE"),
                   nodelist=os.environ.get("SLURM_JOB_NODELIST"))  # fmt: skip
    elif op == "stage":
        r = fastload.stage(args[0], os.path.join(os.environ["SLURM_TMPDIR"], args[1]),
                           progress=False)  # fmt: skip
        out.update(path=str(r.path), files=r.files, copied_files=r.copied_files,
                   skipped=r.skipped)  # fmt: skip
    elif op == "resolve":
        out.update(path=str(fastload.resolve(args[0], cache=args[1], progress=False)))
    elif op == "iterate":
        import torch.utils.data

        ds = fastload.ShardIterableDataset(args[0], shuffle=True, seed=5)
        workers = int(args[1]) if len(args) > 1 else 2
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
        out.update(keys=[s["__key__"] for s in loader])
    elif op == "list":
        root = Path(args[0])
        names = sorted(str(f.relative_to(root)) for f in root.rglob("*")
                       if f.is_file() and not f.name.startswith("."))  # fmt: skip
        out.update(path=str(root), listed=len(names), names_sha256=names_digest(names))
    else:
        raise SystemExit(f"unknown op {op}")
    return out


if __name__ == "__main__":
    # One write, so tasks sharing a pipe do not split lines; and under 1 KiB, since
    # slurmstepd forwards a task's output in messages of at most 1024 bytes, and srun
    # interleaves the messages of different tasks (a longer line came back cut in two).
    line = (json.dumps(main(*sys.argv[1:])) + "\n").encode()
    if len(line) > 1024:
        raise SystemExit(f"slurm_task: a report of {len(line)} bytes would be split by srun")
    os.write(1, line)
