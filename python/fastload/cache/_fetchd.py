"""Object-store requests from processes forked after obstore was used.

obstore runs its requests on a tokio runtime whose threads a ``fork()`` does not copy: in
a forked child (a DataLoader worker, by default) every request hangs for ever, even on a
store made after the fork. Such a process hands its downloads and ranged reads to a
process whose runtime works, one connection per thread that asks:

- the process it was forked from, when that one serves forks (:func:`serve_forks`, which
  the remote datasets call where they are made): a listener thread there (a Unix socket
  in a private folder, with a random key the children inherit) and one thread per
  connection. No process to start: a worker's first request is answered at once.
- else a helper started fresh (``python -c`` running :func:`main`, 0.4 s to start),
  which dies with the thread that started it (``PR_SET_PDEATHSIG``) and on end of input.

Either way downloads are written straight into the cache, with the cache's locks (so a
server killed mid-download leaves what any killed downloader leaves), and a worker that
dies mid-request leaves its download to finish (the next reader finds it cached).

A process that never forked after using obstore uses it directly (:func:`forked`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from ..errors import SourceChangedError, stage_error

__all__ = ["Helper", "forked", "helper", "serve_forks"]

_forked = False
#: This process's listener for its forked children, or the one inherited from an
#: ancestor: (address, key, pid of the server).
_server: tuple[str, bytes, int] | None = None
_server_lock = threading.Lock()
_listener: Listener | None = None

# The helper's start: the package without its facade (fastload/__init__.py imports every
# part; the helper needs the cache and the sources only: 0.4 s to start instead of 1.4).
_BOOT = """
import sys, types
pkg = types.ModuleType("fastload")
pkg.__path__ = [sys.argv[1]]
sys.modules["fastload"] = pkg
from fastload.cache import _fetchd
_fetchd.main(sys.argv[2:])
"""


def _after_fork_in_child() -> None:
    global _forked, _listener
    if "obstore" in sys.modules:
        _forked = True
    if _listener is not None:
        # The child must not keep the server's socket listening: once the server is
        # gone, a connection would wait in its backlog for ever instead of being refused.
        # (Its socket file is removed by the server's process only.)
        with contextlib.suppress(OSError):
            _listener.close()
        _listener = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked() -> bool:
    """Whether this process was forked from one that had obstore loaded (its runtime may
    be the parent's, whose threads are gone)."""
    return _forked


class _Link:
    """Two connections to whatever serves this thread's requests, one request at a time."""

    _send: Connection
    _recv: Connection

    def call(self, *request: Any) -> Any:
        """Runs ``request`` where it is served, with this process's site defaults for
        object stores (the configuration file's, which a helper does not read)."""
        from ..sources.objstore import SCHEMES
        from ..sources.settings import site_options

        site = {s: site_options(s) for s in SCHEMES}
        try:
            self._send.send((site, *request))
            reply = self._recv.recv()
        except (EOFError, OSError) as e:
            raise stage_error(errno.EIO, "the process serving this one's object-store "
                              f"requests is gone: {e}", str(request[1])) from None
        if reply[0] == "ok":
            return reply[1]
        _, kind, err, message, path = reply
        cls = SourceChangedError if kind == "SourceChangedError" else None
        if kind == "ValueError":
            raise ValueError(message)
        if cls is not None:
            raise stage_error(err or errno.EIO, message, path, cls)
        raise stage_error(err or errno.EIO, message, path)

    def close(self) -> None:
        self._send.close()
        self._recv.close()


class Helper(_Link):
    """A helper process and its two pipes."""

    def __init__(self) -> None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, pkg, str(to_r), str(from_w), str(os.getpid())],
            pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL,
        )
        os.close(to_r)
        os.close(from_w)
        self._send = Connection(to_w, readable=False)
        self._recv = Connection(from_r, writable=False)

    def close(self) -> None:
        super().close()
        self._proc.wait()


