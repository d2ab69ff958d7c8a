"""The node-local channel between a stage in the background and its readers (issue 49).

An abstract Unix socket (Linux: no file to leave behind, no path length limit), named
after the user and the destination, so every process of the node staging the same
``dst`` finds the same one. Its ends check each other with ``SO_PEERCRED``: the stager
answers only processes of its own user, and a reader trusts only a stager of its own
user (a name squatted by someone else is refused, not used). Messages are JSON lines;
an error crosses it pickled (the peer is the same user, checked) so that a reader
raises the stager's very exception (SourceChangedError, NotEnoughSpaceError, ...).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import stage_error

__all__ = ["Client", "NoServer", "Server", "channel_name", "decode_error", "encode_error"]

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class NoServer(ConnectionError):
    """No stager listens on the channel (none runs, or it is starting or gone)."""


def channel_name(dst: Path) -> str:
    """The abstract socket's name for ``dst`` (absolute), this user's alone."""
    where = os.path.join(os.path.realpath(dst.parent), dst.name)
    key = hashlib.sha256(f"{os.getuid()}\0{where}".encode()).hexdigest()[:40]
    return f"\0fastload-stage-{key}"


def _peer_uid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", raw)[1])


def encode_error(exc: BaseException) -> dict[str, Any]:
    """An exception as a reply's ``error``: pickled, and its text for a peer that cannot
    unpickle it."""
    out: dict[str, Any] = {"text": str(exc), "errno": getattr(exc, "errno", None)}
    with contextlib.suppress(Exception):
        out["pickled"] = base64.b64encode(pickle.dumps(exc)).decode()
    return out


def named_by(exc: BaseException, rels: list[str]) -> list[str]:
    """Those of ``rels`` (paths relative to the staged tree) that ``exc`` names: its
    filename is one of them, or ends with one (a job's error names the file it failed
    on; its readers get it, the others' files are still wanted)."""
    where = str(getattr(exc, "filename", "") or "")
    if not where:
        return []
    return [r for r in rels if where == r or where.endswith("/" + r)]


def decode_error(err: dict[str, Any], path: Path) -> BaseException:
    """The exception a reply's ``error`` holds (a StageError naming ``path`` where it
    cannot be rebuilt)."""
    if "pickled" in err:
        with contextlib.suppress(Exception):
            exc = pickle.loads(base64.b64decode(err["pickled"]))
            if isinstance(exc, BaseException):
                return exc
    return stage_error(err.get("errno") or errno.EIO, str(err.get("text")), str(path))


class Server:
    """Listens on ``name``; a thread per connection answers each request (a JSON line)
    with ``handler``'s reply. Connections of other users are closed unanswered."""

    def __init__(self, name: str, handler: Handler) -> None:
        self._handler = handler
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(name)
        except OSError as e:
            self._sock.close()
            raise stage_error(
                e.errno or errno.EADDRINUSE,
                "cannot serve readers: the node-local channel of this destination is "
                f"taken by another process ({e.strerror})",
            ) from None
        self._sock.listen(64)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="fastload-channel",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def forget(self) -> None:
        """In a forked child: closes this process's copies of the server's sockets (the
        parent's stay open and served), without shutting them down."""
        for s in [self._sock, *self._conns]:
            with contextlib.suppress(OSError):
                fd = s.detach()
                if fd >= 0:
                    os.close(fd)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if _peer_uid(conn) != os.getuid():
                conn.close()  # the channel is this user's alone
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fastload-reader",
                             daemon=True).start()  # fmt: skip

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn, conn.makefile("rwb") as f:
                for line in f:
                    try:
                        reply = self._handler(json.loads(line))
                    except Exception as e:  # a malformed request: said, not fatal
                        reply = {"error": encode_error(e)}
                    f.write(json.dumps(reply).encode() + b"\n")
                    f.flush()
        except OSError:
            pass  # the reader went away
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._conns.remove(conn)

    def close(self) -> None:
        """Stops listening: a new reader finds no stager here. Connections made stay
        answered (the stage's final state) until their readers close them."""
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class Client:
    """One connection to the stager of ``name`` (a thread's own: requests on it are
    answered in order)."""

    def __init__(self, name: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(name)
        except (ConnectionRefusedError, FileNotFoundError) as e:
            sock.close()
            raise NoServer(str(e)) from None
        if _peer_uid(sock) != os.getuid():
            sock.close()
            raise stage_error(
                errno.EACCES,
                "the node-local channel of this destination is held by another user's "
                "process: refusing to use it",
            )
        self.pid = os.getpid()
        self._sock = sock
        self._file = sock.makefile("rwb")

    def request(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Sends ``msg`` and waits for its reply; a stager gone is ConnectionError, no
        reply within ``timeout`` TimeoutError (the connection is closed then: its reply
        would come out of turn)."""
        try:
            self._sock.settimeout(timeout)
            self._file.write(json.dumps(msg).encode() + b"\n")
            self._file.flush()
            line = self._file.readline()
        except TimeoutError:
            self.close()
            raise
        except OSError as e:
            self.close()
            raise ConnectionError(f"the stager went away: {e}") from None
        if not line:
            self.close()
            raise ConnectionError("the stager went away")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        for part in (getattr(self, "_file", None), getattr(self, "_sock", None)):
            if part is not None:  # (None: __init__ failed)
                with contextlib.suppress(OSError):
                    part.close()

    def __del__(self) -> None:  # a handle dropped, or its thread gone
        self.close()
