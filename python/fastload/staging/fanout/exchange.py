"""The exchange of fan-out staging: the node leaders of a job, one process per node, in
rounds where each contributes one buffer and receives everyone's (an all_gather).

The protocol lives here, once; a transport (:class:`Transport`) carries it:
over_torch.py (a gloo group of torch.distributed, its heartbeat in a TCPStore: TCP, no
MPI, no GPU needed) or over_mpi.py (mpi4py's non-blocking collectives on a communicator
the MPI launcher made, the heartbeat in point-to-point messages).

Every leader keeps a heartbeat and a status on the transport's control plane. While a
leader waits (in a round, or at a :meth:`Exchange.sync` point before one, while others
list, plan or set up), it watches them: a node that reports a failure (a full disk, a
corrupt archive) stops the others at once with that node's message; a node whose
heartbeat stops for the timeout (its process died or hangs) is named; a round's
connection that breaks is explained the same way. Work of unequal length (listing,
planning) happens before a sync, never inside a collective, and a collective is started
without blocking and watched until it completes, so no process waits longer than the
round timeout on a peer that is gone.

torch and mpi4py are imported by their transports, lazily, only when a stage is fanned
out across nodes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ...errors import StageError

OK, DONE = 0, 1

HEARTBEAT_EVERY = 0.5  # seconds between a leader's heartbeats
WATCH_EVERY = 0.25  # seconds between looks at the others while waiting
LINGER = 10.0  # seconds a node that must linger waits, after a failure, for the others
# Seconds a node may go without a heartbeat, or a round wait for the slowest node,
# before the others stop (FASTLOAD_FANOUT_TIMEOUT).
DEFAULT_TIMEOUT = 300.0

HEADER = struct.Struct("<qq")  # a round's header: status, payload bytes


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


class Pending(Protocol):
    """A collective started without blocking."""

    def done(self) -> bool:
        """Whether it completed; may raise where a connection broke."""

    def wait(self) -> None:
        """After :meth:`done` said True: raises where it failed."""


class Transport(Protocol):
    """What :class:`Exchange` needs of a group of ``nodes`` leaders (this one is
    ``node``): two non-blocking collectives over bytes, and a control plane (a
    heartbeat, a status, sync marks and round counts per node) that every node can read
    without the others' help. Control-plane calls may raise where it is gone."""

    node: int
    nodes: int
    plane: int | None
    """The node that serves the control plane (its loss is named), or None."""
    lingers: bool
    """After :meth:`Exchange.abort`, stay until the others have heard (the control plane
    needs this process to carry the news)."""
    max_nap: float
    """Longest sleep between looks at a collective (MPI progresses it only in a look)."""

    def all_gather(self, send: memoryview, recv: memoryview) -> Pending:
        """``send`` (n bytes) of every node into ``recv`` (nodes * n bytes), in node order."""

    def broadcast(self, buf: memoryview) -> Pending:
        """``buf`` of node 0 into every node's ``buf``."""

    def start(self, broadcast_object: Callable[[list[Any]], None]) -> None:
        """Brings the control plane up (``broadcast_object`` sends its address)."""

    def beat(self) -> None:
        """One heartbeat (from the heartbeat thread)."""

    def say(self, status: str) -> None: ...

    def mark(self, name: str) -> None:
        """This node reached sync point ``name``."""

    def missing(self, name: str, nodes: set[int]) -> set[int]:
        """Those of ``nodes`` that have not reached ``name``."""

    def peers(self) -> tuple[dict[int, int], dict[int, str]]:
        """Every node's heartbeat count, and the others' statuses."""

    def next_round(self) -> None: ...

    def rounds(self) -> dict[int, int]:
        """The others' round counts."""

    def close(self, ok: bool) -> None:
        """Stops the control plane; releases the group where ``ok``."""


