"""What the README promises of the object-store settings and retries, and no other test
checked (issue 51): settings from four places with conflicting values, the later place
winning (the fastload configuration file < the AWS profile < the environment <
``storage_options``); ``AWS_ENDPOINT_URL_S3`` over ``AWS_ENDPOINT_URL``;
``AWS_DEFAULT_REGION`` (and ``AWS_REGION`` over it); the retries' defaults (8 at most,
within 120 s). The settings are read off the requests the real client sends: each
endpoint is a small server of the test's own on loopback that records the request's
Authorization header (its credential scope names the key and the region) and refuses it."""

from __future__ import annotations

import os
import re
import socket
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import fastload
from fastload.sources import retry
from fastload.sources.retry import RetryCounts, Tries
from kit.tools import require_module

_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
           b"<Message>Access Denied</Message></Error>")  # fmt: skip


class Recorder:
    """An HTTP endpoint on loopback that answers every request 403 AccessDenied (never
    retried) and keeps each request's credential scope: (key id, region)."""

    def __init__(self) -> None:
        self.scopes: list[tuple[str, str]] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    more = conn.recv(65536)
                    if not more:
                        break
                    head += more
                m = re.search(rb"Credential=([^/]+)/\d{8}/([^/]+)/s3/aws4_request", head)
                if m:
                    self.scopes.append((m.group(1).decode(), m.group(2).decode()))
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n"
                             b"Connection: close\r\nContent-Length: "
                             + str(len(_DENIED)).encode() + b"\r\n\r\n" + _DENIED)  # fmt: skip

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def endpoints() -> Iterator[list[Recorder]]:
    """Four recorders: one per place a setting can come from."""
    rs = [Recorder() for _ in range(4)]
    yield rs
    for r in rs:
        r.close()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No AWS variable but the metadata switch; the profile files and the fastload
    configuration file in tmp_path (empty until a test writes them)."""
    require_module("obstore", "the s3 extra (obstore) is not installed")
    for k in list(os.environ):
        if k.startswith("AWS_") and k != "AWS_EC2_METADATA_DISABLED":
            monkeypatch.delenv(k)
    for name in ("credentials", "config", "fastload.toml"):
        (tmp_path / name).write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("FASTLOAD_CONFIG", str(tmp_path / "fastload.toml"))
    return tmp_path


def _attempt(tmp_path: Path, options: dict[str, str] | None = None) -> None:
    with pytest.raises(PermissionError):
        fastload.stage("s3://bucket/p/", tmp_path / "out", storage_options=options)


def test_later_places_win_with_conflicting_values(clean_env: Path, endpoints: list[Recorder],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each place names its own endpoint, key and region; the request goes where the
    latest place says, signed with its key and region. Taking the latest place away, the
    one before it wins, down to the configuration file."""
    site, profile, env, options = endpoints
    (clean_env / "fastload.toml").write_text(
        f'[storage.s3]\nendpoint_url = "{site.endpoint}"\naccess_key_id = "site-key"\n'
        'secret_access_key = "s"\nregion = "site-region"\n')  # fmt: skip
    (clean_env / "credentials").write_text(
        "[default]\naws_access_key_id = profile-key\naws_secret_access_key = s\n")
    (clean_env / "config").write_text(
        f"[default]\nendpoint_url = {profile.endpoint}\nregion = profile-region\n")
    for k, v in {"AWS_ENDPOINT_URL": env.endpoint, "AWS_ACCESS_KEY_ID": "env-key",
                 "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "env-region"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    opts = {"endpoint_url": options.endpoint, "access_key_id": "options-key",
            "secret_access_key": "s", "region": "options-region"}  # fmt: skip
    _attempt(clean_env, opts)
    _attempt(clean_env)  # no storage_options: the environment's
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.delenv(k)
    _attempt(clean_env)  # no environment: the profile's
    (clean_env / "credentials").write_text("")
    (clean_env / "config").write_text("")
    _attempt(clean_env)  # no profile: the configuration file's
    assert [r.scopes for r in (options, env, profile, site)] == [
        [("options-key", "options-region")],
        [("env-key", "env-region")],
        [("profile-key", "profile-region")],
        [("site-key", "site-region")],
    ]


def test_the_s3_endpoint_variable_over_the_general_one(
    clean_env: Path, endpoints: list[Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_only, general = endpoints[:2]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT_URL", general.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_only.endpoint)
    _attempt(clean_env)
    assert len(s3_only.scopes) == 1 and general.scopes == []
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    _attempt(clean_env)
    assert len(general.scopes) == 1


def test_the_default_region_variable(clean_env: Path, endpoints: list[Recorder],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS_DEFAULT_REGION signs the requests; AWS_REGION, where set too, wins."""
    server = endpoints[0]
    for k, v in {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "k",
                 "AWS_SECRET_ACCESS_KEY": "s",
                 "AWS_DEFAULT_REGION": "eu-west-3"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    _attempt(clean_env)
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    _attempt(clean_env)
    assert server.scopes == [("k", "eu-west-3"), ("k", "ap-south-1")]


def test_retries_default_to_8_within_120_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy every request gets when none is given (objstore's): 8 retries of a 503
    and then the error; and no retry whose wait would end past 120 s from the first
    attempt (the retry module's clock set by the test, so that nothing waits and the
    bound is checked within 10 ms: the first wait is 50 ms)."""
    ox = require_module("obstore.exceptions", "the s3 extra (obstore) is not installed")
    error = ox.GenericError("status code: 503 Service Unavailable")

    class Raised(Exception):
        pass

    tries = Tries(RetryCounts(), lambda e, n: Raised(n))
    waits = []
    with pytest.raises(Raised) as e:
        while True:
            waits.append(tries.wait_after(error))
    assert len(waits) == 8 and e.value.args == (8,)
    now = [1000.0]
    monkeypatch.setattr(retry, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    on_time = Tries(RetryCounts(), lambda e, n: Raised(n), started=1000.0)
    now[0] = 1000.0 + 119.94  # the wait ends 10 ms before 120 s
    assert on_time.wait_after(error) == 0.05
    late = Tries(RetryCounts(), lambda e, n: Raised(n), started=1000.0)
    now[0] = 1000.0 + 119.96  # it would end 10 ms after
    with pytest.raises(Raised):
        late.wait_after(error)
