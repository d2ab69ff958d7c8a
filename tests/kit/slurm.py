"""A real SLURM cluster on loopback (scripts/slurm-cluster.sh): what the tests in
tests/slurm drive it with. Their conftest starts one per session (the ``slurm``
fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fastload

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm-cluster.sh"
TASK = Path(__file__).resolve().parents[1] / "slurm" / "slurm_task.py"
BINARIES = ("slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel")
NODES = ("n1", "n2", "n3")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE"}  # fmt: skip


class Cluster:
    """The running test cluster: its directory, and srun/sbatch with the job's
    environment (``SLURM_CONF``, ``PYTHONPATH``) set."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.python = sys.executable  # the venv's, by absolute path
        self.package_dir = str(Path(fastload.__file__).resolve().parent.parent)

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment less any SLURM job's it runs in, with the test
        cluster's configuration and this fastload."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "FASTLOAD_"))
        }
        env.update(SLURM_CONF=str(self.conf), PYTHONPATH=self.package_dir, **extra)
        return env

    def local(self, node: str, job: int | str) -> Path:
        """The node-local SLURM_TMPDIR the prolog makes for ``job`` on ``node``."""
        return self.root / "local" / node / str(job)

    def run(self, argv: Sequence[str], timeout: float = 120,
            check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
        proc = subprocess.run(
            list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
            )
        return proc

    def srun(self, *args: str, timeout: float = 120,
             check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return self.run(["srun", "--time=5", *args], timeout=timeout, check=check)

    def task(self, srun_args: Sequence[str], *task_args: str) -> list[dict[str, Any]]:
        """``srun SRUN_ARGS python slurm_task.py TASK_ARGS``: one JSON line per task."""
        return self.task_lines(self.srun(*srun_args, self.python, str(TASK), *task_args).stdout)

    @staticmethod
    def task_lines(out: str) -> list[dict[str, Any]]:
        """slurm_task.py's JSON lines among ``out``'s (two on one line too: the tasks
        torchrun starts share its output, and their lines may run together)."""
        decoder = json.JSONDecoder()
        found: list[dict[str, Any]] = []
        for line in out.splitlines():
            at = 0
            while line.startswith("{", at):
                obj, at = decoder.raw_decode(line, at)
                found.append(obj)
        return found

    def sbatch(self, script: str, *args: str, wait: bool = True) -> tuple[int, int]:
        """Submits ``script`` (the text of a batch script); returns its job id and, with
        ``wait``, the highest exit code of its tasks once all have ended (-1 as the
        code without). Waits by asking ``scontrol`` every 0.1 s: ``sbatch --wait``
        polls after 2, 8 and then 32 s, most of a test's time."""
        path = self.root / "jobs" / f"job-{time.monotonic_ns()}.sh"
        path.parent.mkdir(exist_ok=True)
        path.write_text(script)
        proc = self.run(["sbatch", "--parsable", "--time=5", *args, str(path)])
        job = int(proc.stdout.strip().splitlines()[0].split(";")[0])
        return job, (self.wait(job) if wait else -1)

    def jobs(self, job: int) -> list[dict[str, str]]:
        """``scontrol show job``'s records of ``job`` (one per array task)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job)]).stdout
        return [dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
                for line in out.splitlines() if line.strip()]  # fmt: skip

    def wait(self, job: int, timeout: float = 120) -> int:
        """Until every task of ``job`` has ended: the highest exit code among them."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.jobs(job)
            if all(r["JobState"] in ENDED for r in records):
                codes = [int(r["ExitCode"].split(":")[0]) for r in records]
                if any(r["JobState"] != "COMPLETED" for r in records):
                    codes.append(1)
                return max(codes)
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} still running after {timeout} s: {records}")
            time.sleep(0.1)

    def states(self, job: int) -> dict[str, str]:
        """Job and step ids of ``job`` -> their state, from squeue (running ones)."""
        out = self.run(["squeue", "-h", "-s", "-j", str(job), "-o", "%i %T"], check=False)
        return dict(line.split() for line in out.stdout.splitlines() if line.strip())