class Exchange:
    """The leaders' group over ``transport``; ``hosts`` are the leaders' host names,
    ``what`` (the source) is named in errors."""

    def __init__(self, transport: Transport, hosts: Sequence[str], what: str, timeout: float):
        self._t = transport
        self.node = transport.node
        self.nodes = transport.nodes
        self.hosts = list(hosts)
        self.what = what
        self.timeout = timeout
        # A node whose heartbeat stands still this long counts as gone (before a round
        # times out, so that it is the one named).
        self.silence = max(3.0, timeout / 2)
        self.round = 0
        self._failed = False
        self._up = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats: dict[int, tuple[int, float]] = {}  # node -> last count, when it moved
        self._sets: list[bytearray] = [bytearray(), bytearray()]  # receive buffers, in turn
        self._scratch = bytearray()
        transport.start(self.broadcast_object)
        self._up = True
        transport.beat()
        self._thread = threading.Thread(target=self._heartbeat, name="fastload-hb", daemon=True)
        self._thread.start()

    # --- the heartbeat --------------------------------------------------------

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_EVERY):
            try:
                self._t.beat()
            except Exception:
                return  # the control plane is gone: the next round finds out

    def _say(self, status: str) -> None:
        with contextlib.suppress(Exception):
            self._t.say(status)

    def _watch(self, waiting_for: set[int], started: float) -> None:
        """Raises if a node failed, or one of ``waiting_for``, or its heartbeat stood
        still for the timeout."""
        if not self._up:
            return  # the control plane is not up yet (its address is being sent)
        try:
            beats, said = self._t.peers()
        except Exception as e:
            raise self._plane_lost(e) from None
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

    def _plane_lost(self, cause: BaseException) -> FanoutError:
        self._failed = True
        detail = f" ({str(cause).splitlines()[0][:200] if str(cause) else type(cause).__name__})"
        plane = self._t.plane
        if plane is not None and self.node != plane:
            return self._error(
                [plane], "stopped answering (its process died, or its host is unreachable; "
                "it also served the exchange's heartbeat)", detail,
            )  # fmt: skip
        return self._error([], "lost its peers", detail)

    def _diagnose(self, cause: BaseException) -> FanoutError:
        """A round's connection broke: which node stopped answering (its heartbeat, read
        twice a few beats apart, and what it reported)."""
        self._failed = True
        detail = f" ({str(cause).splitlines()[0][:300] if str(cause) else type(cause).__name__})"
        try:
            first, _ = self._t.peers()
            time.sleep(4 * HEARTBEAT_EVERY)
            second, said = self._t.peers()
        except Exception as e:
            return self._plane_lost(e)
        if (err := self._reported(said)) is not None:
            return err
        dead = [
            i
            for i in range(self.nodes)
            if i != self.node and second.get(i) == first.get(i) and said.get(i) != "done"
        ]
        if dead:
            return self._error(dead, "stopped answering (its process died or hangs)", detail)
        return self._error([], "lost its peers", detail)

    def _laggards(self) -> list[int]:
        try:
            rounds = self._t.rounds()
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

    def _wait(self, work: Pending) -> None:
        """Waits for a collective, watching the others meanwhile."""
        started = time.monotonic()
        nap, next_watch = 0.0002, started + WATCH_EVERY
        try:
            while not work.done():
                time.sleep(nap)
                nap = min(nap * 2, self._t.max_nap)
                now = time.monotonic()
                if now >= next_watch:
                    next_watch = now + WATCH_EVERY
                    self._watch(set(range(self.nodes)) - {self.node}, started)
                    if now - started > self.timeout:
                        behind = self._laggards()
                        self._failed = True
                        raise self._error(
                            behind,
                            f"did not reach round {self.round} within {self.timeout:g} s",
                            "",
                        )
            work.wait()
        except FanoutError:
            raise
        except Exception as e:
            raise self._diagnose(e) from None

    def sync(self, name: str) -> None:
        """Waits until every node has reached this point, however long their work before
        it takes, as long as they are alive (see :meth:`_watch`)."""
        if self.nodes == 1:
            return
        started = time.monotonic()
        try:
            self._t.mark(name)
        except Exception as e:
            raise self._plane_lost(e) from None
        missing = set(range(self.nodes)) - {self.node}
        nap, next_watch = 0.0005, started + WATCH_EVERY
        while True:
            try:
                missing = self._t.missing(name, missing)
            except Exception as e:
                raise self._plane_lost(e) from None
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
        data = pickle.dumps(objs, protocol=pickle.HIGHEST_PROTOCOL) if self.node == 0 else b""
        size = bytearray(HEADER.pack(OK, len(data)))
        self._wait(self._t.broadcast(memoryview(size)))
        buf = bytearray(data) if self.node == 0 else bytearray(HEADER.unpack(size)[1])
        if buf:
            self._wait(self._t.broadcast(memoryview(buf)))
        if self.node != 0:
            objs[:] = pickle.loads(buf)

    def all_gather_object(self, obj: Any) -> list[Any]:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return [pickle.loads(bytes(b)) for b in self.round_trip(data)]

    def round_trip(self, payload: Any, status: int = OK) -> list[memoryview]:
        """One round: sends ``payload`` (a bytes-like object), returns every node's, in
        node order. Raises :class:`FanoutError` if a node aborts or stops answering."""
        mine = memoryview(payload).cast("B")
        n = mine.nbytes
        header = bytearray(HEADER.pack(status, n))
        headers = bytearray(HEADER.size * self.nodes)
        self.round += 1
        with contextlib.suppress(Exception):
            self._t.next_round()
        self._wait(self._t.all_gather(memoryview(header), memoryview(headers)))
        lens = [HEADER.unpack_from(headers, i * HEADER.size)[1] for i in range(self.nodes)]
        longest = max(lens)
        if longest == 0:
            return [memoryview(b"") for _ in lens]
        out = self._received(longest)
        if n != longest or mine.readonly:
            # Shorter than the longest (all_gather wants equal sizes), or read-only:
            # padded in a buffer kept from round to round; the padding is never read.
            if len(self._scratch) < longest:
                self._scratch = bytearray(longest)
            send = memoryview(self._scratch)[:longest]
            send[:n] = mine
            mine = send
        self._wait(self._t.all_gather(mine, out))
        return [out[i * longest : i * longest + k] for i, k in enumerate(lens)]

    def _received(self, n: int) -> memoryview:
        """Where a round's buffers land: two buffers, used in turn and kept (replaced
        by a bigger one as needed), so a round's views stay valid while the next round
        runs (the caller is done with a round's views before the one after next)."""
        k = self.round % 2
        if len(self._sets[k]) < n * self.nodes:
            self._sets[k] = bytearray(n * self.nodes)
        return memoryview(self._sets[k])[: n * self.nodes]

    def abort(self, error: BaseException) -> None:
        """Tells the others that this node failed (or what it saw fail): they stop
        within a moment, wherever they wait, with that message. A node that must linger
        (see :attr:`Transport.lingers`) stays until the others have read it (a few
        seconds at most)."""
        self._failed = True
        text = str(error) or type(error).__name__
        self._say(f"relay: {text}" if isinstance(error, FanoutError) else f"failed: {text}")
        if not self._t.lingers:
            return
        deadline = time.monotonic() + LINGER
        while time.monotonic() < deadline:
            try:
                beats, said = self._t.peers()
            except Exception:
                return
            now = time.monotonic()
            for i, n in beats.items():
                if self._beats.get(i, (None, 0.0))[0] != n:
                    self._beats[i] = (n, now)
            waiting = [
                i for i in range(self.nodes)
                if i != self.node and i not in said
                and now - self._beats.get(i, (0, now))[1] < 3.0
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
        fine = ok and not self._failed
        if fine:
            # Node 0 may serve the control plane: it leaves last, when everyone said it
            # is done.
            with contextlib.suppress(Exception):
                self.round_trip(b"", DONE)
        with contextlib.suppress(Exception):
            self._t.close(fine)
