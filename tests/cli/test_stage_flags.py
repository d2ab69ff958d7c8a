"""``fastload stage`` flags the README documents, run for real: ``--sync`` (the manifest
says the copy was flushed), and for an S3 source ``--profile`` (credentials from a
named profile of the shared credentials file) and ``--anonymous`` (no request signed,
as the server sees them through the proxy)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from fastload.cli import main as cli
from fastload.staging.state import state_dir
from kit import trees


def _manifest(dst: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((state_dir(dst) / "manifest.json").read_text())
    return doc


def test_sync(tmp_path: Path) -> None:
    src = tmp_path / "src"
    trees.build_small_files(src, 30)
    assert cli(["stage", "--no-progress", str(src), str(tmp_path / "plain")]) == 0
    assert _manifest(tmp_path / "plain")["durable"] is False
    assert cli(["stage", "--no-progress", "--sync", str(src), str(tmp_path / "synced")]) == 0
    assert _manifest(tmp_path / "synced")["durable"] is True
    trees.assert_same_tree(src, tmp_path / "synced")


@pytest.mark.slow
def test_profile(
    s3: Any, bucket: str, proxy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sources.s3server import KEY_ID, SECRET, upload

    upload(s3, bucket, {"k.bin": b"profile data"})
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    creds = tmp_path / "credentials"
    creds.write_text(f"[lab]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {SECRET}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    url = f"s3://{bucket}/k.bin"
    # Without the profile there are no credentials: refused before any request.
    assert cli(["stage", "--no-progress", url, str(tmp_path / "a")]) != 0
    assert "credential" in capsys.readouterr().err.lower()
    assert cli(["stage", "--no-progress", "--profile", "lab", url, str(tmp_path / "b")]) == 0
    assert (tmp_path / "b").read_bytes() == b"profile data"
    assert proxy.signed[True] >= 1 and proxy.signed[False] == 0


@pytest.mark.slow
def test_anonymous(s3: Any, bucket: str, proxy: Any, tmp_path: Path) -> None:
    from sources.s3server import upload

    upload(s3, bucket, {"k.bin": b"public?"})
    assert os.environ["AWS_ACCESS_KEY_ID"]  # credentials are there, and not to be sent
    url = f"s3://{bucket}/k.bin"
    cli(["stage", "--no-progress", "--anonymous", url, str(tmp_path / "a")])
    # Whether this server lets an anonymous reader in is its business; what reached it
    # carried no signature.
    assert proxy.signed[False] >= 1 and proxy.signed[True] == 0, proxy.signed
    proxy.reset_counts()
    assert cli(["stage", "--no-progress", url, str(tmp_path / "b")]) == 0
    assert (tmp_path / "b").read_bytes() == b"public?"
    assert proxy.signed[True] >= 1 and proxy.signed[False] == 0, proxy.signed
