"""A server that accepts connections and never answers (issue 50): said within a few
seconds, failed within the answer limit naming the endpoint, the limit a setting
(FASTLOAD_STORE_TIMEOUT). The server is a loopback socket that accepts and sends
nothing; it needs no S3 server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")


@pytest.fixture
def silent() -> Iterator[tuple[str, list[socket.socket]]]:
    """An endpoint that accepts every connection and never sends a byte; the accepted
    connections, held open."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}", held
    srv.close()
    for c in held:
        c.close()


def _env(endpoint: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_REGION="us-east-1",
               AWS_ENDPOINT_URL=endpoint, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
               AWS_CONFIG_FILE=os.devnull, **more)  # fmt: skip
    return env


@pytest.mark.parametrize("url", ["s3://bkt/prefix/", "s3://bkt/one.tar"])
def test_a_silent_server_is_said_then_named(
    silent: tuple[str, list[socket.socket]], tmp_path: Path, url: str
) -> None:
    endpoint, held = silent
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "fastload", "stage", "--no-progress", url, str(out)],
        capture_output=True, text=True, timeout=120,
        env=_env(endpoint, FASTLOAD_STORE_TIMEOUT="5"),
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    # first a line saying the endpoint is not answering, then the error naming it
    assert any(f"{endpoint} is not answering" in line for line in lines[:-1]), r.stderr
    assert endpoint in lines[-1] and url in lines[-1]
    assert "did not answer within 5 s" in lines[-1] and "FASTLOAD_STORE_TIMEOUT" in lines[-1]
    assert "Traceback" not in r.stderr
    assert held  # it did connect: the server was reached, and said nothing
    assert not out.exists()


def test_the_limit_is_checked(silent: tuple[str, list[socket.socket]], tmp_path: Path) -> None:
    endpoint, _ = silent
    r = subprocess.run(
        [sys.executable, "-m", "fastload", "stage", "s3://bkt/p/", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
        env=_env(endpoint, FASTLOAD_STORE_TIMEOUT="soon"),
    )  # fmt: skip
    assert r.returncode == 1 and "FASTLOAD_STORE_TIMEOUT" in r.stderr and "'soon'" in r.stderr


def test_a_silent_metadata_service_is_named_not_the_store(
    silent: tuple[str, list[socket.socket]], tmp_path: Path
) -> None:
    """No keys set: the first request asks the instance metadata service for credentials
    before the store. A metadata service that never answers is what the line names, not
    the store (here one that refuses every connection and was never asked)."""
    metadata, held = silent
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull,
               AWS_METADATA_ENDPOINT=metadata, FASTLOAD_STORE_TIMEOUT="5")  # fmt: skip
    store = "http://127.0.0.1:9"
    r = subprocess.run(
        [sys.executable, "-m", "fastload", "stage", "--no-progress", "s3://bkt/prefix/",
         str(tmp_path / "out"), "--endpoint-url", store],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    *before, last = r.stderr.strip().splitlines()
    assert any(f"the instance metadata service ({metadata}), asked for credentials" in line
               and store in line for line in before), r.stderr  # fmt: skip
    assert f"{store} is not answering" not in r.stderr
    assert "no credentials found for 's3://bkt/prefix/'" in last and "not contacted" in last
    assert held  # the client did ask it
    assert not (tmp_path / "out").exists()
