"""Messages that misled a new user (issue 32, item 5), through the command line: what
``pack`` into a bucket (a real S3 server on loopback) names at the end, ``index`` and
``probe`` of a path that is not there, ``env``'s world line, and the help of ``stage``
and ``pack``."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

import pytest

from fastload.cli import _parser, main


def _tree(root: Path, n: int = 8) -> Path:
    for i in range(n):
        p = root / f"c{i % 2}" / f"s{i:03d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(200 + i))
    return root


@pytest.mark.parametrize("slash", ["/", ""])
def test_pack_into_a_bucket_names_the_bucket(
    bucket: str, s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], slash: str
) -> None:
    src = _tree(tmp_path / "src")
    url = f"s3://{bucket}/shards{slash}"
    assert main(["pack", str(src), url, "--no-progress"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    prefix = f"s3://{bucket}/shards/"
    assert lines[0].startswith(f"{prefix}: 8 samples in 1 of 1 shards"), out
    assert f"  index {prefix}index.fidx" in lines, out
    assert "fastload-pack-" not in out  # the temporary folder, removed by then
    # What it names is there.
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert {"shards/index.fidx", "shards/shard-000000.tar"} <= keys, keys


def test_index_of_a_missing_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nonexistent" / "shards"
    assert main(["index", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"fastload: error: no such directory: '{missing}' (give the folder 'fastload "
        "pack' wrote, or shard files with -o INDEX)"
    ]
    assert main(["index", str(tmp_path / "a.tar"), "-o", str(tmp_path / "i.fidx")]) == 1
    err = capsys.readouterr().err
    assert f"no such file: '{tmp_path / 'a.tar'}'" in err and "usage" not in err
    assert not (tmp_path / "i.fidx").exists()


def test_probe_of_a_missing_path_names_it_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nonexistent"
    assert main(["probe", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.count(str(missing)) == 1 and len(err.strip().splitlines()) == 1, err


def test_env_with_a_missing_config_names_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none.toml"
    monkeypatch.setenv("FASTLOAD_CONFIG", str(missing))
    assert main(["env"]) == 1
    err = capsys.readouterr().err
    assert err.count(str(missing)) == 1 and "unset FASTLOAD_CONFIG" in err, err
    assert "[Errno" not in err


_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
              "SLURM_LOCALID", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE",
              "NNODES", "SLURM_NODEID", "FASTLOAD_ENV")


def _world_line(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    return next(line for line in out.splitlines() if line.startswith("world "))


def test_env_world_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in _RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config.toml"
    config.write_text("")
    monkeypatch.setenv("FASTLOAD_CONFIG", str(config))
    line = _world_line(capsys)
    assert "single" not in line, line
    assert "one process (rank 0 of 1)" in line, line
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    line = _world_line(capsys)
    assert line.endswith("rank 3 of 4, local rank 1 (from RANK and WORLD_SIZE)"), line
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "5")
    line = _world_line(capsys)
    assert line.endswith("rank 2 of 5, local rank 0 (from SLURM_PROCID and SLURM_NTASKS)")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_argument_has_help() -> None:
    bare = [
        f"{name} {a.option_strings[0] if a.option_strings else a.dest}"
        for name, p in _commands().items()
        for a in p._actions
        if not a.help or a.help == argparse.SUPPRESS
    ]
    assert bare == []


def _help(capsys: pytest.CaptureFixture[str], command: str) -> str:
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    # One line per argument: argparse's wrapping joined back.
    return re.sub(r"\n {20,}", " ", capsys.readouterr().out)


def test_stage_and_pack_help(capsys: pytest.CaptureFixture[str]) -> None:
    stage = _help(capsys, "stage")
    assert re.search(r"^  dst +the node-local directory", stage, re.M), stage
    assert re.search(r"^  --engine \{auto,uring,pread\} +how files are read", stage, re.M)
    pack = _help(capsys, "pack")
    out_line = next(line for line in pack.splitlines() if line.startswith("  out "))
    assert "s3://bucket/prefix/" in out_line
    pattern = next(line for line in pack.splitlines() if line.startswith("  --pattern"))
    assert "shard-000000.tar, shard-000001.tar" in pattern and ".tar" in pattern
