"""stage(src, dst, wait=False): a stage in the background, and :class:`Staging`, the
handle its readers read through while it runs (issue 49; docs/read-while-staging.md).

Every process that calls it gets a *participant*: a thread that takes the node lock
beside ``dst`` (at once in the first caller of the node; the others poll for it, as
waiters on the lock do in a plain stage) and, holding it, runs the plain stage with a
:class:`~.schedule.Schedule` and serves readers over the node-local channel
(channel.py). A stager killed drops the lock; the next participant takes it, resumes
the stage (its journal) and serves: readers reconnect and ask again. A handle carried
into a DataLoader worker (forked or spawned) asks the stager of the node; with none
left and nothing complete it takes the stage over itself.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import errno
import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from .._util import lock_path
from ..errors import stage_error
from ..sources.retry import process_retries
from .channel import Client, NoServer, Server, channel_name, decode_error
from .request import StageRequest
from .result import StageResult
from .schedule import Schedule
from .serving import inside, manifest_files
from .state import mkdir_parent, named_os_errors, read_manifest
from .waits import note_wait

__all__ = ["StageProgress", "Staging", "stage_in_background"]

LOCK_POLL = 0.05  # seconds between a participant's tries of the node lock
RETRY = 0.02  # seconds between a reader's tries of a channel not (yet) served
HINTS_AT_ONCE = 4096  # paths of one "ahead" request at most
HINT_TIMEOUT = 30.0  # seconds a hint's reply may take (then the connection is dropped)

# api.open_source: a source and its destination for a path, a URL, and a request.
Opener = Callable[[Any, Path, StageRequest], tuple[Any, Any]]


@dataclasses.dataclass(frozen=True)
class StageProgress:
    """How far a stage in the background is: ``state`` is "waiting" (for the node's
    stager), "starting" (listing the source, planning), "copying", "done" or
    "failed"; the totals are None until the source is listed."""

    state: str
    files_done: int = 0
    files_total: int | None = None
    bytes_done: int = 0
    bytes_total: int | None = None


def _try_lock(dst: Path) -> int | None:
    """The node lock beside ``dst`` if free now (its descriptor), else None."""
    try:
        fd = os.open(lock_path(dst), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise stage_error(
            e.errno or errno.EIO,
            f"cannot use '{dst}': {e.strerror} in '{dst.parent}' (fastload keeps its lock "
            "and manifest beside the destination)", str(dst),
        ) from None  # fmt: skip
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    with contextlib.suppress(OSError):
        me = f"process {os.getpid()} on {os.uname().nodename}".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)
    return fd


class _Participant:
    """This process's part in the stage of ``dst``: a thread that waits for the node
    lock (or holds ``fd``, taken by the caller), then stages and serves readers."""

    def __init__(self, src: Any, dst: Path, options: dict[str, Any], fd: int | None,
                 opener: Opener) -> None:  # fmt: skip
        self.src, self.dst, self.options, self.opener = src, dst, options, opener
        self.made = time.time()
        self.fd = fd
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.result: StageResult | None = None
        self.error: BaseException | None = None
        self.schedule: Schedule | None = None
        self.server: Server | None = None
        self.thread = threading.Thread(target=self._run, name="fastload-stage", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            fd = self.fd
            while fd is None:
                if self.stop.wait(LOCK_POLL):
                    return
                fd = _try_lock(self.dst)
            self.fd = fd
            try:
                self.result = self._stage()
            finally:
                self.fd = None
                os.close(fd)  # releases the lock
        except BaseException as e:
            self.error = e
        finally:
            self.finished.set()

    def _stage(self) -> StageResult:
        from .destination import stage_into

        schedule = self.schedule = Schedule(self.dst)
        fresh = _empty(self.dst)
        self.server = Server(channel_name(self.dst), schedule.handle)
        try:
            options = dict(self.options)
            m = read_manifest(self.dst)
            if (m is not None and m.get("complete") and options.get("check_source") is True
                    and float(m.get("created", 0)) >= self.made):  # fmt: skip
                # Staged by another process of the node since this handle was made: what
                # a waiter on the lock of a plain stage would list again, trusted.
                options["check_source"] = False
            req = StageRequest.make(**options)
            retried = process_retries().snapshot()
            with named_os_errors():
                source, dest = self.opener(self.src, self.dst, req)
                dest.lock_held = True
                dest.scheduler = schedule
                schedule.opened(source, dest, req, fresh)
                result = stage_into(dest, source, retried)
            schedule.finish(result)
            return result
        except BaseException as e:
            schedule.fail(e)
            raise
        finally:
            self.server.close()

    def cancel(self) -> None:
        self.stop.set()
        if self.schedule is not None:
            self.schedule.cancel()

    def ending(self) -> bool:
        """Whether its stage has ended or was cancelled (the thread then finishes)."""
        sched = self.schedule
        return self.stop.is_set() or (sched is not None and sched.state in ("done", "failed"))

    def forked_away(self) -> None:
        """In a forked child: the lock and the channel are the parent's; this copy of
        their descriptors goes (the parent keeps them)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if self.server is not None:
            self.server.forget()
        self.finished.set()


