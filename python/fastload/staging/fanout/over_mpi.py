"""The exchange over MPI (mpi4py, optional): for jobs started by an MPI launcher
(``mpiexec``, ``mpirun``, ``srun --mpi=pmi2``), or where ``fanout="mpi"`` asks for it.
The rounds are non-blocking collectives (``Iallgather``, ``Ibcast``) on the leaders'
communicator, tested until they complete while :class:`~.exchange.Exchange` watches the
others; the control plane is a second communicator on which every node sends its state
(heartbeat count, status, sync marks, round) to every other in small non-blocking
messages, each heartbeat and at once when it changes, and reads what has arrived: no
node serves it, and a silent node is one whose messages stopped.

MPI's own reaction to a process that dies is the library's and the launcher's: MPICH's
``mpiexec`` ends the whole job at once (as the tests see; Open MPI's ``mpirun`` does so
by default too): bounded, but with the launcher's message; a node that hangs, or that
fails and says so, is named by the exchange as over torch. A collective that a failed
exchange leaves behind can never complete, and ``MPI_Finalize`` waits for every process,
a hung one too (MPICH's waits on the launcher): after such a failure, a process still in
``MPI_Finalize`` ``FINALIZE_GRACE`` seconds after it began to exit is ended by
``SIGALRM`` (the kernel's alarm: ``MPI_Abort`` cannot be called from Python once the
interpreter is finalising), and the launcher ends the job then, not at its wall time.

Every MPI call here holds one lock, so the heartbeat thread and the main thread never
call MPI at once (``MPI_THREAD_SERIALIZED`` is enough)."""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

TAG = 0x5FA5  # the control plane's messages (on a communicator of their own)
FINALIZE_GRACE = 10.0  # seconds a failed process may take to finalise MPI

_exit_armed = False


def _bound_exit() -> None:
    """After a failed exchange: at exit, an alarm that ends this process if it is still
    there ``FINALIZE_GRACE`` seconds later (stuck in MPI_Finalize)."""
    global _exit_armed
    if _exit_armed:
        return
    _exit_armed = True

    def at_exit() -> None:
        # Runs before mpi4py's MPI_Finalize (a lower-level exit function, after the
        # interpreter stops running Python code: a thread or faulthandler's watchdog
        # would not outlive that). The alarm's default action ends the process.
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(FINALIZE_GRACE))

    atexit.register(at_exit)


class _Request:
    def __init__(self, req: Any, lock: threading.Lock) -> None:
        self._req, self._lock = req, lock

    def done(self) -> bool:
        with self._lock:
            return bool(self._req.Test())

    def wait(self) -> None:
        pass  # Test() raised where it failed


class MpiTransport:
    """The leaders' communicator ``comm`` for :class:`Exchange`."""

    plane: int | None = None
    lingers = True  # what it says travels only while it is there to send it
    max_nap = 0.002  # MPI moves a collective's bytes mostly inside Test()

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._lock = threading.Lock()
        self._data = comm
        self._ctl = comm.Dup()
        self.node = int(comm.Get_rank())
        self.nodes = int(comm.Get_size())
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise RuntimeError(
                "fan-out over MPI needs MPI_THREAD_SERIALIZED or better (its heartbeat is a "
                "thread); mpi4py asks for MPI_THREAD_MULTIPLE unless mpi4py.rc says otherwise"
            )
        self._beats = 0
        self._round = 0
        self._status = ""
        self._marks: set[str] = set()
        self._others = [i for i in range(self.nodes) if i != self.node]
        # What each other node last sent: (heartbeat, round, status, marks).
        self._known: dict[int, tuple[int, int, str, frozenset[str]]] = {
            i: (0, 0, "", frozenset()) for i in self._others
        }
        self._sending: dict[int, Any] = {}

    def all_gather(self, send: memoryview, recv: memoryview) -> _Request:
        with self._lock:
            return _Request(self._data.Iallgather(send, recv), self._lock)

    def broadcast(self, buf: memoryview) -> _Request:
        with self._lock:
            return _Request(self._data.Ibcast(buf, root=0), self._lock)

    # --- the control plane ------------------------------------------------------

    def _push(self) -> None:
        """Sends this node's state to each other node whose last message has gone (a
        node that does not read gets no more than one in flight)."""
        state = (self._beats, self._round, self._status, frozenset(self._marks))
        for i in self._others:
            req = self._sending.get(i)
            try:
                if req is None or req.Test():
                    self._sending[i] = self._ctl.isend(state, dest=i, tag=TAG)
            except self._MPI.Exception:
                pass  # that node is gone: its own messages stop, and it is named for that

    def _drain(self) -> None:
        status = self._MPI.Status()
        while True:
            msg = self._ctl.improbe(self._MPI.ANY_SOURCE, TAG, status)
            if msg is None:
                return
            self._known[status.Get_source()] = msg.recv()

    def start(self, broadcast_object: Callable[[list[Any]], None]) -> None:
        pass  # nothing to set up: every node sends to every node

    def beat(self) -> None:
        with self._lock:
            self._beats += 1
            self._drain()
            self._push()

    def say(self, status: str) -> None:
        with self._lock:
            self._status = status
            self._push()

    def mark(self, name: str) -> None:
        with self._lock:
            self._marks.add(name)
            self._push()

    def missing(self, name: str, nodes: set[int]) -> set[int]:
        with self._lock:
            self._drain()
            self._push()  # a node that just arrived may wait for this node's mark
            return {i for i in nodes if name not in self._known[i][3]}

    def peers(self) -> tuple[dict[int, int], dict[int, str]]:
        with self._lock:
            self._drain()
            beats = {i: k[0] for i, k in self._known.items()}
            beats[self.node] = self._beats
            said = {i: k[2] for i, k in self._known.items() if k[2]}
            return beats, said

    def next_round(self) -> None:
        self._round += 1  # sent with the next heartbeat: only read to name laggards

    def rounds(self) -> dict[int, int]:
        with self._lock:
            self._drain()
            return {i: k[1] for i, k in self._known.items()}

    def close(self, ok: bool) -> None:
        if not ok:
            _bound_exit()
            return  # a peer may be gone: freeing could wait on it
        with self._lock:
            # Every node passed the last round: its heartbeats are stopped. Let the
            # messages in flight land (a bounded wait), read them, then free the
            # communicators (a stale message must not meet a later one).
            deadline = time.monotonic() + 5.0
            barrier = self._ctl.Ibarrier()
            while not barrier.Test() and time.monotonic() < deadline:
                time.sleep(0.001)
            for req in self._sending.values():
                with contextlib.suppress(self._MPI.Exception):
                    req.Test()
            self._drain()
            self._ctl.Free()
            self._data.Free()


class MpiWorld:
    """Every process of the job, over the communicator ``comm`` (default: the world)."""

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self.size = int(self._comm.Get_size())
        self.rank = int(self._comm.Get_rank())

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self._comm.allgather(obj))

    def barrier(self) -> None:
        self._comm.Barrier()

    def leaders(self, order: list[int], member: bool) -> MpiTransport | None:
        """The communicator of the ranks ``order`` (a collective: every process calls
        it); its transport where this process is a ``member``."""
        sub = self._comm.Split(0 if member else self._MPI.UNDEFINED, self.rank)
        return MpiTransport(sub) if member else None

    def close(self) -> None:
        pass
