"""What a new user hits with object stores (issue 32): endpoints that are not URLs,
mistyped s3:// URLs, a prefix with nothing under it, a store that is down while a
complete copy is on the node, and the messages of each. A real S3 server (SeaweedFS) on
loopback behind a proxy that can be closed (the store down)."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from s3server import FaultProxy, S3Server, tree_of, upload

import fastload

pytestmark = pytest.mark.slow

FILES = {"a.txt": b"alpha", "d/b.bin": b"\x00" * 3000, "d/e/c.txt": b"gamma"}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastload", *args],
        capture_output=True, text=True, timeout=300, env=env or dict(os.environ),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("127.0.0.1:41000", "did you mean 'http://127.0.0.1:41000'"),
        ("htp://127.0.0.1:41000", "the scheme 'htp' is neither http nor https"),
        ("http://127.0.0.1:99999", "not a valid endpoint URL"),
    ],
)
def test_bad_endpoint_is_one_line_before_any_request(
    bucket: str, proxy: FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    endpoint: str, says: str,
) -> None:  # fmt: skip
    url = f"s3://{bucket}/p/"
    # storage_options
    with pytest.raises(ValueError, match=says) as e:
        fastload.stage(url, tmp_path / "a", storage_options={"endpoint_url": endpoint})
    assert "storage_options" in str(e.value) and "\n" not in str(e.value)
    # the environment
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(ValueError, match=says) as e:
        fastload.stage(url, tmp_path / "b")
    assert "AWS_ENDPOINT_URL" in str(e.value)
    # the command line: one line, no panic, no traceback
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    r = _cli("stage", url, str(tmp_path / "c"), "--endpoint-url", endpoint)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert "panicked" not in r.stderr and "Traceback" not in r.stderr
    assert proxy.requests.get("LIST", 0) == 0 and proxy.gets() == 0
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("typo", ["s3:/{b}/p", "S3://{b}/p", "s3:{b}/p"])
def test_mistyped_url_suggests_the_right_one(bucket: str, tmp_path: Path, typo: str) -> None:
    src = typo.format(b=bucket)
    with pytest.raises(FileNotFoundError, match=f"did you mean s3://{bucket}/p") as e:
        fastload.stage(src, tmp_path / "out")
    assert e.value.errno == errno.ENOENT


def test_empty_prefix_is_an_error_unless_allowed(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, {"real/x.txt": b"x"})
    for url in (f"s3://{bucket}/nope/", f"s3://{bucket}/nope"):
        with pytest.raises(FileNotFoundError, match=r"no (objects|such object, and none)") as e:
            fastload.stage(url, tmp_path / "out")
        assert url in str(e.value) and "allow_empty" in str(e.value)
    assert not (tmp_path / "out").exists()  # a failed stage leaves no empty folder
    r = fastload.stage(f"s3://{bucket}/nope/", tmp_path / "out", allow_empty=True)
    assert r.files == 0 and (tmp_path / "out").is_dir()
    with pytest.raises(FileNotFoundError, match="no objects under it"):
        fastload.resolve(sources=[f"s3://{bucket}/nope/"], cache=tmp_path / "cache")
    cli = _cli("stage", f"s3://{bucket}/nope/", str(tmp_path / "cli"))
    assert cli.returncode == 1 and "no objects under it" in cli.stderr


def test_include_matching_nothing_in_a_prefix(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    upload(s3, bucket, {f"p/{k}": v for k, v in FILES.items()})
    with pytest.raises(FileNotFoundError, match=r"include pattern '\*\.jpg' matched nothing"):
        fastload.stage(f"s3://{bucket}/p/", tmp_path / "out", include="*.jpg")
    r = fastload.stage(f"s3://{bucket}/p/", tmp_path / "out", include="*.jpg", allow_empty=True)
    assert r.files == 0
    r = fastload.stage(f"s3://{bucket}/p/", tmp_path / "out2", include="*.txt")
    assert r.files == 2


def test_missing_key_says_what_to_check(s3: S3Server, bucket: str, tmp_path: Path) -> None:
    from fastload.sources.objstore import ObjectStore

    upload(s3, bucket, {"p/a.tar": b"x"})
    with pytest.raises(FileNotFoundError) as e:
        ObjectStore(f"s3://{bucket}/p/").head("A.tar")
    assert "no such object" in str(e.value) and "case-sensitive" in str(e.value)


def test_complete_copy_is_used_while_the_store_is_down(
    s3: S3Server, bucket: str, proxy: FaultProxy, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    upload(s3, bucket, {f"p/{k}": v for k, v in FILES.items()} | {"one.bin": b"1" * 10})
    tree, one = tmp_path / "tree", tmp_path / "dir"
    fastload.stage(f"s3://{bucket}/p/", tree)
    one.mkdir()
    fastload.stage(f"s3://{bucket}/one.bin", one)
    resolved = fastload.resolve(sources=[f"s3://{bucket}/p/"], cache=tmp_path / "cache")
    proxy.close()  # the store is down from here on
    again = fastload.resolve(sources=[f"s3://{bucket}/p/"], cache=tmp_path / "cache")
    assert again == resolved and tree_of(again) == FILES

    with caplog.at_level(logging.WARNING):
        r = fastload.stage(f"s3://{bucket}/p/", tree)
        r1 = fastload.stage(f"s3://{bucket}/one.bin", one)
    assert r.skipped and r.files == len(FILES) and tree_of(tree) == FILES
    assert r1.skipped and (one / "one.bin").read_bytes() == b"1" * 10
    warnings = [m for m in caplog.messages if "cannot reach" in m]
    assert len(warnings) == 3 and all("\n" not in m for m in warnings)
    assert "unchecked" in warnings[1] and str(tree) in warnings[1]

    with pytest.raises(OSError, match=r"cannot reach .*connection refused") as e:
        fastload.stage(f"s3://{bucket}/p/", tree, check_source="strict")
    assert e.value.errno == errno.EHOSTUNREACH and "\n" not in str(e.value)
    assert len(str(e.value)) < 200  # one short line, not obstore's retry settings
    # Nothing staged there: the store's error, one line.
    with pytest.raises(OSError, match="cannot reach"):
        fastload.stage(f"s3://{bucket}/p/", tmp_path / "never")
    assert not (tmp_path / "never").exists()
