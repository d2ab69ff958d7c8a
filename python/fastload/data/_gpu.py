"""The CUDA side of the packed batches' hand-off (used by :mod:`._shm`): a worker block
the main process maps is page-locked in place (``cudaHostRegister``), and goes back to
its worker only after every copy issued from it has completed, whatever issued it.

Every CUDA call made here goes through one object, :data:`CUDA` (a :class:`Cuda`):
registration and its undoing, the error state, the device guard, the current stream,
events. Tests without a GPU put a recording stand-in there; torch stays real.

Registration (:func:`register`): once per mapping, on the device the batch goes to
(that device current meanwhile, the one current before restored without creating a
context on it). Off the loop's path: once this process has asked for a registration,
each block it maps from then on is registered on the registrar thread
(:data:`REGISTRAR`) as soon as it is mapped; a copy (``copy_to``, ``to_device``) never
waits for one: a block not registered yet is copied as an unregistered one is (torch's
copy from pageable memory, which has read the source when it returns). ``pin()``
(``pin_memory``, in DataLoader's pin thread) waits for the block's registration, as
page-locked memory is what it returns. A failure is remembered (never retried for that
mapping), warned about once per process, counted (:data:`COUNTERS`, in
``fastload.monitor``'s ``gpu/...``), and the registering thread's CUDA error is cleared
so its next kernel launch does not report it; the block is then copied through torch's
pinned buffers. A mapping is held (below) from the moment its registration is asked
for, so a copy the driver finds registered is covered even if the registration
completed while the copy was being issued.

The hold: a registered mapping is *held* (``ShmView.held``): a lease on it that is
destroyed, by whatever dropped the last tensor over it (a batch, a view, a tensor
torch copied from), does not give its count back but retires it (cpp/shm/block.hpp).
:func:`poll` takes the retired counts, records an event on every stream in use and
gives the counts back when the events have completed (:class:`Fences`). The streams in
use: the current stream of each device a block was registered for, as seen by the
thread that polls and by each thread that takes a field of a batch
(``PackedBatch.__getitem__``), ``to_device``'s streams, and the one current when
``copy_to`` (``batch.to``) ran. A copy issued on a stream never seen at one of these
points is not covered (keep its source alive until that stream has passed it).

Letting go of a mapping (:func:`unregister_later`): an event is recorded on the streams
in use, and the mapping is unregistered (and only then unmapped) once it has completed
and no lease is left on the block, polled, not waited for; the unregistration itself
runs on the registrar thread. A failed ``cudaHostUnregister`` leaves the mapping
registered and mapped for good (kept in ``STATE.stuck``), warned about and counted.

Nothing here runs in a process forked from the one that registered: a forked child
forgets the parent's fences and mappings (its copies of the leases give nothing back:
cpp/shm/block.hpp).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from .. import _core

_cu: Any = torch.cuda  # its constructors are untyped; used only where CUDA is available
_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device's context

#: A stream as torch names it: (device index, stream id, device type).
StreamKey = tuple[int, int, int]


class Event(Protocol):
    """What a fence waits on (``torch.cuda.Event``, or a stand-in in tests)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _AllOf:
    """Several events as one: done when all are."""

    __slots__ = ("events",)

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


class Cuda:
    """The CUDA calls of the hand-off, all in one place (a test replaces :data:`CUDA`
    with a recording stand-in that has these methods)."""

    def available(self) -> bool:
        return bool(torch.cuda.is_available())

    def current_device(self) -> int:
        return int(torch.cuda.current_device())

    def device(self, index: int) -> contextlib.AbstractContextManager[Any]:
        """``index`` current inside; the device current before is restored after without
        creating a context on it (torch's own guard)."""
        return _cu.device(index)  # type: ignore[no-any-return]

    def host_register(self, base: int, length: int) -> int:
        """``cudaHostRegister`` on the current device; its error code."""
        return _rc(_cu.cudart().cudaHostRegister(base, length, _PORTABLE))

    def host_unregister(self, base: int) -> int:
        return _rc(_cu.cudart().cudaHostUnregister(base))

    def clear_error(self) -> int:
        """This thread's last CUDA error, read and reset (``cudaGetLastError``: torch
        checks it after each kernel launch, so a failure handled here would be reported
        by the next launch); -1 where the runtime torch uses could not be found."""
        lib = _cudart()
        return -1 if lib is None else int(lib.cudaGetLastError())

    def error_name(self, rc: int) -> str:
        lib = _cudart()
        if lib is None:
            return f"cudaError {rc}"
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        name = lib.cudaGetErrorName(rc)
        return f"{name.decode() if name else 'cudaError'} ({rc})"

    def current_stream(self, device: int) -> StreamKey:
        sid, dev, typ = torch._C._cuda_getCurrentStream(device)
        return int(dev), int(sid), int(typ)

    def stream_key(self, stream: Any) -> StreamKey:
        return int(stream.device_index), int(stream.stream_id), int(stream.device_type)

    def record(self, streams: Iterable[StreamKey]) -> Event:
        """An event recorded now on each of ``streams``, as one."""
        events = []
        for dev, sid, typ in streams:
            ev = _cu.Event()
            ev.record(_cu.Stream(stream_id=sid, device_index=dev, device_type=typ))
            events.append(ev)
        return _AllOf(events)