def _empty(dst: Path) -> bool:
    """Whether ``dst`` is absent or an empty folder (a stage's start on it is fresh)."""
    try:
        with os.scandir(dst) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True
    except OSError:
        return False


_participants: dict[Path, _Participant] = {}  # this process's, by destination
_registry_lock = threading.Lock()


def _after_fork() -> None:
    for p in _participants.values():
        p.forked_away()
    _participants.clear()


os.register_at_fork(after_in_child=_after_fork)


@atexit.register
def _stop_all() -> None:
    """At exit (Ctrl-C included): each stage here stops after its chunk in flight, its
    journal kept (the next call resumes)."""
    for p in list(_participants.values()):
        p.cancel()
    for p in list(_participants.values()):
        p.thread.join(timeout=60)


def _participant(src: Any, dst: Path, options: dict[str, Any], fd: int | None,
                 opener: Opener) -> _Participant:  # fmt: skip
    """This process's participant in the stage of ``dst``: the one running, else a new
    one. One whose stage has ended (its handles already have the result or the error)
    but whose thread has not yet let go of the lock is waited for, not joined: a call
    right after a failed stage starts the next (which resumes), not the failed one."""
    while True:
        with _registry_lock:
            p = _participants.get(dst)
            if p is None or p.finished.is_set():
                p = _participants[dst] = _Participant(src, dst, options, fd, opener)
                return p
            if not p.ending():
                if fd is not None:
                    os.close(fd)
                return p
        p.finished.wait()


def stage_in_background(src: Any, dst: Any, options: dict[str, Any], opener: Opener
                        ) -> Staging:  # fmt: skip
    """stage(wait=False): the handle, this process's participant started (holding the
    node lock already where it was free); ``opener`` is api.open_source (which
    imports this module: passed, not imported)."""
    if not isinstance(src, (str, os.PathLike)) or src == "-":
        raise ValueError("stage(wait=False) takes a path or a URL, not a stream")
    StageRequest.make(**options)  # bad options raise here, in the caller
    dst_abs = Path(os.path.abspath(os.fspath(dst)))
    mkdir_parent(dst_abs.parent)
    src = src if isinstance(src, str) else os.fspath(src)
    handle = Staging(src, dst_abs, options, opener)
    _participant(src, dst_abs, options, _try_lock(dst_abs), opener)
    return handle


