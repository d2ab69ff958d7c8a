"""One "node" of the fan-out benchmark (test_bench_fanout.py), run by path with the
variables of a multi-node torchrun job (RANK, WORLD_SIZE, GROUP_RANK, LOCAL_RANK=0,
LOCAL_WORLD_SIZE=1, MASTER_ADDR, MASTER_PORT).

It imports fastload and torch, joins the job's gloo group (as a training script has
before it stages), says ``ready`` and then runs the requests it reads on stdin, one JSON
object a line, so that neither the interpreter's start nor torch's import (seconds on a
busy machine) is in any measured pass:

- ``{"op": "stage", "src": ..., "dst": ..., "fanout": bool}``: one ``fastload.stage()``;
  replies with the result, the call's start and end (``time.time()``, the same clock in
  every node on this machine), and, fanned out, the seconds this node spent in the
  exchange's rounds and the bytes it received from the other nodes there.
- ``{"op": "exchange", "bytes": n, "round": k}``: the exchange alone, no storage: rounds
  of ``k`` bytes from every node until each has sent ``n``; replies with the seconds and
  the bytes received from the others.
- ``{"op": "quit"}``.

Replies are lines starting with ``@@`` (JSON), errors as ``{"error": ...}``.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
from typing import Any

import torch.distributed as dist

import fastload
from fastload.staging.fanout import exchange
from fastload.staging.fanout.over_torch import TorchTransport

_round_trip = exchange.Exchange.round_trip
_spent = {"seconds": 0.0, "received": 0}


def _timed_round_trip(self: Any, payload: Any, status: int = exchange.OK) -> Any:
    t0 = time.perf_counter()
    views = _round_trip(self, payload, status)
    _spent["seconds"] += time.perf_counter() - t0
    _spent["received"] += sum(v.nbytes for i, v in enumerate(views) if i != self.node)
    return views


exchange.Exchange.round_trip = _timed_round_trip  # type: ignore[method-assign]


def reply(doc: dict[str, Any]) -> None:
    print("@@" + json.dumps(doc), flush=True)


def stage(req: dict[str, Any]) -> dict[str, Any]:
    _spent.update(seconds=0.0, received=0)
    start = time.time()
    r = fastload.stage(req["src"], req["dst"], fanout=bool(req["fanout"]))
    end = time.time()
    return {
        "start": start,
        "end": end,
        "files": r.files,
        "bytes": r.bytes,
        "copied_bytes": r.copied_bytes,
        "read_bytes": r.read_bytes,
        "nodes": r.nodes,
        "skipped": r.skipped,
        "exchange_s": _spent["seconds"],
        "received": _spent["received"],
    }


def exchange_only(req: dict[str, Any]) -> dict[str, Any]:
    total, size = int(req["bytes"]), int(req["round"])
    hosts = [socket.gethostname()] * dist.get_world_size()
    # A group of its own, as stage() makes for its leaders: Exchange.close() destroys it.
    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    x = exchange.Exchange(TorchTransport(dist, group, 300.0), hosts, "exchange benchmark", 300.0)
    payload = bytearray(os.urandom(size))
    try:
        x.round_trip(b"")  # every node has built its side before the clock starts
        _spent.update(seconds=0.0, received=0)
        start = time.time()
        sent = 0
        while sent < total:
            x.round_trip(payload)
            sent += size
        end = time.time()
    except BaseException as e:
        x.abort(e)
        x.close(False)
        raise
    x.close(True)
    return {"start": start, "end": end, "sent": sent, "received": _spent["received"]}


def main() -> int:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    reply({"ready": int(os.environ["RANK"])})
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        try:
            doc = stage(req) if req["op"] == "stage" else exchange_only(req)
        except Exception as e:
            doc = {"error": f"{type(e).__name__}: {e}"}
        reply(doc)
    # No destroy_process_group(): its teardown waits seconds for the peers' sockets, and
    # the process ends here anyway.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
