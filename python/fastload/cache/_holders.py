"""Who holds which cache entry, and pins given back while their reader is idle.

- Each process records the pins its readers hold in ``state/held/<pid>`` (a line per
  pin: the entry and the reader's label), rewritten whenever they change, so that a
  reader that finds no room can say which process holds what, for which dataset
  (:func:`holders`). A record of a dead process is ignored (and removed).
- A reader that keeps the shard it last read pinned between reads (so its next read of
  that shard costs no pin) registers itself as idle (:func:`idle`); a thread of its
  process watches ``state/waiting`` and, while another reader waits for room, calls
  its ``give_back()``. A pin is therefore held against other readers only while it is
  read from: room is never kept by a reader that is not reading.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Protocol

from .._util import pid_alive

__all__ = ["Idle", "busy", "forget", "holders", "idle", "readers_waiting", "record"]

#: How often the give-back thread looks for a waiting reader while pins are idle.
_POLL = 0.05

_lock = threading.Lock()
#: root -> {token (the pin's descriptor): (entry name, label)}
_held: dict[Path, dict[int, tuple[str, str]]] = {}


def _write(root: Path, pins: dict[int, tuple[str, str]]) -> None:
    """Rewrites this process's record under ``root`` (removed when it holds nothing)."""
    path = root / "state" / "held" / str(os.getpid())
    with contextlib.suppress(OSError):
        if not pins:
            path.unlink(missing_ok=True)
            return
        path.parent.mkdir(exist_ok=True)
        # In place (no second copy beside it: the records count against the limit); a
        # reader may see a line cut short, it names what it can.
        path.write_text("".join(f"{name}\t{label}\n" for name, label in pins.values()),
                        encoding="utf-8")


def record(root: Path, token: int, name: str, label: str) -> None:
    """This process holds a pin of entry ``name`` for ``label`` (``token``: its fd)."""
    with _lock:
        pins = _held.setdefault(root, {})
        pins[token] = (name, label)
        _write(root, pins)


def forget(root: Path, token: int) -> None:
    with _lock:
        pins = _held.get(root)
        if pins is not None and pins.pop(token, None) is not None:
            _write(root, pins)


def holders(root: Path) -> list[tuple[int, str, str]]:
    """The pins the live processes record under ``root``: (pid, entry name, label)."""
    out = []
    folder = root / "state" / "held"
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(folder)):
            if not name.isdigit():
                continue
            pid = int(name)
            if not pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(folder / name)
                continue
            with contextlib.suppress(OSError):
                for line in (folder / name).read_text(encoding="utf-8").splitlines():
                    entry, _, label = line.partition("\t")
                    out.append((pid, entry, label))
    return out


def readers_waiting(root: Path) -> bool:
    """Whether a reader waits for room in the cache at ``root`` now (it holds
    ``state/waiting`` shared; a momentary exclusive try says so)."""
    try:
        fd = os.open(root / "state" / "waiting", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the exclusive flock, if taken
    return False


# --- idle pins given back ---------------------------------------------------------------


class Idle(Protocol):
    def give_back(self) -> None:
        """Lets go of the pin held, unless the reader is reading (then it keeps it)."""


_cond = threading.Condition(_lock)
#: root -> the idle readers (weakly: an idle pin never keeps its dataset alive)
_idle: dict[Path, weakref.WeakSet[Idle]] = {}
_thread: threading.Thread | None = None


def idle(root: Path, reader: Idle) -> None:
    """``reader`` holds a pin in the cache at ``root`` and is not reading."""
    global _thread
    with _cond:
        _idle.setdefault(root, weakref.WeakSet()).add(reader)
        if _thread is None:
            _thread = threading.Thread(target=_watch, name="fastload-give-back", daemon=True)
            _thread.start()
        _cond.notify()


def busy(root: Path, reader: Idle) -> None:
    """``reader`` holds no idle pin any more (it reads, or let go)."""
    with _cond:
        readers = _idle.get(root)
        if readers is not None:
            readers.discard(reader)


def _watch() -> None:
    while True:
        with _cond:
            while not any(_idle.values()):
                _cond.wait()
            roots = [r for r, readers in _idle.items() if readers]
        for root in roots:
            if not readers_waiting(root):
                continue
            with _cond:
                readers = list(_idle.get(root, ()))
            for reader in readers:
                with contextlib.suppress(Exception):  # its next read says what is wrong
                    reader.give_back()
        time.sleep(_POLL)


def _after_fork_in_child() -> None:
    global _lock, _cond, _thread
    # The parent's pins and idle readers are the parent's; its thread is not here.
    _lock = threading.Lock()
    _cond = threading.Condition(_lock)
    _held.clear()
    _idle.clear()
    _thread = None


os.register_at_fork(after_in_child=_after_fork_in_child)
