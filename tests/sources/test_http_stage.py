"""stage() and ``fastload stage`` of http(s):// URLs (issue 50): a file and an archive on
a web server on loopback, resumed after a cut with Range and If-Range, a checksum
checked, a missing one named by its URL as given."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from s3server import tree_of

import fastload
from kit.web import WebServer


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fastload", *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))  # fmt: skip


FILES = {"a.txt": b"alpha" * 1000, "d/b.bin": bytes(range(256)) * 4000}


def test_cli_stages_an_archive_url(server: WebServer, tmp_path: Path) -> None:
    (server.root / "x.tar").write_bytes(_tar(FILES))
    out = tmp_path / "out"
    r = _cli("stage", "--no-progress", server.url("x.tar"), str(out))
    assert r.returncode == 0, r.stderr
    assert tree_of(out) == FILES
    assert fastload.verify(out).ok
    assert not list(tmp_path.glob(".*fastload-http*"))  # the download is gone once staged


def test_stage_of_a_file_url_resumes_after_a_cut(
    server: WebServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLOAD_HTTP", "urllib")
    data = bytes(range(256)) * 20_000  # 5 MB, not an archive
    (server.root / "blob.bin").write_bytes(data)
    want = f"sha256:{hashlib.sha256(data).hexdigest()}"
    out = tmp_path / "out"
    out.mkdir()
    server.cut_next = 2_000_000
    with pytest.raises(OSError, match=r"http://127\.0\.0\.1:\d+/blob\.bin"):
        fastload.stage(server.url("blob.bin"), out, checksum=want)
    r = fastload.stage(server.url("blob.bin"), out, checksum=want)
    assert (out / "blob.bin").read_bytes() == data and r.files == 1
    first, second = server.range_headers
    assert first is None and second is not None and second != "bytes=0-"
    with pytest.raises(OSError, match="checksum mismatch"):
        fastload.stage(server.url("blob.bin"), tmp_path / "other", checksum="sha256:" + "0" * 64)
    assert not (tmp_path / "other").exists()


def test_a_changed_file_is_fetched_whole(
    server: WebServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASTLOAD_HTTP", "urllib")
    (server.root / "x.tar").write_bytes(_tar(FILES))
    server.cut_next = 20_000
    with pytest.raises(OSError):
        fastload.stage(server.url("x.tar"), tmp_path / "out")
    new = {"c.txt": b"new content" * 5000}
    (server.root / "x.tar").write_bytes(_tar(new))
    fastload.stage(server.url("x.tar"), tmp_path / "out")
    assert tree_of(tmp_path / "out") == new  # If-Range did not match: the whole new file
    assert server.range_headers[-1] == "bytes=20000-"


@pytest.mark.parametrize("backend", ["urllib", "fsspec"])
def test_a_missing_url_is_named_as_given(server: WebServer, tmp_path: Path, backend: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTLOAD_HTTP", backend)
    url = server.url("nope/x.tar")
    r = _cli("stage", "--no-progress", url, str(tmp_path / "out"))
    assert r.returncode == 1
    assert f"'{url}'" in r.stderr and "404" in r.stderr, r.stderr
    assert "http:/1" not in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