class Staging:
    """A stage running in the background on this node (``stage(src, dst, wait=False)``),
    and reads through it: :meth:`open` and :meth:`local` return a file of the staged
    tree as soon as it is whole there, asking the stager to fetch it first where it is
    not yet. Picklable: a DataLoader worker (forked or spawned) reads through its copy.
    """

    def __init__(self, src: str, path: Path, options: dict[str, Any],
                 opener: Opener | None) -> None:  # fmt: skip
        self._dst = path  # the stage's destination
        self._within = ""  # the folder of it this handle reads (within())
        self._src, self._options, self._opener = src, options, opener
        self._init()

    @property
    def path(self) -> Path:
        """The staged tree (the destination, or the folder of it :meth:`within` names)."""
        return self._dst / self._within if self._within else self._dst

    def within(self, folder: str) -> Staging:
        """A handle on the same stage that reads the folder ``folder`` of the tree (the
        folder resolve() returns for a registry dataset with ``returns``): its
        :attr:`path`, :meth:`files` and reads are relative to that folder."""
        sub = copy.copy(self)
        sub._within = inside(os.path.join(self._within, folder) if self._within else folder)
        return sub

    @classmethod
    def ready(cls, path: Path) -> Staging:
        """A handle on a tree already in place (node-local data resolve() uses where
        it is): every read is at once."""
        handle = cls(str(path), Path(os.path.abspath(path)), {}, None)
        handle._final = ("done", StageResult(handle.path, 0, 0, 0.0, "none", True))
        return handle

    def _init(self) -> None:
        self._name = channel_name(self._dst)
        self._final: tuple[str, Any] | None = None  # ("done", StageResult) | ("failed", exc)
        self._local = threading.local()
        self._hints: list[str] = []  # ahead(): paths not sent yet
        self._hints_cond = threading.Condition()
        self._hints_pid = 0  # the process whose thread sends them
        # The stager said a file at its final name is whole and final (a fresh stage of
        # a tree or a prefix): local() reads one there without asking.
        self._present_whole = False

    def __getstate__(self) -> dict[str, Any]:
        options = {k: v for k, v in self._options.items() if k != "progress"}
        final = self._final if self._final is not None and self._final[0] == "done" else None
        return {"path": self._dst, "src": self._src, "options": options, "final": final,
                "opener": self._opener, "within": self._within}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._dst, self._src, self._options = state["path"], state["src"], state["options"]
        self._opener = state["opener"]
        self._within = state.get("within", "")
        self._init()
        self._final = state["final"]

    def __repr__(self) -> str:
        return f"Staging({self._src!r} -> '{self.path}')"

    # --- the channel ---------------------------------------------------------------------

    def _client(self) -> Client | None:
        c: Client | None = getattr(self._local, "client", None)
        if c is not None and c.pid == os.getpid():
            return c
        try:
            c = Client(self._name)
        except NoServer:
            c = None
        self._local.client = c
        return c

    def _mine(self) -> _Participant | None:
        p = _participants.get(self._dst)
        return p if p is not None and p.src == self._src else None

    def _no_server(self) -> None:
        """No stager answers: this process's participant is waiting for the lock or
        has ended (its result), or, with none here, the stage ended elsewhere (a
        complete manifest) or nobody stages (this process takes it over)."""
        p = self._mine()
        if p is not None:
            if p.finished.is_set():
                if p.error is not None:
                    self._final = ("failed", p.error)
                elif p.result is not None:
                    self._final = ("done", p.result)
                elif not self._from_manifest():  # stopped before it staged
                    self._take_over()
                return
            time.sleep(RETRY)
            return
        fd = _try_lock(self._dst)
        if fd is None:
            time.sleep(RETRY)  # a stager is starting, or a plain stage() holds the lock
            return
        try:
            if self._from_manifest():
                return
        finally:
            os.close(fd)
        self._take_over()

    def _take_over(self) -> None:
        """Nobody stages and nothing is complete: this process stages."""
        if self._opener is None:
            raise stage_error(errno.ENOENT, f"'{self._dst}' holds no complete stage",
                              str(self._dst))  # fmt: skip
        _participant(self._src, self._dst, self._options, None, self._opener)

    def _from_manifest(self) -> bool:
        m = read_manifest(self._dst)
        if m is None or not m.get("complete") or m.get("damaged"):
            return False
        self._final = ("done", StageResult(self._dst, int(m["files_count"]), int(m["bytes"]),
                                           0.0, "none", True))  # fmt: skip
        return True

    def _note(self, reply: dict[str, Any]) -> None:
        state = reply.get("state")
        if state in ("done", "failed"):
            c = getattr(self._local, "client", None)
            if c is not None:
                c.close()  # nothing more to ask
                self._local.client = None
        if reply.get("present_whole"):
            self._present_whole = True
        if state == "done":
            r = reply["result"]
            self._final = ("done", StageResult(self._dst, r["files"], r["bytes"], r["seconds"],
                                               r["engine"], r["skipped"], r["copied_files"],
                                               r["copied_bytes"]))  # fmt: skip
            p = self._mine()
            if p is not None and p.fd is None:
                p.stop.set()  # waiting for the lock still: nothing left to stage
        elif state == "failed":
            self._final = ("failed", decode_error(reply["error"], self._dst))

    def _ask(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any] | None:
        """The stager's reply to ``msg`` (None once the stage has ended)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._final is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"staging '{self._dst}' is not done after {timeout} s")
            c = self._client()
            if c is None:
                self._no_server()
                continue
            try:
                reply = c.request(msg, left)
            except TimeoutError:
                self._local.client = None
                raise TimeoutError(f"staging '{self._dst}' is not done after {timeout} s") from None
            except ConnectionError:
                self._local.client = None  # the stager died: the next one is asked
                continue
            self._note(reply)
            return reply
        return None

    def _raise_final(self) -> StageResult:
        assert self._final is not None
        kind, value = self._final
        if kind == "failed":
            raise value
        result: StageResult = value
        return result

    # --- the public API ---------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the stage has ended, complete (a failed stage raises in :meth:`wait`)."""
        if self._final is None:
            with contextlib.suppress(TimeoutError, OSError):
                self._ask({"op": "progress"}, timeout=5.0)
        return self._final is not None and self._final[0] == "done"

    def progress(self) -> StageProgress:
        """Files and bytes done, and their totals once the source is listed."""
        if self._final is None:
            c = self._client()
            if c is not None:
                with contextlib.suppress(ConnectionError):
                    reply = c.request({"op": "progress"})
                    self._note(reply)
                    if self._final is None:
                        return StageProgress(**reply["progress"])
            p = self._mine()
            if self._final is None and p is not None and p.finished.is_set() and (
                    p.error is not None or p.result is not None):  # fmt: skip
                self._no_server()  # this process staged: its end
            if self._final is None:
                return StageProgress("waiting")
        kind, value = self._final
        if kind == "failed":
            return StageProgress("failed")
        return StageProgress("done", value.files, value.files, value.bytes, value.bytes)

    def wait(self, timeout: float | None = None) -> StageResult:
        """Waits for the stage to end: its :class:`StageResult`, or its error raised;
        TimeoutError after ``timeout`` seconds."""
        self._ask({"op": "wait"}, timeout)
        return self._raise_final()

    def cancel(self) -> None:
        """Stops this process's part: the stage it runs stops after the chunk in flight
        (its journal kept: the next call resumes), or it stops waiting to take one
        over. Reads through this handle then raise the stage's error."""
        p = self._mine()
        if p is not None:
            p.cancel()
            p.finished.wait()
            self._no_server()
        if self._final is None:
            self._final = (
                "failed",
                stage_error(
                    errno.ECANCELED, f"staging '{self._dst}' was cancelled here", str(self._dst)
                ),
            )

    def files(self) -> list[str]:
        """The paths of the source's files (relative, sorted): from the stager's
        listing as soon as it is made (the stage need not be done), else from the
        complete copy's manifest."""
        return self._in_folder(self._all_files())

    def _in_folder(self, names: list[str]) -> list[str]:
        """``names`` (relative to the destination) under :meth:`within`'s folder,
        relative to it."""
        if not self._within:
            return names
        head = self._within + "/"
        return [n[len(head):] for n in names if n.startswith(head)]

    def _all_files(self) -> list[str]:
        if self._final is None:
            reply = self._ask({"op": "list"})
            if reply is not None and "files" in reply:
                return list(reply["files"])
        self._raise_final()
        staged = manifest_files(self._dst)
        if staged is not None:
            return sorted(staged)
        out: list[str] = []  # a tree not staged by fastload (Staging.ready)
        for d, _dirs, names in os.walk(self._dst):
            rel = os.path.relpath(d, self._dst)
            out.extend(n if rel == "." else f"{rel}/{n}" for n in names)
        return sorted(out)

    def local(self, relpath: str | os.PathLike[str]) -> Path:
        """The staged copy of ``relpath`` (relative to the tree), once it is whole:
        at once where it is; else the stager fetches it ahead of the rest and this
        waits for it. FileNotFoundError at once for a path the source does not have;
        the stage's error where it failed, or the file's (SourceChangedError)."""
        return self.local_all([relpath])[0]

    def local_all(self, relpaths: Iterable[str | os.PathLike[str]]) -> list[Path]:
        """:meth:`local` of several files, asked for at once (fetched together)."""
        rels = [self._rel(os.fspath(p)) for p in relpaths]
        if self._final is None and self._present_whole:
            here = [self._at(rel) for rel in rels]
            if all(os.path.isfile(p) for p in here):
                return here  # whole and final: no round trip to the stager
        if self._final is None:
            reply = self._ask({"op": "want", "paths": rels})
            if reply is not None:
                waited = 0.0
                for rel, ans in zip(rels, reply["results"], strict=True):
                    if "error" in ans:
                        raise decode_error(ans["error"], self._dst / rel)
                    waited = max(waited, float(ans.get("waited", 0.0)))
                if waited:
                    note_wait(waited)
                return [self._at(rel) for rel in rels]
        self._raise_final()
        out = []
        for rel in rels:
            p = self._at(rel)
            if not os.path.lexists(p):
                raise FileNotFoundError(errno.ENOENT, f"'{rel}' is not in the staged tree "
                                        f"'{self._dst}'", str(p))  # fmt: skip
            out.append(p)
        return out

    def _rel(self, relpath: str) -> str:
        """``relpath`` (relative to :attr:`path`) relative to the destination, checked to
        stay inside :attr:`path`."""
        if not self._within:
            return inside(relpath)
        rel = inside(os.path.join(self._within, relpath))
        if not rel.startswith(self._within + "/"):
            raise PermissionError(errno.EACCES, f"'{relpath}' is not a path inside "
                                  f"'{self.path}'", relpath)  # fmt: skip
        return rel

    def _at(self, rel: str) -> Path:
        """Where ``rel`` (a name :meth:`files` gives) is: in the tree, or the staged file
        itself where a single file was staged (its name is all :meth:`files` lists)."""
        if rel == self._dst.name and self._dst.is_file():
            return self._dst
        return self._dst / rel
    def ahead(self, relpaths: Iterable[str | os.PathLike[str]]) -> None:
        """A hint: these files (relative to the tree) are read soon, in this order; the
        stager fetches those not yet taken before its own order (after the files
        readers wait for). Returns at once and never fails: a thread of this process
        sends the hints (a stager gone, a bad path: the hint is dropped); nothing is
        sent once the stage is done. A sampler's (FileDataset.sampler) way to make the
        stage follow a shuffled loop."""
        if self._final is not None:
            return
        paths = []
        for p in relpaths:
            with contextlib.suppress(OSError):  # a path outside: dropped
                paths.append(self._rel(os.fspath(p)))
        with self._hints_cond:
            self._hints.extend(paths)
            if self._hints_pid != os.getpid():
                self._hints_pid = os.getpid()
                threading.Thread(target=self._send_hints, name="fastload-hints",
                                 daemon=True).start()  # fmt: skip
            self._hints_cond.notify()

    def _send_hints(self) -> None:
        """The hints' thread: sends what ahead() gathered, in one request at a time
        (its own connection), until the stage is done."""
        while self._final is None:
            with self._hints_cond:
                while not self._hints:
                    self._hints_cond.wait()
                paths, self._hints = self._hints[:HINTS_AT_ONCE], self._hints[HINTS_AT_ONCE:]
            try:
                c = self._client()
                if c is None:
                    continue  # no stager now: dropped
                self._note(c.request({"op": "ahead", "paths": paths}, HINT_TIMEOUT))
            except Exception:  # never the loop's concern: the hint is dropped
                self._local.client = None
        with self._hints_cond:
            self._hints = []

    def open(self, relpath: str | os.PathLike[str], mode: str = "rb") -> IO[Any]:
        """``open()`` of :meth:`local`'s file; read modes only."""
        if any(c in mode for c in "wax+"):
            raise ValueError(f"a staged file opens for reading only, not mode {mode!r}")
        return open(self.local(relpath), mode)