def _rc(res: Any) -> int:
    return int(getattr(res, "value", res))


_lib: Any = False  # not looked for yet


def _cudart() -> Any:
    """The CUDA runtime library torch loaded (ctypes), or None: found among this
    process's mappings, the plainly named one first (torchvision bundles its own copy
    under a hashed name)."""
    global _lib
    if _lib is False:
        _lib = None
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
                paths = {ln.split(None, 5)[5].strip() for ln in f
                         if "libcudart" in ln and len(ln.split(None, 5)) == 6}
        except OSError:
            paths = set()
        for p in sorted(paths, key=lambda p: ("-" in os.path.basename(p), p)):
            try:
                _lib = ctypes.CDLL(p, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
                break
            except OSError:
                continue
    return _lib


#: The CUDA calls made here (a test's stand-in replaces it).
CUDA: Any = Cuda()


@dataclasses.dataclass
class Counters:
    """What registration cost in this process (``fastload.monitor``: ``gpu/...``)."""

    registered: int = 0  # mappings page-locked
    register_failed: int = 0  # attempts that failed (each mapping tried once)
    register_ms: float = 0.0  # in cudaHostRegister, any thread
    registered_behind: int = 0  # of the registrations, those the registrar thread made
    register_main_ms: float = 0.0  # the main thread registering or waiting for one
    pending_copies: int = 0  # tensors copied from a block not registered yet (unpinned)
    unregistered: int = 0
    unregister_failed: int = 0  # those mappings stay registered and mapped
    unregister_ms: float = 0.0  # in cudaHostUnregister (the registrar thread)
    unregister_main_ms: float = 0.0  # of which on the main thread (none: the registrar)
    retired: int = 0  # lease counts held back for copies, then given back
    fence_waits: int = 0  # waits for a copy because too many were pending

    def snapshot(self) -> dict[str, float]:
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}


COUNTERS = Counters()


# --- fences ----------------------------------------------------------------------------


MAX_PENDING = 64