class _Served(_Link):
    """A connection to an ancestor's listener (:func:`serve_forks`)."""

    def __init__(self, address: str, key: bytes) -> None:
        conn = Client(address, "AF_UNIX", authkey=key)
        self._send = self._recv = conn

    def close(self) -> None:
        self._send.close()


_local = threading.local()


def helper() -> _Link:
    """This thread's link (made on first use, again after a fork): to the ancestor that
    serves forks, if any answers, else to a helper process started now."""
    h = getattr(_local, "helper", None)
    if h is None or getattr(_local, "pid", None) != os.getpid():
        h = None
        server = _server
        if server is not None and server[2] != os.getpid():
            try:
                h = _Served(server[0], server[1])
            except (OSError, EOFError):  # gone (or not ours): a helper of our own
                h = None
        if h is None:
            h = Helper()
        _local.helper, _local.pid = h, os.getpid()
    return h


def serve_forks() -> None:
    """Serves the requests of the processes forked from this one from now on (DataLoader
    workers), with this process's runtime: a listener thread, started once. Nothing in a
    process that is itself forked after obstore was used (its children use its ancestor's
    server, or helpers)."""
    global _server, _listener
    if _forked:
        return
    with _server_lock:
        if _server is not None and _server[2] == os.getpid():
            return
        key = os.urandom(32)
        # address None: a socket file in a folder of multiprocessing's, private (0700)
        # and removed at exit; the key keeps out any other process of this user.
        listener = Listener(None, "AF_UNIX", backlog=64, authkey=key)
        threading.Thread(target=_accept, args=(listener,), name="fastload-fork-server",
                         daemon=True).start()
        _server, _listener = (str(listener.address), key, os.getpid()), listener


def _accept(listener: Listener) -> None:
    while True:
        try:
            conn = listener.accept()
        except OSError:
            return  # closed
        except Exception:  # a client that failed the handshake
            continue
        threading.Thread(target=_serve, args=(conn, conn, False), name="fastload-fork-serve",
                         daemon=True).start()


# --- the helper's side -------------------------------------------------------------------


def _serve(recv: Connection, send: Connection, helper_process: bool) -> None:
    """Answers ``recv``'s requests on ``send`` until end of input. A helper process takes
    the site defaults each request carries; a server is the process they come from."""
    from .store import ByUrl, CacheEntry, ShardCache, store_fetcher

    def store(url: str, options: dict[str, Any]) -> Any:
        from ..sources import store_for
        from ..sources.objstore import split_url

        scheme, bucket, _ = split_url(url)
        return store_for(f"{scheme}://{bucket}/", options)

    while True:
        try:
            site, *req = recv.recv()
        except (EOFError, OSError):
            recv.close()
            return
        try:
            if helper_process:
                from ..sources.settings import set_site_loader

                set_site_loader(functools.partial(dict, site))
            if req[0] == "download":
                _, root, limit, (url, etag, size), wait, keep_free, options = req
                cache = ShardCache(root, limit)
                entry = CacheEntry(url, etag, size)
                by_url = ByUrl(functools.partial(store, options=options))
                out: Any = cache._download(entry, store_fetcher(by_url, str), wait, keep_free)
            elif req[0] == "range":
                _, url, start, end, etag, options = req
                by_url = ByUrl(functools.partial(store, options=options))
                out = bytes(by_url.get_range(url, start, end, etag))
            else:
                raise ValueError(f"unknown request {req[0]!r}")
            reply: tuple[Any, ...] = ("ok", out)
        except Exception as e:
            err = e.errno if isinstance(e, OSError) else None
            path = getattr(e, "filename", None) or ""
            reply = ("err", type(e).__name__ if not isinstance(e, SourceChangedError)
                     else "SourceChangedError", err, str(e), str(path))
        try:
            send.send(reply)
        except OSError:  # the asker is gone (a worker killed): its download is done
            recv.close()
            return


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the thread that started us exits (Linux); gone already: exit."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def main(argv: list[str]) -> None:
    """The helper: ``READ_FD WRITE_FD PARENT_PID``."""
    _die_with_parent(int(argv[2]))
    _serve(Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False),
           True)
