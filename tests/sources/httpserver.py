"""A web server on loopback for the http(s) tests: files of a folder, with ETag, Range
and If-Range (a range is served only while If-Range names the file's current ETag),
and a body that can be cut short once (``cut_next``)."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class WebServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.cut_next = 0  # bytes after which the next GET's body stops (0: whole)
        self.ranges: list[str | None] = []  # the Range header of each GET

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: WebServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, *, body: bool) -> None:
        data = (self.server.root / self.path.lstrip("/")).read_bytes()
        etag = '"' + hashlib.md5(data).hexdigest() + '"'
        wanted = self.headers.get("Range")
        if body:
            self.server.ranges.append(wanted)
        start = 0
        if wanted and self.headers.get("If-Range") in (None, etag):
            start = int(wanted.removeprefix("bytes=").split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("ETag", etag)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        if not body:
            return
        rest = data[start:]
        if self.server.cut_next:
            rest, self.server.cut_next = rest[: self.server.cut_next], 0
        self.wfile.write(rest)
        self.wfile.flush()
        self.close_connection = True


@contextlib.contextmanager
def serving(root: Path) -> Iterator[WebServer]:
    srv = WebServer(root)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(10)
