"""Messy buckets (issue 50): keys that clash, and what the filters do about it. A real S3
server (SeaweedFS) on loopback; the keys are written by the test, as given."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from s3server import S3Server, tree_of, upload

import fastload

pytestmark = pytest.mark.slow


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fastload", *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))  # fmt: skip


def _put(s3: S3Server, bucket: str, files: dict[str, bytes]) -> None:
    """Each key as given (boto3: no path parsing on the client's side)."""
    client = s3.client()
    for key, data in files.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)


# --- 1: filters before the clash check ---------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "staged"),
    [
        (["--exclude", "q/a"], {"a/b": b"under", "c": b"c"}),
        (["--exclude", "q/a/b"], {"a": b"file", "c": b"c"}),
        (["--exclude", "q/a/*"], {"a": b"file", "c": b"c"}),
        (["--include", "q/c"], {"c": b"c"}),
    ],
)
def test_a_clash_left_out_by_the_filters_is_none(
    s3: S3Server, bucket: str, tmp_path: Path, flags: list[str], staged: dict[str, bytes]
) -> None:
    upload(s3, bucket, {"q/a": b"file", "q/a/b": b"under", "q/c": b"c"})
    url = f"s3://{bucket}/"
    # patterns are relative to the staged prefix: stage the bucket, keys q/...
    r = _cli("stage", "--no-progress", url, str(tmp_path / "all"))
    assert r.returncode == 1 and "'q/a' and 'q/a/b'" in r.stderr, r.stderr
    suggested = re.search(r"--exclude '([^']+)'", r.stderr)
    assert suggested is not None and suggested.group(1) == "q/a"
    out = tmp_path / "out"
    r = _cli("stage", "--no-progress", *flags, url, str(out))
    assert r.returncode == 0, r.stderr
    assert tree_of(out) == {f"q/{k}": v for k, v in staged.items()}


def test_the_suggested_exclude_works(s3: S3Server, bucket: str, tmp_path: Path) -> None:
    upload(s3, bucket, {"q/a": b"file", "q/a/b": b"under", "q/c": b"c"})
    url = f"s3://{bucket}/q/"
    with pytest.raises(FileExistsError, match=r"--exclude '([^']+)'") as e:
        fastload.stage(url, tmp_path / "x")
    m = re.search(r"--exclude '([^']+)'", str(e.value))
    assert m is not None
    out = tmp_path / "out"
    fastload.stage(url, out, exclude=[m.group(1)])
    assert tree_of(out) == {"a/b": b"under", "c": b"c"}
