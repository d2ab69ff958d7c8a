"""One rank of the partition check of test_bench_iterable.py (``split-*`` groups).

    python benchmarks/_split_rank.py SPEC.pkl OUT.json

Started twice at once by :func:`run_world`, with the environment torchrun gives a rank
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): it joins a
gloo process group as a DDP job would (litdata reads its world from torch.distributed,
MosaicML streaming and fastload from the environment or torch.distributed, webdataset
from either), reads its part of one epoch (``SPEC``: module, function and arguments that
return the keys, e.g. through DataLoader(num_workers=2)) and writes the keys as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        fn = getattr(importlib.import_module(spec["module"]), spec["function"])
        keys: list[str] = fn(*spec["args"])
        with open(out_path, "w") as f:
            json.dump(keys, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(
    module: str, function: str, args: tuple[Any, ...], *, world: int = 2, timeout: float = 900
) -> list[list[str]]:
    """Runs ``module.function(*args)`` in ``world`` concurrent rank processes of one node
    and returns each rank's keys; raises RuntimeError with a rank's output if one fails."""
    with tempfile.TemporaryDirectory(prefix="split-") as tmp:
        spec = Path(tmp) / "spec.pkl"
        spec.write_bytes(pickle.dumps({"module": module, "function": function, "args": args}))
        port = str(_free_port())
        procs = []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
            )
            log = open(Path(tmp) / f"rank{rank}.log", "w+b")  # noqa: SIM115
            cmd = [sys.executable, str(HERE / "_split_rank.py"), str(spec), f"{tmp}/r{rank}.json"]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
        failed = []
        for rank, (p, log) in enumerate(procs):
            try:
                rc = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                rc = "timeout"
            log.seek(0)
            out = log.read().decode(errors="replace")
            log.close()
            if rc != 0:
                failed.append(f"rank {rank} exited {rc}:\n{out[-4000:]}")
        if failed:
            for p, _log in procs:
                if p.poll() is None:
                    p.kill()
            raise RuntimeError("\n".join(failed))
        return [json.loads(Path(f"{tmp}/r{rank}.json").read_text()) for rank in range(world)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
