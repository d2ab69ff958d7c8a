"""Child processes: one fastload call per process (kit/stage_child.py, run by path),
its stdout parsed as it arrives, signals, and an action fired from this process the moment
a child starts writing into a file system.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import trees

TESTS = Path(__file__).resolve().parents[1]
CHILD_SCRIPT = Path(__file__).resolve().with_name("stage_child.py")


# --------------------------------------------------------------------------------------
# Child processes running one stage() call (kit/stage_child.py)
# --------------------------------------------------------------------------------------


@dataclass


class Child:
    """A ``python tests/kit/stage_child.py`` process; its stdout is parsed as it arrives."""

    spec: dict[str, Any]
    env: dict[str, str] | None = None
    as_user: int | None = None
    wrapper: list[str] = field(default_factory=list)  # e.g. setpriv ... --
    stdin: bool = False
    lines: list[str] = field(default_factory=list)
    stderr: str = ""

    def __post_init__(self) -> None:
        kwargs: dict[str, Any] = {}
        if self.as_user is not None:
            kwargs.update(user=self.as_user, group=self.as_user, extra_groups=[])
        self.proc = subprocess.Popen(
            [*self.wrapper, sys.executable, str(CHILD_SCRIPT), json.dumps(self.spec)],
            stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd="/",
            text=True,
            encoding="utf-8",
            errors="replace",
            **kwargs,
        )
        self._cond = threading.Condition()
        self._eof = False
        self._err_eof = False
        self._err_parts: list[str] = []
        self._t_out = threading.Thread(target=self._read_out, daemon=True)
        self._t_err = threading.Thread(target=self._read_err, daemon=True)
        self._t_out.start()
        self._t_err.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        # read1: what has arrived, without waiting for 4096 characters.
        for chunk in iter(lambda: self.proc.stderr.buffer.read1(4096), b""):  # type: ignore[union-attr]
            with self._cond:
                self._err_parts.append(chunk.decode("utf-8", "replace"))
                self._cond.notify_all()
        with self._cond:
            self._err_eof = True
            self._cond.notify_all()

    def wait_stderr(self, text: str, timeout: float = 120.0) -> bool:
        """Waits until ``text`` appears on the child's stderr; False if stderr closed (it
        exited) first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while text not in "".join(self._err_parts):
                if self._err_eof:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"child wrote no {text!r} on stderr in {timeout} s")
                self._cond.wait(left)
            return True

    def wait_line(self, prefix: str, timeout: float = 120.0) -> str | None:
        """Waits for a stdout line starting with ``prefix``; None if the child's stdout
        closed (it exited) first."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if line.startswith(prefix):
                        return line
                seen = len(self.lines)
                if self._eof:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"child printed no {prefix!r} line in {timeout} s")
                self._cond.wait(left)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.close()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def finish(self, timeout: float = 180.0) -> Child:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # a child still waiting for "go" goes on
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._join()
            raise AssertionError(
                f"child did not finish within {timeout} s (killed); stderr:\n{self.stderr}"
            ) from None
        self._join()
        return self

    def _join(self) -> None:
        self._t_out.join()
        self._t_err.join()
        for pipe in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if pipe is not None and not pipe.closed:
                pipe.close()
        self.stderr = "".join(self._err_parts)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def _tagged(self, tag: str) -> dict[str, Any] | None:
        for line in self.lines:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        return None

    @property
    def result(self) -> dict[str, Any] | None:
        return self._tagged("RESULT")

    @property
    def error(self) -> dict[str, Any] | None:
        return self._tagged("ERROR")

    @property
    def progress(self) -> list[tuple[int, int, int, int]]:
        out = []
        for line in self.lines:
            if line.startswith("PROGRESS "):
                a, b, c, d = (int(x) for x in line.split()[1:])
                out.append((a, b, c, d))
        return out

    def expect_result(self) -> dict[str, Any]:
        res = self.result
        assert self.returncode == 0 and res is not None, (
            f"child failed (rc={self.returncode}): error={self.error}\nstderr:\n{self.stderr}"
        )
        return res

    def expect_error(self) -> dict[str, Any]:
        err = self.error
        assert err is not None, (
            f"child did not raise (rc={self.returncode}, result={self.result})\n"
            f"stderr:\n{self.stderr}"
        )
        return err


def stage_spec(src: Path, dst: Path, **kwargs: Any) -> dict[str, Any]:
    return {"op": "stage", "src": str(src), "dst": str(dst), "kwargs": kwargs}


def run_child(spec: dict[str, Any], *, timeout: float = 180.0, **kw: Any) -> Child:
    return Child(spec, **kw).finish(timeout)


def with_tests_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with tests/ first on PYTHONPATH: a test module run as a child script
    (env/test_resolve.py, data/test_iterable.py) imports the kit from there, not from
    its own folder."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    return env


def child_env(**extra: str) -> dict[str, str]:
    env = with_tests_on_path({k: v for k, v in os.environ.items() if k != "FASTLOAD_FAULTS"})
    env.update(extra)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# --------------------------------------------------------------------------------------
# An action at the moment a child starts writing
# --------------------------------------------------------------------------------------


def _wait_until_settled(mount: Path) -> None:
    """Waits until the use of ``mount`` stops changing (I/O already in the kernel when
    the writer was stopped completes)."""
    last = -1
    for _ in range(200):
        st = os.statvfs(mount)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        if used == last:
            return
        last = used
        time.sleep(0.02)


def _enter_realtime() -> Any:
    """Makes the calling thread SCHED_FIFO (needs root); returns what to restore, or None."""
    try:
        old = (os.sched_getscheduler(0), os.sched_getparam(0))
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(10))
    except (OSError, AttributeError):
        return None
    return old


def run_child_with_trigger(
    spec: dict[str, Any], mount: Path, action: Any, *, threshold: int = 512 * 1024,
    timeout: float = 180.0,
) -> tuple[Child, bool]:
    """Runs a child (kit/stage_child.py) and, from this process, calls ``action`` once
    as soon as the file system at ``mount`` holds ``threshold`` more bytes than before:
    i.e. once the child passed its space check and is writing data. Returns the
    finished child and whether the action ran while the child was still running.

    The watching thread runs real-time (SCHED_FIFO, polling every ~100 us) so the
    child's copy threads cannot starve it on a small, busy machine; without the right
    to do so it busy-polls and the child runs at a lower priority."""
    probe = _enter_realtime()
    if probe is not None:
        os.sched_setscheduler(0, *probe)
    wrapper = [] if probe is not None else ["nice", "-n", "10"]
    st = os.statvfs(mount)
    base = (st.f_blocks - st.f_bfree) * st.f_frsize
    child = Child(spec, env=child_env(), wrapper=wrapper)
    fired = trigger_on_growth(child, mount, action, threshold=threshold, timeout=timeout,
                              base=base)
    return child.finish(timeout), fired


def trigger_on_growth(
    child: Child, mount: Path, action: Any, *, threshold: int = 512 * 1024,
    timeout: float = 180.0, base: int | None = None,
) -> bool:
    """Calls ``action`` once, with ``child`` stopped (SIGSTOP), as soon as the file
    system at ``mount`` holds ``threshold`` more bytes than ``base`` (by default: what
    it holds now); returns whether it did before the child exited."""
    if base is None:
        st = os.statvfs(mount)
        base = (st.f_blocks - st.f_bfree) * st.f_frsize

    def grown() -> bool:
        st = os.statvfs(mount)
        return (st.f_blocks - st.f_bfree) * st.f_frsize - base >= threshold

    def frozen() -> None:
        # Freeze the child while acting, so the action is not a race with a copy that
        # moves at GB/s. (A stop and continue may make some blocking system calls
        # return EINTR: the engine must cope with that anyway.)
        os.kill(child.proc.pid, signal.SIGSTOP)
        try:
            _wait_until_settled(mount)
            action()
        finally:
            os.kill(child.proc.pid, signal.SIGCONT)

    return act_when(child, grown, frozen, timeout=timeout)


def act_when(child: Child, ready: Any, action: Any, *, timeout: float = 180.0) -> bool:
    """Polls ``ready()`` from a real-time thread (SCHED_FIFO, every ~100 us, so the
    child's threads cannot starve it on a small, busy machine; without the right, it
    busy-polls) and calls ``action()`` once it is true. Returns whether that happened
    before the child exited."""
    deadline = time.monotonic() + timeout
    restore = _enter_realtime()
    try:
        while child.proc.poll() is None and time.monotonic() < deadline:
            if ready():
                action()
                return True
            if restore is not None:
                time.sleep(0.0001)
    finally:
        if restore is not None:
            os.sched_setscheduler(0, *restore)
    return False


def signal_once_done(spec: dict[str, Any], dst: Path, files: int,
                     sig: int = signal.SIGKILL) -> Child:
    """Runs a stage child and sends it ``sig`` once ``files`` files are whole at their
    final names in ``dst``: a point in its progress, not in time (on a busy machine a
    moment measured once may come before the first file, or after the last). Returns the
    finished child; it may have finished first (see its returncode and result)."""
    child = Child(spec, env=child_env())
    assert child.wait_line("START") is not None, child.finish().stderr
    act_when(child, lambda: trees.files_at_final_names(dst) >= files,
             lambda: child.signal(sig))
    try:
        return child.finish(timeout=60)
    except AssertionError as e:
        raise AssertionError(f"the stage did not stop after signal {sig}: {e}") from None


# --------------------------------------------------------------------------------------
# A test module run as several child scripts at once (ranks of a gloo group, say)
# --------------------------------------------------------------------------------------


def rendezvous(world_size: int) -> tuple[Any, dict[str, str]]:
    """A torch.distributed TCPStore served by this process, as torchrun's agent serves
    one, on a port the kernel picked (bound to 0 and read back: no port is chosen free
    and bound again later, which another process may take in between). Returns the
    store (keep it until the ranks are done) and the variables that make a rank's
    ``init_process_group`` (``env://`` or ``tcp://``) connect to it instead of serving
    one itself."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))  # fmt: skip
    return store, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip


def run_script(script: Path, mode: str, args: Sequence[dict[str, Any]],
               timeout: float = 180, env: dict[str, str] | None = None) -> None:
    """Runs ``python script mode json(a)`` for each ``a`` of ``args`` at once (without
    the launcher variables of the test run itself, with ``env`` added) and asserts each
    exits 0."""
    env = with_tests_on_path(
        {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        | (env or {})
    )
    procs = [
        subprocess.Popen([sys.executable, str(script), mode, json.dumps(a)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for a in args
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{mode} child failed:\n{out[-4000:]}"


def wait_blocked_on_lock(pid: int, timeout: float = 120.0) -> None:
    """Waits until process ``pid`` is blocked waiting for a file lock (flock, fcntl), as
    the kernel shows in /proc/locks ("->" before a waiter's entry)."""
    deadline = time.monotonic() + timeout
    while True:
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "->" and fields[5] == str(pid):
                return
        assert time.monotonic() < deadline, f"process {pid} did not wait for a lock in {timeout} s"
        time.sleep(0.01)
