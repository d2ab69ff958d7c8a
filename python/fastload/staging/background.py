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
from .schedule import Schedule, inside
from .state import mkdir_parent, named_os_errors, read_manifest
from .waits import note_wait

__all__ = ["StageProgress", "Staging", "stage_detached", "stage_in_background"]

LOCK_POLL = 0.05  # seconds between a participant's tries of the node lock
RETRY = 0.02  # seconds between a reader's tries of a channel not (yet) served

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
    with _registry_lock:
        p = _participants.get(dst)
        if p is None or p.finished.is_set():
            p = _participants[dst] = _Participant(src, dst, options, fd, opener)
        elif fd is not None:
            os.close(fd)
        return p


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
        self.path = path
        """The staged tree (the destination)."""
        self._src, self._options, self._opener = src, options, opener
        self._init()

    @classmethod
    def ready(cls, path: Path) -> Staging:
        """A handle on a tree already in place (node-local data resolve() uses where
        it is): every read is at once."""
        handle = cls(str(path), Path(os.path.abspath(path)), {}, None)
        handle._final = ("done", StageResult(handle.path, 0, 0, 0.0, "none", True))
        return handle

    def _init(self) -> None:
        self._name = channel_name(self.path)
        self._final: tuple[str, Any] | None = None  # ("done", StageResult) | ("failed", exc)
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        options = {k: v for k, v in self._options.items() if k != "progress"}
        final = self._final if self._final is not None and self._final[0] == "done" else None
        return {"path": self.path, "src": self._src, "options": options, "final": final,
                "opener": self._opener}  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self._src, self._options = state["path"], state["src"], state["options"]
        self._opener = state["opener"]
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
        p = _participants.get(self.path)
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
        fd = _try_lock(self.path)
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
            raise stage_error(errno.ENOENT, f"'{self.path}' holds no complete stage",
                              str(self.path))  # fmt: skip
        _participant(self._src, self.path, self._options, None, self._opener)

    def _from_manifest(self) -> bool:
        m = read_manifest(self.path)
        if m is None or not m.get("complete") or m.get("damaged"):
            return False
        self._final = ("done", StageResult(self.path, int(m["files_count"]), int(m["bytes"]),
                                           0.0, "none", True))  # fmt: skip
        return True

    def _note(self, reply: dict[str, Any]) -> None:
        state = reply.get("state")
        if state in ("done", "failed"):
            c = getattr(self._local, "client", None)
            if c is not None:
                c.close()  # nothing more to ask
                self._local.client = None
        if state == "done":
            r = reply["result"]
            self._final = ("done", StageResult(self.path, r["files"], r["bytes"], r["seconds"],
                                               r["engine"], r["skipped"], r["copied_files"],
                                               r["copied_bytes"]))  # fmt: skip
            p = self._mine()
            if p is not None and p.fd is None:
                p.stop.set()  # waiting for the lock still: nothing left to stage
        elif state == "failed":
            self._final = ("failed", decode_error(reply["error"], self.path))

    def _ask(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any] | None:
        """The stager's reply to ``msg`` (None once the stage has ended)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._final is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"staging '{self.path}' is not done after {timeout} s")
            c = self._client()
            if c is None:
                self._no_server()
                continue
            try:
                reply = c.request(msg, left)
            except TimeoutError:
                self._local.client = None
                raise TimeoutError(f"staging '{self.path}' is not done after {timeout} s") from None
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
                    errno.ECANCELED, f"staging '{self.path}' was cancelled here", str(self.path)
                ),
            )

    def files(self) -> list[str]:
        """The paths of the source's files (relative, sorted): from the stager's
        listing as soon as it is made (the stage need not be done), else from the
        complete copy's manifest."""
        if self._final is None:
            reply = self._ask({"op": "list"})
            if reply is not None and "files" in reply:
                return list(reply["files"])
        self._raise_final()
        m = read_manifest(self.path)
        if m is not None and m.get("complete"):
            return sorted(os.fsdecode(p) for p in m["files"].path_bytes())
        out: list[str] = []  # a tree not staged by fastload (Staging.ready)
        for d, _dirs, names in os.walk(self.path):
            rel = os.path.relpath(d, self.path)
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
        rels = [inside(os.fspath(p)) for p in relpaths]
        if self._final is None:
            reply = self._ask({"op": "want", "paths": rels})
            if reply is not None:
                waited = 0.0
                for rel, ans in zip(rels, reply["results"], strict=True):
                    if "error" in ans:
                        raise decode_error(ans["error"], self.path / rel)
                    waited = max(waited, float(ans.get("waited", 0.0)))
                if waited:
                    note_wait(waited)
                return [self.path / rel for rel in rels]
        self._raise_final()
        out = []
        for rel in rels:
            p = self.path / rel
            if not os.path.lexists(p):
                raise FileNotFoundError(errno.ENOENT, f"'{rel}' is not in the staged tree "
                                        f"'{self.path}'", str(p))  # fmt: skip
            out.append(p)
        return out

    def open(self, relpath: str | os.PathLike[str], mode: str = "rb") -> IO[Any]:
        """``open()`` of :meth:`local`'s file; read modes only."""
        if any(c in mode for c in "wax+"):
            raise ValueError(f"a staged file opens for reading only, not mode {mode!r}")
        return open(self.local(relpath), mode)


def stage_detached(src: str, dst: str, argv: list[str]) -> int:
    """``fastload stage --background``: runs ``fastload <argv>`` (``--serve``: it stages
    with wait=False and waits) in a process of its own session, and returns once that
    stage is under way (it serves readers), or with the process's error where it ended
    first. The process ends with the stage; in a job, with the job."""
    import subprocess
    import sys

    dst_abs = Path(os.path.abspath(dst))
    mkdir_parent(dst_abs.parent)
    log = dst_abs.parent / f".{dst_abs.name}.fastload-background.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fastload", *argv], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    reader = Staging(src, dst_abs, {}, None)  # asks, never stages
    while proc.poll() is None:
        state = reader.progress().state
        if state in ("starting", "copying"):
            print(f"{dst_abs}: staging in the background (process {proc.pid}; its errors "
                  f"in {log})")  # fmt: skip
            return 0
        if state != "waiting":
            break  # ended already
        time.sleep(RETRY)
    code = proc.wait()
    sys.stderr.write(log.read_text(errors="replace"))
    if code == 0:
        print(f"{dst_abs}: staged")
    return code
