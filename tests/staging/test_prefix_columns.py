"""An object prefix of a few thousand keys (issue 38): listed a page of 1,000 keys at a
time, planned in a listing's columns (no entry object per key), staged, re-staged with
nothing fetched, and a changed key alone fetched again; a real S3 server on loopback
(tests/sources/s3server.py) behind the counting proxy."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.staging.columns import FileTable
from fastload.staging.state import read_manifest

pytestmark = pytest.mark.slow


def _keys(n: int) -> dict[str, bytes]:
    """``n`` keys: one folder of 2,500 (three pages of a listing), the rest spread over
    nested folders, odd names among them; sizes 0 to a few KiB."""
    out = {}
    for i in range(n):
        folder = "big" if i < 2500 else f"n{i % 5}/m{i % 3}"
        out[f"{folder}/k{i:05d} x.bin"] = (b"%d;" % i) * (i % 700)
    out["top é.txt"] = b"at the top"
    return out


def test_a_prefix_of_thousands_of_keys_stages_and_restages(
    s3: Any, bucket: str, proxy: Any, tmp_path: Path
) -> None:
    from sources.s3server import tree_of, upload

    files = _keys(3200)
    upload(s3, bucket, files)
    out = tmp_path / "out"
    proxy.reset_counts()
    r = fastload.stage(f"s3://{bucket}/", out)
    assert (r.files, r.copied_files, r.skipped) == (len(files), len(files), False)
    assert r.bytes == sum(map(len, files.values()))
    assert tree_of(out) == files
    assert proxy.requests["LIST"] >= 3  # the folder of 2,500 keys is three pages
    assert proxy.gets() == sum(1 for v in files.values() if v)
    m = read_manifest(out)
    assert m is not None
    table: FileTable = m["files"]
    assert list(table) == sorted(files, key=os.fsencode)
    assert fastload.verify(out).ok

    proxy.reset_counts()
    again = fastload.stage(f"s3://{bucket}/", out)
    assert (again.skipped, again.copied_files, again.files) == (True, 0, len(files))
    assert proxy.gets() == 0

    # The same size, another content (another ETag); one key gone; one new.
    client = s3.client()
    key = "big/k01234 x.bin"
    files[key] = bytes(b ^ 1 for b in files[key])
    client.put_object(Bucket=bucket, Key=key, Body=files[key])
    client.delete_object(Bucket=bucket, Key="n1/m1/k02506 x.bin")
    del files["n1/m1/k02506 x.bin"]
    files["new/one.bin"] = b"new"
    client.put_object(Bucket=bucket, Key="new/one.bin", Body=b"new")
    proxy.reset_counts()
    third = fastload.stage(f"s3://{bucket}/", out)
    assert (third.copied_files, third.files, third.skipped) == (2, len(files), False)
    assert proxy.gets() == 2
    assert tree_of(out) == files
    assert fastload.verify(out).ok
