"""The exchange of fan-out staging: the node leaders of a job, one process per node, in
rounds where each contributes one buffer and receives everyone's (an all_gather over a
gloo group of torch.distributed: TCP, no MPI, no GPU needed).

Every leader keeps a heartbeat and a status in a small key-value store (torch's
TCPStore, served by node 0). While a leader waits (in a round, or at a :meth:`sync`
point before one, while others list, plan or set up), it watches them: a node that
reports a failure (a full disk, a corrupt archive) stops the others at once with that
node's message; a node whose heartbeat stops for the timeout (its process died or
hangs) is named; a round's connection that breaks is explained the same way. Work of
unequal length (listing, planning) happens before a :meth:`sync`, never inside a
collective, so the gloo group's own timeout is the round timeout: a process never waits
longer than that on a peer that is gone, not even at exit.

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

from ...errors import StageError

OK, DONE = 0, 1

HEARTBEAT_EVERY = 0.5  # seconds between a leader's heartbeats
WATCH_EVERY = 0.25  # seconds between looks at the others while waiting
LINGER = 10.0  # seconds node 0 waits, after a failure, for the others to hear of it
# Seconds a node may go without a heartbeat, or a round wait for the slowest node,
# before the others stop (FASTLOAD_FANOUT_TIMEOUT).
DEFAULT_TIMEOUT = 300.0


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
        # A node whose heartbeat stands still this long counts as gone (before a round
        # times out, so that it is the one named).
        self.silence = max(3.0, timeout / 2)
        self.round = 0
        self._failed = False
        self._store: Any = None
        self._beat: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats: dict[int, tuple[int, float]] = {}  # node -> last count, when it moved
        self._sets: list[list[Any]] = [[], []]  # the rounds' receive buffers, in turn
        self._scratch: Any = None
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

    def _peers(self) -> tuple[dict[int, int], dict[int, str]]:
        """The others' heartbeat counts and statuses (raises where node 0 is gone)."""
        beats = {i: int(self._store.add(f"hb/{i}", 0)) for i in range(self.nodes)}
        said = {}
        for i in range(self.nodes):
            if i != self.node and self._store.check([f"st/{i}"]):
                said[i] = self._store.get(f"st/{i}").decode("utf-8", "replace")
        return beats, said

    def _watch(self, waiting_for: set[int], started: float) -> None:
        """Raises if a node failed, or one of ``waiting_for``, or its heartbeat stood
        still for the timeout."""
        if self._store is None:
            return  # the store is not up yet (its address is being sent)
        try:
            beats, said = self._peers()
        except Exception as e:
            raise self._store_lost(e) from None
        now = time.monotonic()
        if (err := self._reported(said)) is not None:
            raise err
        for i, n in beats.items():
            if self._beats.get(i, (None, 0.0))[0] != n:
                self._beats[i] = (n, now)
        stale = [
            i for i in sorted(waiting_for)
            if now - max(self._beats.get(i, (0, started))[1], started) > self.silence
        ]  # fmt: skip
        if stale:
            self._failed = True
            raise self._error(stale, "stopped answering (its process died or hangs)", "")

    def _reported(self, said: dict[int, str]) -> FanoutError | None:
        """The error a node reported: its own failure first, else one it saw."""
        for i, text in said.items():
            if text.startswith("failed:"):
                return self._failed_on(i, text)
        for text in said.values():
            if text.startswith("relay:"):
                self._failed = True
                return fanout_error(text[len("relay:") :].strip(), self.what)
        return None

    def _failed_on(self, i: int, text: str) -> FanoutError:
        self._failed = True
        return fanout_error(
            f"fan-out staging of '{self.what}' failed on node {i} ({self.hosts[i]}): "
            f"{text[len('failed:') :].strip()}",
            self.what,
        )

    def _store_lost(self, cause: BaseException) -> FanoutError:
        self._failed = True
        detail = f" ({str(cause).splitlines()[0][:200]})"
        if self.node != 0:
            return self._error(
                [0], "stopped answering (its process died, or its host is unreachable; "
                "it also served the exchange's heartbeat)", detail,
            )  # fmt: skip
        return self._error([], "lost its peers", detail)

    def _diagnose(self, cause: BaseException) -> FanoutError:
        """A round's connection broke: which node stopped answering (its heartbeat, read
        twice a few beats apart, and what it reported)."""
        self._failed = True
        detail = f" ({str(cause).splitlines()[0][:300]})"
        try:
            first, _ = self._peers()
            time.sleep(4 * HEARTBEAT_EVERY)
            second, said = self._peers()
        except Exception as e:
            return self._store_lost(e)
        if (err := self._reported(said)) is not None:
            return err
        dead = [
            i
            for i in range(self.nodes)
            if i != self.node and second[i] == first[i] and said.get(i) != "done"
        ]
        if dead:
            return self._error(dead, "stopped answering (its process died or hangs)", detail)
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
        """Waits for a collective, watching the others meanwhile."""
        started = time.monotonic()
        nap, next_watch = 0.0002, started + WATCH_EVERY
        while not work.is_completed():
            time.sleep(nap)
            nap = min(nap * 2, 0.02)
            now = time.monotonic()
            if now >= next_watch:
                next_watch = now + WATCH_EVERY
                self._watch(set(range(self.nodes)) - {self.node}, started)
                if now - started > self.timeout:
                    behind = self._laggards()
                    self._failed = True
                    raise self._error(
                        behind, f"did not reach round {self.round} within {self.timeout:g} s", ""
                    )
        try:
            work.wait()
        except Exception as e:
            raise self._diagnose(e) from None

    def sync(self, name: str) -> None:
        """Waits until every node has reached this point, however long their work before
        it takes, as long as they are alive (see :meth:`_watch`)."""
        if self.nodes == 1:
            return
        started = time.monotonic()
        try:
            self._store.set(f"sync/{name}/{self.node}", "1")
        except Exception as e:
            raise self._store_lost(e) from None
        missing = set(range(self.nodes)) - {self.node}
        nap, next_watch = 0.0005, started + WATCH_EVERY
        while True:
            try:
                missing = {i for i in missing if not self._store.check([f"sync/{name}/{i}"])}
            except Exception as e:
                raise self._store_lost(e) from None
            if not missing:
                return
            now = time.monotonic()
            if now >= next_watch:
                next_watch = now + WATCH_EVERY
                self._watch(missing, started)
            time.sleep(nap)  # short naps first: the others are usually about to arrive
            nap = min(nap * 2, WATCH_EVERY)

    def broadcast_object(self, objs: list[Any]) -> None:
        """``objs`` from node 0 to every node, in place."""
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
        self._wait(self._dist.broadcast(t, group_src=0, group=self._group, async_op=True))

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
            self._store.add(f"rd/{self.node}", 1)
        self._wait(self._dist.all_gather(headers, header, group=self._group, async_op=True))
        lens = [int(h[1]) for h in headers]
        longest = max(lens)
        if longest == 0:
            return [memoryview(b"") for _ in lens]
        out = self._received(longest)
        if n == longest and not memoryview(payload).readonly:
            mine = torch.frombuffer(payload, dtype=torch.uint8)  # sent as it is
        else:
            # Shorter than the longest (all_gather wants equal sizes): padded in a
            # buffer kept from round to round; the padding is never read.
            if self._scratch is None or self._scratch.numel() < longest:
                self._scratch = torch.empty(longest, dtype=torch.uint8)
            mine = self._scratch[:longest]
            if n:
                mine[:n] = (
                    torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                    if memoryview(payload).readonly
                    else torch.frombuffer(payload, dtype=torch.uint8)
                )
        self._wait(self._dist.all_gather(out, mine, group=self._group, async_op=True))
        return [memoryview(o.numpy())[:k] for o, k in zip(out, lens, strict=True)]

    def _received(self, n: int) -> list[Any]:
        """Where a round's buffers land: two sets, used in turn and kept (growing as
        needed), so a round's views stay valid while the next round runs (the caller
        is done with a round's views before the one after next)."""
        k = self.round % 2
        have = self._sets[k]
        if not have or have[0].numel() < n:
            have = [self._torch.empty(n, dtype=self._torch.uint8) for _ in range(self.nodes)]
            self._sets[k] = have
        return [t[:n] for t in have]

    def abort(self, error: BaseException) -> None:
        """Tells the others that this node failed (or what it saw fail): they stop
        within a moment, wherever they wait, with that message. Node 0, which serves the
        store, stays until the others have read it (a few seconds at most)."""
        self._failed = True
        text = str(error) or type(error).__name__
        self._say(f"relay: {text}" if isinstance(error, FanoutError) else f"failed: {text}")
        if self.node != 0:
            return
        deadline = time.monotonic() + LINGER
        while time.monotonic() < deadline:
            try:
                beats, said = self._peers()
            except Exception:
                return
            now = time.monotonic()
            for i, n in beats.items():
                if self._beats.get(i, (None, 0.0))[0] != n:
                    self._beats[i] = (n, now)
            waiting = [
                i for i in range(1, self.nodes)
                if i not in said and now - self._beats.get(i, (0, now))[1] < 3.0
            ]  # fmt: skip
            if not waiting:
                return
            time.sleep(WATCH_EVERY)

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
        with contextlib.suppress(Exception):
            if ok and not self._failed:
                self._dist.destroy_process_group(self._group)