class Fences:
    """Objects (retired lease counts, source tensors) kept alive until an event recorded
    after the copies that may read them has completed. Each is let go of as soon as its
    own event has completed, whatever the order."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._pending: deque[tuple[Event, Any]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pending)

    def hold(self, event: Event, keep: Any) -> None:
        with self._lock:
            self._pending.append((event, keep))
            while len(self._pending) > self.max_pending:
                ev, _ = self._pending.popleft()
                COUNTERS.fence_waits += 1
                ev.synchronize()
        self.poll()

    def poll(self) -> int:
        """Lets go of what completed copies kept; returns how many are still pending."""
        with self._lock:
            if self._pending:
                self._pending = deque(p for p in self._pending if not p[0].query())
            return len(self._pending)

    def drain(self) -> None:
        """Waits for every pending copy, then lets go of what they kept."""
        with self._lock:
            while self._pending:
                ev, _ = self._pending.popleft()
                ev.synchronize()


FENCES = Fences()


# --- state of this process ----------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.active = False  # a block is registered or held here: poll has work
        self.want: int | None = None  # the device registration was last asked for
        self.devices: dict[int, None] = {}  # registered for, in order
        self.streams: dict[StreamKey, None] = {}  # seen in use
        self.unregister: deque[tuple[Event, Any]] = deque()  # (event, mapping) to let go of
        self.stuck: list[Any] = []  # mappings whose unregistration failed: never unmapped
        self.warned: set[str] = set()
        self.lock = threading.Lock()


STATE = _State()


def _forget_in_child() -> None:
    """A forked child starts afresh (in place: other modules hold these objects): the
    parent's fences and mappings are dropped without a CUDA call (its copies of the
    leases give nothing back: cpp/shm/block.hpp), the locks made anew."""
    STATE.__init__()  # type: ignore[misc]
    FENCES.__init__(FENCES.max_pending)  # type: ignore[misc]
    REGISTRAR.__init__()  # type: ignore[misc]
    global _REG_LOCK
    _REG_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def _warn_once(kind: str, text: str) -> None:
    if kind not in STATE.warned:
        STATE.warned.add(kind)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def device_index(device: Any) -> int:
    """The CUDA device index ``device`` names (``None``/``"cuda"``: the current one)."""
    if device is not None:
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.index is not None:
            return int(dev.index)
    return int(CUDA.current_device())


# --- registration ---------------------------------------------------------------------------


def register(m: Any, device: Any = None, wait: bool = True) -> bool:
    """Page-locks mapping ``m`` (``_shm._Mapped``) for CUDA on ``device``, once; True if
    it is registered. ``wait=False`` (a copy on the loop's path): never waits, the
    registration is queued on the registrar thread if it is not done, and False until
    it is. A failure is remembered (``m.failed``), warned about once and counted; False
    also where CUDA is not available."""
    if m.registered:
        return True
    if m.failed or not m.base or STATE.pid != os.getpid() or not CUDA.available():
        return False
    index = device_index(device)
    STATE.want = index  # blocks mapped from now on are registered as they arrive
    if not wait:
        submit(m, index)
        COUNTERS.pending_copies += 1
        return False
    t0 = time.perf_counter()
    with _REG_LOCK:  # one the registrar has started finishes first
        _register_now(m, index)
    if threading.current_thread() is threading.main_thread():
        COUNTERS.register_main_ms += (time.perf_counter() - t0) * 1000
    return bool(m.registered)


def mapped(m: Any) -> None:
    """``m`` was just mapped: queued for registration where this process registers
    blocks (it asked for one before), so that it is done before the block's first copy
    where the loop leaves time, and never on the loop's path."""
    want = STATE.want
    if want is not None and STATE.pid == os.getpid():
        submit(m, want)


def submit(m: Any, index: int) -> None:
    """Queues ``m``'s registration for device ``index`` on the registrar thread (once)."""
    with STATE.lock:
        if m.pending or m.registered or m.failed or m.dropped:
            return
        m.pending = True
        _hold(m, index)
    REGISTRAR.put(("register", m, index))


def _hold(m: Any, index: int) -> None:
    """From now on ``m``'s leases retire (a copy may find it registered) and poll looks
    at ``index``'s streams (called under STATE.lock)."""
    m.view.held = True
    STATE.devices.setdefault(index, None)
    STATE.active = True


def _register_now(m: Any, index: int) -> None:
    """Registers ``m`` if nothing did or dropped it meanwhile (called under _REG_LOCK)."""
    with STATE.lock:
        if m.registered or m.failed:
            m.pending = False
            return
        if m.dropped:  # let go of before it was registered: nothing to undo
            m.pending = False
            m.view.held = False
            return
        m.pending = True  # unregister_later keeps track of it from here
        _hold(m, index)
    t0 = time.perf_counter()
    try:
        with CUDA.device(index):
            rc = CUDA.host_register(m.base, m.length)
            if rc != 0:
                CUDA.clear_error()
    except Exception as e:  # a device that does not exist, say
        rc, why = -1, f"{type(e).__name__}: {e}"
    else:
        why = CUDA.error_name(rc) if rc != 0 else ""
    ms = (time.perf_counter() - t0) * 1000
    if rc != 0:
        m.failed = True
        m.view.held = False
        m.pending = False
        COUNTERS.register_failed += 1
        _warn_once("register", (
            f"fastload: page-locking a {m.length / 1e6:.1f} MB worker block for CUDA "
            f"device {index} failed ({why}): batches in such blocks are "
            "copied through torch's pinned buffers instead (an extra copy). The usual "
            "cause is the locked-memory limit (ulimit -l; a container's memlock). "
            "Counted in fastload.monitor's gpu/register_failed."))
        return
    m.device = index
    m.registered = True
    m.pending = False  # after registered: unregister_later sees one or the other
    COUNTERS.registered += 1
    COUNTERS.register_ms += ms
    if threading.current_thread() is REGISTRAR.thread:
        COUNTERS.registered_behind += 1


def unregister_later(m: Any) -> None:
    """Lets go of mapping ``m`` (registered, or its registration pending) once every
    copy issued from it may have completed: an event is recorded now on the streams in
    use, and ``m`` is unregistered on the registrar thread (then dropped, and unmapped
    when nothing else holds it) when :func:`poll` finds it completed."""
    if STATE.pid != os.getpid():
        return
    with STATE.lock:
        m.dropped = True  # a registration not started yet is skipped
        if not (m.registered or m.pending):
            return
    ev = CUDA.record(streams_in_use())
    with STATE.lock:
        STATE.unregister.append((ev, m))


def _unregister(m: Any) -> None:
    t0 = time.perf_counter()
    with CUDA.device(m.device):
        rc = CUDA.host_unregister(m.base)
        if rc != 0:
            CUDA.clear_error()
    if rc != 0:
        COUNTERS.unregister_failed += 1
        STATE.stuck.append(m)  # still registered: it must never be unmapped
        _warn_once("unregister", (
            f"fastload: cudaHostUnregister of a worker block failed ({CUDA.error_name(rc)}); "
            "its mapping is kept (registered memory is never unmapped). Counted in "
            "fastload.monitor's gpu/unregister_failed."))
        return
    m.registered = False
    m.view.held = False
    ms = (time.perf_counter() - t0) * 1000
    COUNTERS.unregistered += 1
    COUNTERS.unregister_ms += ms
    if threading.current_thread() is threading.main_thread():
        COUNTERS.unregister_main_ms += ms


class Registrar:
    """The thread that registers blocks as they are mapped and unregisters those let go
    of, in the order asked (a mapping dropped while its registration is queued is
    skipped), so neither runs on the loop's path. Started on first use; a daemon; a
    forked child starts its own (none until it registers, which it never does)."""

    def __init__(self) -> None:
        self.jobs: deque[tuple[Any, ...]] = deque()
        self.busy = 0  # jobs queued or running
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None

    def put(self, job: tuple[Any, ...]) -> None:
        with self.cond:
            self.jobs.append(job)
            self.busy += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="fastload-cuda-registrar")
                self.thread.start()
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    self.cond.wait()
                job = self.jobs.popleft()
            try:
                if job[0] == "register":
                    with _REG_LOCK:
                        _register_now(job[1], job[2])
                else:
                    _unregister(job[1])
            except Exception as e:  # the thread must go on; said once
                with contextlib.suppress(Exception):  # a warning made an error (-W error)
                    _warn_once("registrar", f"fastload: the CUDA registrar failed on a "
                               f"worker block ({type(e).__name__}: {e})")
            finally:
                del job  # the mapping may be unmapped now: after its unregistration
                with self.cond:
                    self.busy -= 1
                    self.cond.notify_all()

    def wait_idle(self) -> None:
        """Until every job asked for so far is done."""
        with self.cond:
            while self.busy:
                self.cond.wait()


