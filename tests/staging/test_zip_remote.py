"""Zips read by ranges (issue 53): an object in the loopback S3 server (ranged GETs, never
the whole object for a selection) and a file behind a local HTTP server that serves
ranges; one whose server does not is downloaded whole first, with a warning saying so."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
from kit import trees, zips
from kit.web import WebServer, serving
from sources.s3server import upload_file


@pytest.fixture(scope="module")
def zipped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A zip of 300 small files and a 6 MiB one (Info-ZIP), and unzip's extraction."""
    base = tmp_path_factory.mktemp("zip-remote")
    src = zips.build_tree(base / "src")
    trees.build_small_files(src / "many", 300, seed=2)
    trees.write_patterned(src / "big.bin", 6 * trees.MiB, seed=3)
    a = zips.infozip(src, base / "data.zip")
    return a, zips.unzip_ref(a, base / "ref")


def test_from_s3_by_ranged_gets(s3: Any, bucket: str, proxy: Any, zipped: tuple[Path, Path],
                                tmp_path: Path) -> None:  # fmt: skip
    archive, ref = zipped
    upload_file(s3, bucket, "sets/data.zip", archive)
    url = f"s3://{bucket}/sets/data.zip"
    proxy.reset_counts()
    res = fastload.stage(url, tmp_path / "dst")
    zips.assert_same_extraction(archive, ref, tmp_path / "dst")
    assert res.files == len(trees.regular_files(ref))
    assert proxy.gets() > 1  # ranges, not one GET of the whole object
    proxy.reset_counts()
    assert fastload.stage(url, tmp_path / "dst").skipped
    proxy.reset_counts()
    fastload.stage(url, tmp_path / "one", include=["a/text.txt"])
    assert trees.regular_files(tmp_path / "one") == {"a/text.txt": 100_000}
    assert proxy.bytes_out < archive.stat().st_size // 4, proxy.bytes_out


@pytest.fixture(params=[True, False], ids=["ranges", "no-ranges"])
def server(request: pytest.FixtureRequest, zipped: tuple[Path, Path]) -> Iterator[WebServer]:
    with serving(zipped[0].parent, serve_ranges=request.param) as srv:
        yield srv


def test_over_http(server: WebServer, zipped: tuple[Path, Path], tmp_path: Path,
                   caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    archive, ref = zipped
    with caplog.at_level(logging.WARNING):
        fastload.stage(server.url("data.zip"), tmp_path / "dst")
    zips.assert_same_extraction(archive, ref, tmp_path / "dst")
    warned = [r for r in caplog.records if "does not serve byte ranges" in r.getMessage()]
    if server.serve_ranges:
        assert not warned and len(server.range_headers) > 2
        assert all(r is not None for r in server.range_headers)
    else:
        assert len(warned) == 1 and server.url("data.zip") in warned[0].getMessage()
        assert not list((tmp_path).glob(".dst.fastload/.zip-*"))  # the download is gone
    assert fastload.stage(server.url("data.zip"), tmp_path / "dst").skipped
