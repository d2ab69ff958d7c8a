"""An object prefix of a few thousand keys (issue 38): listed a page of 1,000 keys at a
time, planned in a listing's columns (no entry object per key), staged, re-staged with
nothing fetched, and a changed key alone fetched again; a real S3 server on loopback
(tests/sources/s3server.py) behind the counting proxy."""

from __future__ import annotations

import json
import os
import tracemalloc
from array import array
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.sources.objlist import compact_identity
from fastload.sources.objstore import ObjectStore
from fastload.staging.columns import FileTable
from fastload.staging.state import read_manifest, state_dir

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
    # Each key's identity is its row's tag in the table (an MD5's ETag: its 16 bytes),
    # not a string per key in manifest.json.
    assert "objects" not in m and table.tags is not None
    etag = s3.client().head_object(Bucket=bucket, Key="top é.txt")["ETag"]
    assert table.tag(table.find("top é.txt")) == compact_identity(etag)
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


def _planned_peak(url: str, dst: Path) -> tuple[int, int]:
    """The peak of Python's traced memory while ``url`` is listed and planned against
    ``dst`` (what stage() does before its first GET), and the files planned."""
    from fastload.staging.api import open_source
    from fastload.staging.request import StageRequest

    req = StageRequest.make()
    tracemalloc.start()
    try:
        source, dest = open_source(url, dst, req)
        with dest.locked():
            plan = source.plan(req, dest)  # type: ignore[attr-defined]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, len(plan.files)


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_listing_and_planning_a_prefix_hold_no_object_per_key(
    s3: Any, bucket: str, tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes per key above a fixed base (the clients; the listing pages in flight, a page
    of 1,000 keys' metadata per folder listed at once): the peak of listing and planning
    the big prefix less that of the small one, per key added (in the tree, two folders,
    each of more than a page in both, listed one after the other). A list of ObjectInfo
    (plus a name per key) took about 900 bytes per key."""
    from sources.s3server import upload

    small, big = (1200, 5000) if layout == "flat" else (2200, 6000)
    # The folders listed one at a time: the pages in hand at the peak, a fixed base, do
    # not then depend on how the listings' threads happened to overlap.
    monkeypatch.setattr("fastload.sources.listing.LIST_IN_FLIGHT", 1)

    def keys(name: str, n: int) -> dict[str, bytes]:
        folder = (lambda i: "") if layout == "flat" else (lambda i: f"f{i % 2}/")
        return {f"{name}/{folder(i)}key {i:06d}.bin": b"x" for i in range(n)}

    upload(s3, bucket, {**keys("small", small), **keys("big", big)})
    _planned_peak(f"s3://{bucket}/small/", tmp_path / "warm")  # clients, imports
    low, n_low = _planned_peak(f"s3://{bucket}/small/", tmp_path / "small")
    high, n_high = _planned_peak(f"s3://{bucket}/big/", tmp_path / "big")
    assert (n_low, n_high) == (small, big)
    per_key = (high - low) / (big - small)
    assert per_key < 200, f"{per_key:.0f} bytes per key ({low}, {high})"


def test_a_manifest_of_the_older_version_still_tells_changed_objects(
    s3: Any, bucket: str, proxy: Any, tmp_path: Path
) -> None:
    """A manifest written before identities became the table's tags (an ``objects``
    dict of key -> ETag in manifest.json, a table without tags, another fingerprint):
    the next stage fetches exactly the object whose ETag changed, and writes tags."""
    from sources.s3server import tree_of, upload

    files = {f"d{i % 3}/k{i:03d}": b"%d" % i * 50 for i in range(40)}
    upload(s3, bucket, files)
    out = tmp_path / "out"
    fastload.stage(f"s3://{bucket}/", out)
    m = read_manifest(out)
    assert m is not None
    table: FileTable = m["files"]
    client = s3.client()
    old_ids = {k: client.head_object(Bucket=bucket, Key=k)["ETag"] for k in files}
    key = "d1/k007"
    files[key] = bytes(b ^ 1 for b in files[key])  # the same size, another ETag
    client.put_object(Bucket=bucket, Key=key, Body=files[key])
    # The earlier record and the staged file take the new object's time: only its ETag
    # (the older manifest's ``objects``) tells that it changed.
    listed = ObjectStore(f"s3://{bucket}/").list_columns()
    when = listed.mtime_ns[[o.key for o in listed].index(key)]
    mtimes = array("q", table.mtime_ns)
    mtimes[table.find(key)] = when
    os.utime(out / key, ns=(when, when))
    untagged = FileTable(bytes(table.paths), table.offsets, table.size, mtimes,
                         table.mode, bytes(table.digests), table.digest_offsets)  # fmt: skip
    name = "files-older.bin"
    untagged.write(state_dir(out) / name)
    header = {k: v for k, v in m.items() if k != "files"}
    header.update(table=name, objects=old_ids, fingerprint="an older formula")
    (state_dir(out) / "manifest.json").write_text(json.dumps(header))
    assert FileTable.read(state_dir(out) / name).tags is None

    proxy.reset_counts()
    r = fastload.stage(f"s3://{bucket}/", out)
    assert (r.copied_files, r.skipped) == (1, False)
    assert proxy.gets() == 1
    assert tree_of(out) == files
    m = read_manifest(out)
    assert m is not None and "objects" not in m and m["files"].tags is not None
    proxy.reset_counts()
    assert fastload.stage(f"s3://{bucket}/", out).skipped and proxy.gets() == 0
