"""What a stage in the background costs the loop beside it (issue 49): a file a reader
asks for that is already whole is read without a round trip to the stager (when the
stage began on an empty destination), the stage's own order runs nicer than the
process, and a FUSE source's small files are read in one request each.

Sources are on a netsim mount (2 ms per request); the stager of the first two tests is
a child process with 2 files in flight, stopped with SIGSTOP while a read is tried (a
read that needs it cannot return then; one that does not, returns)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.staging.schedule import BACKGROUND_NICE
from kit import procs, trees
from kit.netsim import listed, mounts

N = 600

_STAGER = r"""
import sys, time
import fastload
h = fastload.stage(sys.argv[1], sys.argv[2], wait=False, workers=2)
while h.progress().state not in ("copying", "done", "failed"):
    time.sleep(0.01)
print("STAGER", flush=True)
h.wait()
"""


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("rwsc") / "src"
    trees.build_small_files(root, N, per_dir=100, seed=251)
    return root


def _stager(src: Path, dst: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", _STAGER, str(src), str(dst)],
                         stdout=subprocess.PIPE, text=True, env=procs.child_env())  # fmt: skip
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "STAGER"
    return p


def _end(p: subprocess.Popen[str], h: Any) -> None:
    """Ends the stager ``p``; ``h`` (a handle of this process, or None) first stops
    waiting to take the stage over (a test that failed leaves no stage on the mount)."""
    if h is not None and not h.done:
        h.cancel()
    if p.poll() is None:
        p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


@contextlib.contextmanager
def _beside_a_stager(shown: Path, dst: Path, first: str
                     ) -> Iterator[tuple[subprocess.Popen[str], Any]]:  # fmt: skip
    """A stager (a child) of ``shown`` into ``dst``, and a handle of this process that
    has asked it for ``first`` (so it has heard from the stager); the stage's end."""
    p = _stager(shown, dst)
    h = None
    try:
        h = fastload.stage(shown, dst, wait=False)
        h.local(first)
        yield p, h
        h.wait()
    finally:
        _end(p, h)


@contextlib.contextmanager
def _stopped(p: subprocess.Popen[str]) -> Iterator[None]:
    os.kill(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(p.pid, signal.SIGCONT)


def _asks_the_stager(p: subprocess.Popen[str], h: Any, pick: Callable[[], str],
                     src: Path) -> None:  # fmt: skip
    """With the stager stopped, a read of the file ``pick`` names (then) does not
    return; once the stager goes on, it returns the source's bytes."""
    with _stopped(p):
        rel = pick()
        t, out = _in_thread(lambda: h.local(rel).read_bytes())
        t.join(1.0)  # a read that needs the stopped stager cannot return
        assert t.is_alive(), f"'{rel}' was read without asking the stager"
    t.join(120)
    assert out == [(src / rel).read_bytes()]


def test_a_whole_file_of_a_fresh_stage_is_read_without_the_stager(tree: Path, tmp_path: Path
                                                                  ) -> None:  # fmt: skip
    names = sorted(trees.regular_files(tree))
    with mounts(tmp_path) as mount:
        m = mount(tree, 2000, 2000)
        dst = tmp_path / "dst"
        with _beside_a_stager(m.path, dst, names[0]) as (p, h):
            with _stopped(p):
                here = [n for n in names if (dst / n).is_file()]
                assert here, "nothing staged yet"
                t, out = _in_thread(lambda: [h.local(n).read_bytes() for n in here])
                t.join(60)  # a bound: read without the stopped stager, or never
                assert not t.is_alive(), "a whole file waited for the stopped stager"
                assert out[0] == [(tree / n).read_bytes() for n in here]
            _asks_the_stager(p, h, lambda: next(n for n in names if not (dst / n).exists()),
                             tree)  # fmt: skip
    trees.assert_same_tree(tree, dst)


def test_a_file_left_by_an_earlier_stage_is_asked_for(tree: Path, tmp_path: Path) -> None:
    """The destination is not empty when the stage begins: a file there may be an older
    copy the stage replaces, so a reader asks the stager, and gets the source's bytes."""
    src = tmp_path / "src"
    subprocess.run(["cp", "-a", str(tree), str(src)], check=True)
    names = sorted(trees.regular_files(src))

    def older() -> str:
        return next(n for n in names if (dst / n).read_bytes() != (src / n).read_bytes())

    with mounts(tmp_path) as mount:
        m = mount(src, 2000, 2000)
        dst = tmp_path / "dst"
        fastload.stage(m.path, dst)
        for n in names:  # every file changed since: each copy there is an older one
            (src / n).write_bytes(os.urandom((src / n).stat().st_size + 1))
        time.sleep(1.5)  # (netsim's attributes are cached for a second)
        with _beside_a_stager(m.path, dst, names[0]) as (p, h):
            _asks_the_stager(p, h, older, src)
    trees.assert_same_tree(src, dst)


def test_the_stages_own_order_runs_nicer_than_the_process(tree: Path, tmp_path: Path
                                                          ) -> None:  # fmt: skip
    """The chunks' Python threads run BACKGROUND_NICE steps nicer; the copy jobs they
    start run their threads at nice 19; the process's own threads keep their priority."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    want = min(19, base + BACKGROUND_NICE)
    seen: dict[int, int] = {}
    with mounts(tmp_path) as mount:
        m = mount(tree, 2000, 2000)
        h = fastload.stage(m.path, tmp_path / "dst", wait=False, workers=2)
        listed(h)
        deadline = time.monotonic() + 60
        engine: list[int] = []
        # (a chunk thread is niced as it starts, before its job starts the engine's)
        while not (seen and engine) and time.monotonic() < deadline and not h.done:
            for t in threading.enumerate():
                if t.name.startswith("fastload-chunk") and t.native_id is not None:
                    got = _sched(t.native_id)
                    if got is not None and got[0] != base:
                        seen[t.native_id] = got[0]
                        assert got[1] == SCHED_NORMAL, got  # (it takes the GIL)
            python = {t.native_id for t in threading.enumerate()}
            engine = [tid for tid in _tids()
                      if tid not in python and _sched(tid) == (19, SCHED_NORMAL)]
            time.sleep(0.005)
        h.wait()
    assert seen and set(seen.values()) == {want}, seen
    assert engine, "no thread started by a chunk runs at nice 19"
    assert _sched(threading.get_native_id()) == (base, SCHED_NORMAL)


SCHED_NORMAL = 0  # /proc/PID/task/TID/stat's policy field


def _tids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def _sched(tid: int) -> tuple[int, int] | None:
    """Thread ``tid``'s nice value and scheduling policy."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[16]), int(fields[38])
    except (OSError, IndexError, ValueError):
        return None


def test_a_fuse_sources_small_files_take_one_read_each(tree: Path, tmp_path: Path) -> None:
    """FUSE reads ahead through at most max_background requests of the whole mount (12
    by default): with many files in flight the kernel falls back to page-sized reads,
    each a round trip. The stage reads a small file of a FUSE source O_DIRECT: one
    read request of the whole file."""
    with mounts(tmp_path) as mount:
        m = mount(tree, 2000, 2000)
        r = fastload.stage(m.path, tmp_path / "dst", workers=64)
        stats = m.unmount()
    nonempty = sum(1 for n in trees.regular_files(tree) if (tree / n).stat().st_size)
    assert r.files == N
    assert stats["reads"] == nonempty, stats
    trees.assert_same_tree(tree, tmp_path / "dst")
