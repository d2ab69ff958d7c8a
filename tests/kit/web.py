"""A web server on loopback for the http(s) tests: the files of a folder, with what the
tests of downloads, resumes and ranged reads need from a real server.

- ``ETag`` (an MD5 of the content); ``Range`` (``bytes=a-`` and ``bytes=a-b``) served as
  206 while ``If-Range`` is absent or names the current ETag, unless ``serve_ranges`` is
  off (then every GET gets the whole body, as from a server without range support);
- names URL-quoted (:meth:`WebServer.url`); a missing file is a 404;
- what was asked: ``range_headers`` (each GET's ``Range``, or None), ``gets`` (GETs per
  name), ``sent`` (body bytes sent);
- faults: ``cut_next`` (the next GET's body stops after that many bytes), ``slow`` (that
  many GETs are sent 64 KiB every 50 ms; ``sending`` is set once one has sent some).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["WebServer", "serving"]

_STEP = 64 << 10


class WebServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, *, serve_ranges: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.serve_ranges = serve_ranges
        self.cut_next = 0  # bytes after which the next GET's body stops (0: whole)
        self.slow = 0  # how many GETs are served slowly
        self.sending = threading.Event()  # set once a slow GET has sent some data
        self.range_headers: list[str | None] = []  # the Range header of each GET
        self.gets: Counter[str] = Counter()
        self.sent = 0
        self.lock = threading.Lock()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{urllib.parse.quote(name)}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: WebServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, *, body: bool) -> None:
        srv = self.server
        name = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        path = srv.root / name
        if not name or not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        etag = '"' + hashlib.md5(data).hexdigest() + '"'
        wanted = self.headers.get("Range")
        start, end = 0, len(data)
        if wanted and srv.serve_ranges and self.headers.get("If-Range") in (None, etag):
            a, _, b = wanted.removeprefix("bytes=").partition("-")
            start, end = int(a), min(len(data), int(b) + 1) if b else len(data)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", etag)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if not body:
            return
        with srv.lock:
            srv.range_headers.append(wanted)
            srv.gets[name] += 1
            slow = srv.slow > 0
            srv.slow -= slow
            cut, srv.cut_next = srv.cut_next, 0
        rest = memoryview(data)[start:end]
        if cut:
            rest = rest[:cut]
        try:
            for i in range(0, len(rest), _STEP):
                self.wfile.write(rest[i:i + _STEP])
                with srv.lock:
                    srv.sent += len(rest[i:i + _STEP])
                if slow:
                    self.wfile.flush()
                    srv.sending.set()
                    time.sleep(0.05)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (killed by the test)
        self.close_connection = True


@contextlib.contextmanager
def serving(root: Path, *, serve_ranges: bool = True) -> Iterator[WebServer]:
    """A :class:`WebServer` of ``root`` on a free port, for the ``with`` block."""
    srv = WebServer(root, serve_ranges=serve_ranges)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)
