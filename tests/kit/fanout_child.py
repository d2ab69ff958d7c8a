"""One process of a fanned-out stage (run by path): ``fanout_child.py SRC DST`` with the
variables of a multi-node job in its environment. ``{node}`` in DST becomes
``SLURM_NODEID`` (under srun). ``--init`` makes the gloo group from torchrun's variables
before calling stage(), as a training script does; without it stage() makes its own.
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--init", action="store_true")
    p.add_argument("--nested", action="store_true")
    p.add_argument("--stripe", type=int, default=None)
    p.add_argument("--include", default=None)
    p.add_argument("--exclude", default=None)
    args = p.parse_args()
    dst = args.dst.replace("{node}", os.environ.get("SLURM_NODEID", "x"))
    if args.init:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))

    def progress(done: int, total: int, files: int, files_total: int) -> None:
        print(json.dumps({"progress": done}), flush=True)

    kwargs: dict[str, Any] = {"fanout": True, "progress": progress}
    if args.nested:
        kwargs["unpack"] = "nested"
    for name in ("include", "exclude"):
        if getattr(args, name):
            kwargs[name] = getattr(args, name)
    if args.stripe:
        kwargs["stripe_size"] = args.stripe
    try:
        r = fastload.stage(args.src, dst, **kwargs)
    except Exception as e:
        out = {"type": type(e).__name__, "message": str(e)}
        print(json.dumps({"error": out}), flush=True)
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
    print(json.dumps({"result": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
