"""Object-store requests from processes forked after obstore was used.

obstore runs its requests on a tokio runtime whose threads a ``fork()`` does not copy: in
a forked child (a DataLoader worker, by default) every request of the inherited runtime
hangs for ever. Such a process hands its downloads and ranged reads to a helper started
fresh (``python -c`` running :func:`main`), one per thread that asks, which runs them
with its own runtime and writes downloads straight into the cache, with the cache's
locks (so a helper killed mid-download leaves what any killed downloader leaves). The
helper dies with the thread that started it (``PR_SET_PDEATHSIG``) and on end of input.

A process that never forked after using obstore uses it directly (:func:`forked`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from ..errors import SourceChangedError, stage_error

__all__ = ["Helper", "forked", "helper"]

_forked = False

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
    global _forked
    if "obstore" in sys.modules:
        _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked() -> bool:
    """Whether this process was forked from one that had obstore loaded (its runtime may
    be the parent's, whose threads are gone)."""
    return _forked


class Helper:
    """A helper process and its two pipes; requests go one at a time."""

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

    def call(self, *request: Any) -> Any:
        """Runs ``request`` in the helper, with this process's site defaults for object
        stores (the configuration file's, which the helper does not read)."""
        from ..sources.objstore import SCHEMES, site_options

        site = {s: site_options(s) for s in SCHEMES}
        try:
            self._send.send((site, *request))
            reply = self._recv.recv()
        except (EOFError, OSError) as e:
            raise stage_error(errno.EIO, f"fastload's object-store helper process died: {e}",
                              str(request[1])) from None
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
        self._proc.wait()


_local = threading.local()


def helper() -> Helper:
    """This thread's helper (started on first use, again after a fork)."""
    h = getattr(_local, "helper", None)
    if h is None or getattr(_local, "pid", None) != os.getpid():
        h = Helper()
        _local.helper, _local.pid = h, os.getpid()
    return h


# --- the helper's side -------------------------------------------------------------------


def _serve(rfd: int, wfd: int) -> None:
    from .store import CacheEntry, ShardCache, store_fetcher

    recv = Connection(rfd, writable=False)
    send = Connection(wfd, readable=False)
    stores: dict[tuple[str, str], Any] = {}

    def store(url: str, options: dict[str, Any]) -> Any:
        from ..sources.objstore import ObjectStore, split_url

        scheme, bucket, _ = split_url(url)
        key = (f"{scheme}://{bucket}/", repr(sorted(options.items())))
        if key not in stores:
            stores[key] = ObjectStore(key[0], options)
        return stores[key]

    class _ByUrl:
        def __init__(self, options: dict[str, Any]) -> None:
            self.options = options

        def get(self, url: str, etag: str | None) -> Any:
            from ..sources.objstore import split_url
            return store(url, self.options).get(split_url(url)[2], etag)

        def get_range(self, url: str, start: int, end: int, etag: str | None) -> Any:
            from ..sources.objstore import split_url
            return store(url, self.options).get_range(split_url(url)[2], start, end, etag)

    while True:
        try:
            site, *req = recv.recv()
        except (EOFError, OSError):
            return
        try:
            from ..sources.objstore import set_site_loader

            set_site_loader(functools.partial(dict, site))
            if req[0] == "download":
                _, root, limit, (url, etag, size), wait, options = req
                cache = ShardCache(root, limit)
                entry = CacheEntry(url, etag, size)
                out: Any = cache._download(entry, store_fetcher(_ByUrl(options), str), wait)
            elif req[0] == "range":
                _, url, start, end, etag, options = req
                out = bytes(_ByUrl(options).get_range(url, start, end, etag))
            else:
                raise ValueError(f"unknown request {req[0]!r}")
            send.send(("ok", out))
        except Exception as e:
            err = e.errno if isinstance(e, OSError) else None
            path = getattr(e, "filename", None) or ""
            send.send(("err", type(e).__name__ if not isinstance(e, SourceChangedError)
                       else "SourceChangedError", err, str(e), str(path)))


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
    _serve(int(argv[0]), int(argv[1]))
