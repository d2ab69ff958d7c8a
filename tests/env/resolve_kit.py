"""What the resolve tests share: a simulated node's variables, tars, checksums."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

ENV_VARS = {
    "CC_CLUSTER", "SCRATCH", "FASTLOAD_ENV", "FASTLOAD_CONFIG", "FASTLOAD_TMPDIR",
    "FASTLOAD_CACHE", "FASTLOAD_SCRATCH", "FASTLOAD_DATASET_ROOTS", "FASTLOAD_CPUS",
    "FASTLOAD_HTTP",
}


def env_vars(root: Path, **extra: str) -> dict[str, str]:
    """The variables of a simulated node: everything under ``root``."""
    out = {
        "USER": "bob",
        "HOME": str(root / "home"),
        "XDG_CONFIG_HOME": str(root / "no-config"),
        "FASTLOAD_ENV": "local",
        "FASTLOAD_TMPDIR": str(root / "node-local"),
        "FASTLOAD_CACHE": str(root / "cache"),
        "FASTLOAD_SCRATCH": str(root / "scratch"),
        "FASTLOAD_DATASET_ROOTS": str(root / "datasets"),
    }
    out.update(extra)
    return out


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_tar(path: Path, members: dict[str, bytes], *, gz: bool = False) -> bytes:
    """Writes a tar (or tar.gz) holding ``members``; returns its bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_600_000_000
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    data = buf.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No SLURM or fastload variable of the machine running the tests leaks in."""
    for var in list(os.environ):
        if var.startswith("SLURM_") or var in ENV_VARS:
            monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))


def tree_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }
