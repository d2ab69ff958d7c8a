"""The exchange of fan-out staging: the node leaders of a job, one process per node, in
rounds where each contributes one buffer and receives everyone's (an all_gather over a
gloo group of torch.distributed: TCP, no MPI, no GPU needed).

A round is two collectives: a header (status and length of each node's buffer), then the
buffers padded to the longest. A node that fails on its own (a full disk, a corrupt
archive) sends its error as its buffer with an ``ABORT`` status, so the others stop at the
same round with that node's message. A node that dies, or hangs, cannot say so: the
others' collective fails (the connection closes) or times out, and then a heartbeat that
every leader keeps in a small key-value store (torch's TCPStore, served by node 0) names
it: its count stopped moving, or it reports that it finished or failed.

torch is imported here, lazily, only when a stage is fanned out across nodes.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..errors import StageError

OK, DONE, ABORT = 0, 1, 2

HEARTBEAT_EVERY = 0.5  # seconds between a leader's heartbeats
DEFAULT_TIMEOUT = 300.0  # seconds a round may wait for the slowest node


class FanoutError(StageError):
    """A fanned-out stage failed on another node, or a node stopped answering. Names the
    node; the destination stays resumable."""


def timeout_from_env() -> float:
    text = os.environ.get("FASTLOAD_FANOUT_TIMEOUT", "")
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"FASTLOAD_FANOUT_TIMEOUT={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"FASTLOAD_FANOUT_TIMEOUT={text!r} must be positive")
    return value


def fanout_error(msg: str, path: str) -> FanoutError:
    e = FanoutError(errno.EHOSTDOWN, msg)
    e.filename = path
    return e


class Exchange:
    """The leaders' group: ``node`` is this leader's number among ``nodes`` leaders,
    ``hosts`` their host names. ``what`` (the source) is named in errors."""

    def __init__(
        self, dist: Any, group: Any, hosts: Sequence[str], what: str, timeout: float
    ) -> None:
        import torch

        self._torch, self._dist, self._group = torch, dist, group
        self.node = dist.get_rank(group)
        self.nodes = dist.get_world_size(group)
        self.hosts = list(hosts)
        self.what = what
        self.timeout = timeout
        self.round = 0
        self._failed = False
        self._store: Any = None
        self._beat: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_heartbeat()

    # --- the heartbeat --------------------------------------------------------

    def _start_heartbeat(self) -> None:
        dist = self._dist
        store_timeout = datetime.timedelta(seconds=max(5.0, min(self.timeout, 30.0)))
        if self.node == 0:
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            self._store = dist.TCPStore(
                host, 0, None, True, timeout=store_timeout, wait_for_workers=False
            )
            where: list[Any] = [(host, self._store.port)]
        else:
            where = [None]
        self.broadcast_object(where)
        host, port = where[0]
        if self.node != 0:
            self._store = dist.TCPStore(host, port, None, False, timeout=store_timeout)
        # The heartbeat thread talks to the store over a connection of its own.
        self._beat = dist.TCPStore(host, port, None, False, timeout=store_timeout)
        self._beat.add(f"hb/{self.node}", 1)
        self._thread = threading.Thread(target=self._heartbeat, name="fastload-hb", daemon=True)
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY):
            try:
                self._beat.add(f"hb/{self.node}", 1)
            except Exception:
                return  # node 0 (the store) is gone: the next round finds out

    def _say(self, status: str) -> None:
        with contextlib.suppress(Exception):
            self._store.set(f"st/{self.node}", status)

    def _diagnose(self, cause: BaseException | None) -> FanoutError:
        """Which node stopped answering: the heartbeat counts of the others, read twice
        a few beats apart, and what each reported."""
        detail = f" ({str(cause).splitlines()[0][:300]})" if cause is not None else ""
        try:
            first = {i: self._store.add(f"hb/{i}", 0) for i in range(self.nodes)}
            time.sleep(4 * HEARTBEAT_EVERY)
            second = {i: self._store.add(f"hb/{i}", 0) for i in range(self.nodes)}
            said = {}
            for i in range(self.nodes):
                if self._store.check([f"st/{i}"]):
                    said[i] = self._store.get(f"st/{i}").decode("utf-8", "replace")
        except Exception:
            if self.node != 0:
                return self._error(
                    [0], "stopped answering (its process died, or its host is unreachable; "
                    "it also served the exchange's heartbeat)", detail,
                )  # fmt: skip
            return self._error([], "lost its peers", detail)
        for i, text in said.items():
            if i != self.node and text.startswith("failed:"):
                return fanout_error(
                    f"fan-out staging of '{self.what}' failed on node {i} "
                    f"({self.hosts[i]}): {text[len('failed:') :].strip()}",
                    self.what,
                )
        dead = [
            i
            for i in range(self.nodes)
            if i != self.node and second[i] == first[i] and said.get(i) != "done"
        ]
        if dead:
            return self._error(dead, "stopped answering (its process died or hangs)", detail)
        behind = self._laggards()
        if behind:
            return self._error(
                behind, f"did not reach round {self.round} within {self.timeout:g} s", detail
            )
        return self._error([], "lost its peers", detail)

    def _laggards(self) -> list[int]:
        try:
            rounds = {
                i: int(self._store.add(f"rd/{i}", 0)) for i in range(self.nodes) if i != self.node
            }
        except Exception:
            return []
        low = min(rounds.values(), default=self.round)
        return [i for i, r in rounds.items() if r == low and r < self.round]

    def _error(self, nodes: list[int], what: str, detail: str) -> FanoutError:
        if nodes:
            who = ", ".join(f"node {i} ({self.hosts[i]})" for i in nodes)
            head = f"fan-out staging of '{self.what}' stopped: {who} {what}"
        else:
            head = f"fan-out staging of '{self.what}' stopped: node {self.node} {what}"
        return fanout_error(
            f"{head}{detail}; every node keeps what it finished: stage again to resume",
            self.what,
        )

    # --- collectives ----------------------------------------------------------

    def _wait(self, work: Any) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            self._failed = True
            raise self._diagnose(e) from None

    def broadcast_object(self, objs: list[Any]) -> None:
        """``objs`` from node 0 to every node, in place (long waits allowed: node 0 may
        be listing a large tree meanwhile)."""
        if self.nodes == 1:
            return
        torch = self._torch
        if self.node == 0:
            data = pickle.dumps(objs, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._collective_broadcast(size)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.node == 0
            else torch.empty(int(size[0]), dtype=torch.uint8)
        )
        self._collective_broadcast(buf)
        if self.node != 0:
            objs[:] = pickle.loads(buf.numpy().tobytes())

    def _collective_broadcast(self, t: Any) -> None:
        try:
            work = self._dist.broadcast(t, group_src=0, group=self._group, async_op=True)
            # Listing a large tree on node 0 can take long: waits here are not bounded by
            # the round timeout, only by the group's own.
            work.wait()
        except Exception as e:
            self._failed = True
            raise self._diagnose(e) from None

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return [pickle.loads(bytes(b)) for b in self.round_trip(data)]

    def round_trip(self, payload: Any, status: int = OK) -> list[memoryview]:
        """One round: sends ``payload`` (a bytes-like object), returns every node's, in
        node order. Raises :class:`FanoutError` if a node aborts or stops answering."""
        torch = self._torch
        n = memoryview(payload).nbytes
        header = torch.tensor([status, n], dtype=torch.int64)
        headers = [torch.empty(2, dtype=torch.int64) for _ in range(self.nodes)]
        self.round += 1
        with contextlib.suppress(Exception):
            self._store.set(f"rd/{self.node}", str(self.round))
        self._wait(self._dist.all_gather(headers, header, group=self._group, async_op=True))
        lens = [int(h[1]) for h in headers]
        longest = max(lens)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.nodes)]
        mine = torch.zeros(longest, dtype=torch.uint8)
        if n:
            if memoryview(payload).readonly:
                payload = bytearray(payload)  # torch wants a writable buffer
            mine[:n] = torch.frombuffer(payload, dtype=torch.uint8)
        self._wait(self._dist.all_gather(out, mine, group=self._group, async_op=True))
        views = [memoryview(o.numpy())[:k] for o, k in zip(out, lens, strict=True)]
        for i, h in enumerate(headers):
            if int(h[0]) == ABORT and i != self.node:
                self._failed = True
                raise fanout_error(
                    f"fan-out staging of '{self.what}' failed on node {i} ({self.hosts[i]}): "
                    f"{bytes(views[i]).decode('utf-8', 'replace')}",
                    self.what,
                )
        return views

    def abort(self, error: BaseException) -> None:
        """Tells the others that this node failed (best effort: they may be gone)."""
        text = str(error) or type(error).__name__
        self._say(f"failed: {text}")
        if self._failed:
            return
        self._failed = True
        with contextlib.suppress(Exception):
            self.round_trip(text.encode("utf-8", "replace")[:4096], ABORT)

    def close(self, ok: bool) -> None:
        if ok:
            self._say("done")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * HEARTBEAT_EVERY)
        if ok and not self._failed:
            # Node 0 serves the store: it leaves last, when everyone said it is done.
            with contextlib.suppress(Exception):
                self.round_trip(b"", DONE)
