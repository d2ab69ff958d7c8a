"""MosaicML streaming and litdata reading from S3, for test_bench_remote.py, in a process
of their own.

    python benchmarks/_remote_peer.py

Why a process of its own: as a training job that reads only with them would run them,
in a process that has not imported fastload nor started obstore's runtime (fastload's
listing does, in the benchmark's process), and so that what _peers.remote_loader sets
for litdata (obstore taken for absent: its obstore stores cannot reach the http://
endpoint) stays here. Both peers run here alike (imports done before the first round).

Prints ``ready`` (or ``missing NAME``), then answers one JSON request per line:

  {"op": "import", "tool": T}                       ``ok 0 0`` once T is imported
  {"op": "epoch", "tool": T, "url": ..., "cache": ..., "cache_limit": ..., "endpoint": ...,
   "batch": B, "workers": W, "seed": S}
      one shuffled epoch of _peers.remote_loader(...): ``ok COUNT UNIQUE`` (samples and
      distinct keys)
  {"op": "first", ...the same}                      the first batch: ``ok COUNT COUNT``

``skip REASON`` where the peer is not installed, ``error ...`` on any other failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _serve(req: dict[str, Any]) -> tuple[int, int]:
    import _peers

    if req["op"] == "import":
        _peers.importer(req["tool"])()
        return 0, 0
    loader = _peers.remote_loader(
        req["tool"], req["url"], Path(req["cache"]), cache_limit=req["cache_limit"],
        endpoint=req["endpoint"], batch=req["batch"], workers=req["workers"],
        seed=req["seed"], shuffle_block=req.get("shuffle_block"),
    )  # fmt: skip
    if req["op"] == "first":
        it = iter(loader)
        n = len(next(it))
        del it  # shuts the workers down
        return n, n
    keys = [s["__key__"] for batch in loader for s in batch]
    return len(keys), len(set(keys))


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    try:
        import torch.utils.data  # noqa: F401

        import _peers  # noqa: F401
    except ImportError as e:
        print(f"missing {e.name}", flush=True)
        return 0
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            a, b = _serve(json.loads(line))
            print(f"ok {a} {b}", flush=True)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # pytest.skip's exception is a BaseException
            kind = "skip" if type(e).__name__ == "Skipped" else "error"
            print(f"{kind} " + str(e if kind == "skip" else repr(e)).replace("\n", " "),
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
