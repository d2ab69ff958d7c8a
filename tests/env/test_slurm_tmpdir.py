"""A set ``SLURM_TMPDIR`` without ``SLURM_JOB_ID`` (an ``salloc`` shell, a site's prolog)
is the node-local disk (issue 32, item 6): ``resolve()`` stages there, from a bucket on a
real S3 server on loopback and from a path, never into the home directory's cache, and
``fastload env`` says so. ``FASTLOAD_TMPDIR`` still wins over it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cli import main
from fastload.env import detect
from sources.s3server import upload

FILES = {f"ds/c{i % 2}/s{i:02d}.bin": os.urandom(300 + i) for i in range(6)}


@pytest.fixture
def salloc_shell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The environment of a shell with SLURM_TMPDIR but no SLURM_JOB_ID, on no known
    cluster, with no configuration file; the home directory is the test's."""
    node = tmp_path / "node-local"
    node.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    for name in ("SLURM_JOB_ID", "CC_CLUSTER", "FASTLOAD_ENV", "FASTLOAD_CONFIG",
                 "FASTLOAD_TMPDIR", "FASTLOAD_CACHE", "XDG_CACHE_HOME", "SCRATCH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    monkeypatch.setenv("SLURM_TMPDIR", str(node))
    return {"node": node, "home_cache": home / ".cache" / "fastload"}


def test_resolve_from_a_bucket_stages_into_slurm_tmpdir(
    bucket: str, s3: Any, salloc_shell: dict[str, Path]
) -> None:
    upload(s3, bucket, FILES)
    got = fastload.resolve(f"s3://{bucket}/ds/")
    node = salloc_shell["node"]
    assert got == node / "ds", got
    staged = {str(p.relative_to(node)): p.read_bytes() for p in got.rglob("*.bin")}
    assert staged == FILES
    assert not salloc_shell["home_cache"].exists()


def test_resolve_from_a_path_stages_into_slurm_tmpdir(
    tmp_path: Path, salloc_shell: dict[str, Path]
) -> None:
    src = tmp_path / "shared" / "mydata"
    for key, data in FILES.items():
        (src / key).parent.mkdir(parents=True, exist_ok=True)
        (src / key).write_bytes(data)
    got = fastload.resolve(src)
    assert got == salloc_shell["node"] / "mydata"
    assert (got / "ds/c1/s05.bin").read_bytes() == FILES["ds/c1/s05.bin"]
    assert not salloc_shell["home_cache"].exists()


def test_env_shows_slurm_tmpdir(
    salloc_shell: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["env", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["environment"] == "local"
    assert doc["tmpdir"] == {"path": str(salloc_shell["node"]), "exists": True,
                             "free": doc["tmpdir"]["free"]}
    assert doc["cache"]["path"] == str(salloc_shell["home_cache"])


def test_fastload_tmpdir_still_wins(
    tmp_path: Path, salloc_shell: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert detect().tmpdir == salloc_shell["node"]
    monkeypatch.setenv("FASTLOAD_TMPDIR", str(tmp_path / "chosen"))
    assert detect().tmpdir == tmp_path / "chosen"
    monkeypatch.delenv("FASTLOAD_TMPDIR")
    monkeypatch.setenv("SLURM_TMPDIR", "")  # set but empty: not a directory
    assert detect().tmpdir == salloc_shell["home_cache"] / "data"
