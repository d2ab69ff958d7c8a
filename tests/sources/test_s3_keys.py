"""Messy buckets (issue 50): keys that clash, keys obstore cannot parse, keys that cannot
be placed under the destination, and what each costs. A real S3 server (SeaweedFS) on
loopback behind the counting proxy; the keys are written by the test with boto3, as given.

Where SeaweedFS differs from S3 here (what the tests can hold): it stores ``/abs.txt`` as
``abs.txt`` and ``a//b`` as ``a/b`` (a leading or doubled ``/`` is not kept), refuses a
key with a ``.`` or ``..`` segment (400 InvalidRequest), keeps a key ending in ``/`` as a
folder whatever its bytes, and turns ``\\`` into ``/``; it keeps ASCII control characters
(``a\tb``), which obstore refuses in a listing as it refuses ``..``. So a listing that
must not fail on one key's spelling is tested with a control character, end to end; the
keys SeaweedFS cannot hold are tested where fastload decides about them, the placement
rule and the message of sources/listing.py, on those very keys.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from s3server import FaultProxy, S3Server, put_each, tree_of

import fastload
from fastload._util import selected
from fastload.sources.listing import _unplaceable, placement

pytestmark = pytest.mark.slow


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fastload", *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))  # fmt: skip


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
    put_each(s3, bucket, {"q/a": b"file", "q/a/b": b"under", "q/c": b"c"})
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
    put_each(s3, bucket, {"q/a": b"file", "q/a/b": b"under", "q/c": b"c"})
    url = f"s3://{bucket}/q/"
    with pytest.raises(FileExistsError, match=r"--exclude '([^']+)'") as e:
        fastload.stage(url, tmp_path / "x")
    m = re.search(r"--exclude '([^']+)'", str(e.value))
    assert m is not None
    out = tmp_path / "out"
    fastload.stage(url, out, exclude=[m.group(1)])
    assert tree_of(out) == {"a/b": b"under", "c": b"c"}


# --- 3: a listing never fails on one key's spelling; unsafe keys are named -------------


def test_a_key_obstore_cannot_parse_is_listed_and_fetched(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    # obstore's listing failed on the whole prefix: InvalidPathError, its own words
    files = {"c/a\tb": b"tab" * 100, "c/n\x01x": b"ctrl", "c/ok": b"ok",
             "c/big\tone": b"B" * (3 << 20)}  # fmt: skip
    put_each(s3, bucket, files)
    out = tmp_path / "out"
    r = fastload.stage(f"s3://{bucket}/c/", out)
    assert r.files == 4
    assert tree_of(out) == {k.removeprefix("c/"): v for k, v in files.items()}
    assert fastload.verify(out).ok
    proxy.reset_counts()
    assert fastload.stage(f"s3://{bucket}/c/", out).skipped  # unchanged: no GET
    assert proxy.gets() == 0


def test_where_obstore_lists_a_key_it_refuses_is_named(s3: S3Server, bucket: str) -> None:
    """Where obstore lists (no keys at hand: the store's own credential chain), a key it
    refuses is named in fastload's words, with what gets past it."""
    from fastload.sources.objstore import ObjectStore

    put_each(s3, bucket, {"c/a\tb": b"tab", "c/ok": b"ok"})
    store = ObjectStore(f"s3://{bucket}/c/")
    store._raw = None  # what a store whose credentials are not keys has
    with pytest.raises(OSError) as e:
        store.list_tree()
    text = str(e.value)
    assert "the key 'c/a\\x09b' cannot be listed through obstore" in text, text
    assert "InvalidPathError" not in text and "\n" not in text


UNSAFE = ["x/../y", "a//b", "a/./b", "..", "d/.", "/", "e/x/"]


@pytest.mark.parametrize(
    ("key", "placed"),
    [("ok.txt", "ok.txt"), ("/abs.txt", "abs.txt"), ("//abs.txt", "abs.txt"),
     ("/d/x.bin", "d/x.bin"), ("a\tb", "a\tb"), ("..x/y..", "..x/y..")]
    + [(k, None) for k in UNSAFE],
)  # fmt: skip
def test_placement(key: str, placed: str | None) -> None:
    """Where a key goes: the keys SeaweedFS cannot hold (a '..', '.' or empty segment,
    a trailing '/' on an object with bytes) are refused; nothing is ever placed outside
    the destination (no placement is absolute or climbs)."""
    got = placement(key)
    assert got == placed
    if got is not None:
        assert not got.startswith("/") and ".." not in got.split("/")


def test_unsafe_keys_are_each_named_and_the_suggested_excludes_work() -> None:
    class _Store:
        url = "s3://bkt/p/"

    keys = [*UNSAFE, "br[1]/../z", "star*/../q"]
    e = _unplaceable(_Store(), keys)  # type: ignore[arg-type]
    text = str(e)
    assert text.startswith("'s3://bkt/p/': 9 keys cannot be placed safely")
    for k in keys:
        assert f"'{k}'" in text
    excludes = re.findall(r"--exclude '([^']*)'", text)
    assert len(excludes) == len(keys)
    listed = [*keys, "ok.txt", "a/b", "x/y", "br1/z", "starX/q"]
    kept = [k for k in listed if selected(k, [], excludes)]
    assert kept == ["ok.txt", "a/b", "x/y", "br1/z", "starX/q"]


# --- 7: zero-byte objects cost no request ------------------------------------------------


def test_zero_byte_objects_cost_no_head(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path
) -> None:
    put_each(s3, bucket, {"z/e0.bin": b"", "z/sub/e1.bin": b"", "z/dir/": b"", "z/a.txt": b"a"})
    proxy.reset_counts()
    out = tmp_path / "out"
    r = fastload.stage(f"s3://{bucket}/z/", out)
    assert r.files == 3
    assert (out / "e0.bin").stat().st_size == 0 and (out / "sub" / "e1.bin").is_file()
    assert (out / "dir").is_dir() and not any((out / "dir").iterdir())
    assert proxy.requests.get("HEAD", 0) == 0 and proxy.gets() == 1  # a.txt alone
    proxy.reset_counts()
    assert fastload.stage(f"s3://{bucket}/z/", out).skipped
    assert proxy.requests.get("HEAD", 0) == 0 and proxy.gets() == 0