REGISTRAR = Registrar()
_REG_LOCK = threading.Lock()  # one registration at a time: pin() waits behind the registrar's


# --- streams in use and the hold ------------------------------------------------------------


def use_stream(stream: Any) -> None:
    """Copies from blocks may be issued on ``stream`` (a ``torch.cuda.Stream``)."""
    key = CUDA.stream_key(stream)
    if key not in STATE.streams:
        with STATE.lock:
            STATE.streams.setdefault(key, None)


def note_streams() -> None:
    """The current stream of each device in use, in this thread, is in use."""
    for d in list(STATE.devices):
        key = CUDA.current_stream(d)
        if key not in STATE.streams:
            with STATE.lock:
                STATE.streams.setdefault(key, None)


def streams_in_use() -> list[StreamKey]:
    note_streams()
    return list(STATE.streams)


def poll() -> None:
    """Gives back the lease counts whose copies have completed, holds those retired
    since the last poll behind a new event, and unregisters the mappings let go of
    whose event has completed. Cheap when nothing is pending."""
    if STATE.pid != os.getpid():
        return
    retired = _core.shm_take_retired() if STATE.active else None
    if retired:
        COUNTERS.retired += len(retired)
        FENCES.hold(CUDA.record(streams_in_use()), retired)  # polls the others too
    elif len(FENCES):
        FENCES.poll()
    if STATE.unregister:
        _unregister_due()


def _unregister_due() -> None:
    """Unregisters the mappings let go of whose event has completed and over which no
    lease is left (a tensor of an exited worker's block may still be copied from: its
    count, retired when it goes, is given back after its own event)."""
    with STATE.lock:
        due = [(ev, m) for ev, m in STATE.unregister
               if not m.pending and ev.query() and m.view.users == 0]
        for item in due:
            STATE.unregister.remove(item)
    for _, m in due:
        if m.registered:
            REGISTRAR.put(("unregister", m))
        else:  # its registration failed or never ran: nothing to undo
            m.view.held = False


def drain() -> None:
    """Waits for every registration asked for and every copy from a block, and
    unregisters the mappings let go of that nothing here still uses."""
    if STATE.pid != os.getpid():
        return
    REGISTRAR.wait_idle()  # registrations asked for are done (or failed)
    poll()
    FENCES.drain()
    for ev, _ in list(STATE.unregister):
        ev.synchronize()
    _unregister_due()
    REGISTRAR.wait_idle()
