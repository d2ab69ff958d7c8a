"""One process of a fanned-out stage (run by path): ``fanout_child.py SRC DST`` with the
variables of a multi-node job in its environment. ``{node}`` in DST becomes
``SLURM_NODEID`` (under srun, or given to each rank by mpiexec). ``--init`` makes the
gloo group from torchrun's variables before calling stage(), as a training script does;
without it stage() makes its own. ``--fanout mpi`` or ``torch`` picks the transport
(default: stage() chooses); ``--pid`` prints ``{"pid": ...}`` first; ``--workers N``
passes ``workers=N``; ``--resolve`` calls ``resolve(sources=[SRC], destination=DST,
fanout=...)`` instead of stage().
Prints one JSON line per progress report (``{"progress": bytes}``) and then
``{"result": ...}`` or ``{"error": ...}`` (exit status 3)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from typing import Any

import fastload


def say(doc: dict[str, Any]) -> None:
    # One write per line: mpiexec prefixes every chunk it reads with the rank.
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--init", action="store_true")
    p.add_argument("--nested", action="store_true")
    p.add_argument("--stripe", type=int, default=None)
    p.add_argument("--workers", type=int, default=None, help="stage(workers=...)")
    p.add_argument("--include", default=None)
    p.add_argument("--exclude", default=None)
    p.add_argument("--fanout", default="true", help="true, or a transport: torch, mpi")
    p.add_argument("--pid", action="store_true", help="print {'pid': ...} first")
    p.add_argument("--resolve", action="store_true", help="resolve() instead of stage()")
    args = p.parse_args()
    if args.pid:
        say({"pid": os.getpid()})
    dst = args.dst.replace("{node}", os.environ.get("SLURM_NODEID", "x"))
    if args.init:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))

    def progress(done: int, total: int, files: int, files_total: int) -> None:
        say({"progress": done})

    fanout = True if args.fanout == "true" else args.fanout
    kwargs: dict[str, Any] = {"fanout": fanout, "progress": progress}
    if args.nested:
        kwargs["unpack"] = "nested"
    for name in ("include", "exclude"):
        if getattr(args, name):
            kwargs[name] = getattr(args, name)
    if args.stripe:
        kwargs["stripe_size"] = args.stripe
    if args.workers:
        kwargs["workers"] = args.workers
    try:
        if args.resolve:
            got = fastload.resolve(sources=[args.src], destination=dst, fanout=fanout)
            say({"result": {"path": str(got)}})
            return 0
        r = fastload.stage(args.src, dst, **kwargs)
    except Exception as e:
        out = {"type": type(e).__name__, "message": str(e)}
        say({"error": out})
        return 3
    result = {
        "path": str(r.path),
        "files": r.files,
        "bytes": r.bytes,
        "copied_files": r.copied_files,
        "copied_bytes": r.copied_bytes,
        "skipped": r.skipped,
        "engine": r.engine,
        "nodes": r.nodes,
        "read_bytes": r.read_bytes,
    }
    say({"result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
