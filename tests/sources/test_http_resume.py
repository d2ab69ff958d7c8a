"""A partial http(s) download resumes with a Range request (If-Range: the version it
started with) instead of starting over; a file changed meanwhile is fetched whole."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import fastload
from kit.tools import require_module
from kit.web import WebServer


@pytest.mark.parametrize("backend", ["urllib", "fsspec"])
def test_cut_download_resumes_from_where_it_stopped(
    server: WebServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
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
    first, second = server.range_headers
    assert first is None and second is not None
    offset = int(second.removeprefix("bytes=").rstrip("-"))
    assert 0 < offset <= 3_000_000
    assert not list((tmp_path / "cache").rglob("*.part*"))


def test_changed_file_is_fetched_whole(
    server: WebServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
    assert server.range_headers[-1] == "bytes=500000-"
