"""A partial http(s) download resumes with a Range request (If-Range: the version it
started with) instead of starting over; a file changed meanwhile is fetched whole."""

from __future__ import annotations

import hashlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from kit.tools import require_module


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = root
        self.cut_next = 0  # bytes after which the next GET's body stops (0: whole)
        self.ranges: list[str | None] = []  # the Range header of each GET

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

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


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    root = tmp_path / "www"
    root.mkdir()
    srv = _Server(root)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(10)


@pytest.mark.parametrize("backend", ["urllib", "fsspec"])
def test_cut_download_resumes_from_where_it_stopped(
    server: _Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    if backend == "fsspec":
        require_module("fsspec")
        require_module("aiohttp")
    monkeypatch.setenv("FASTLOAD_HTTP", backend)
    data = bytes(range(256)) * 40_000  # ~10 MB
    (server.root / "blob.bin").write_bytes(data)
    want = f"sha256:{hashlib.sha256(data).hexdigest()}"
    server.cut_next = 3_000_000
    with pytest.raises(OSError, match=r"blob\.bin"):
        fastload.resolve(sources=[server.url("blob.bin")], cache=tmp_path / "cache",
                         destination=tmp_path / "out", checksum=want)  # fmt: skip
    got = fastload.resolve(sources=[server.url("blob.bin")], cache=tmp_path / "cache",
                           destination=tmp_path / "out", checksum=want)  # fmt: skip
    assert got.read_bytes() == data
    # The second GET asks only for what the first did not write (a stream may lose what
    # it had buffered when the connection broke).
    first, second = server.ranges
    assert first is None and second is not None
    offset = int(second.removeprefix("bytes=").rstrip("-"))
    assert 0 < offset <= 3_000_000
    assert not list((tmp_path / "cache").rglob("*.part*"))


def test_changed_file_is_fetched_whole(
    server: _Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLOAD_HTTP", "urllib")
    (server.root / "blob.bin").write_bytes(b"a" * 2_000_000)
    server.cut_next = 500_000
    with pytest.raises(OSError):
        fastload.resolve(sources=[server.url("blob.bin")], cache=tmp_path / "cache",
                         destination=tmp_path / "out")  # fmt: skip
    new = b"b" * 2_500_000
    (server.root / "blob.bin").write_bytes(new)
    got = fastload.resolve(sources=[server.url("blob.bin")], cache=tmp_path / "cache",
                           destination=tmp_path / "out")  # fmt: skip
    assert got.read_bytes() == new  # If-Range did not match: the whole new file
    assert server.ranges[-1] == "bytes=500000-"
