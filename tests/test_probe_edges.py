"""``fastload probe`` at the edges a new user hits (issue 32, item 4): objects smaller
than its reads (1 byte, 3 bytes) and empty ones on a real S3 server on loopback, a line
on stderr for each measurement as it is made, and a plan whose files in flight are the
measured best or say why not. No time is compared: events, fields, counts and requests."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.cli import main
from fastload.probing import IN_FLIGHT_STEPS, SCHEMA_VERSION, ProbeEvent
from sources.s3server import upload
from test_probe import SCHEMA, check_schema  # the --json schema of version 2


def check_plan(plan: dict[str, Any], best: int | None) -> None:
    """The plan follows the measurement, or its reason says why not and what to pass."""
    if plan["in_flight"] == best:
        assert plan["reason"] is None, plan
    else:
        assert plan["reason"], plan
        if best is not None:
            assert f"--workers {best}" in plan["reason"], plan


def test_small_and_empty_objects(
    bucket: str, proxy: Any, s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    upload(s3, bucket, {"tiny/one.bin": b"x", "tiny/three.bin": b"abc",
                        "tiny/empty.bin": b""})
    url = f"s3://{bucket}/tiny/"
    rc = main(["probe", url, "--seconds", "1", "--dest", str(tmp_path), "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert err == ""  # --json: no progress lines
    doc = json.loads(out)
    check_schema(doc, SCHEMA)
    assert doc["version"] == SCHEMA_VERSION == 2
    assert doc["kind"] == "object" and doc["files_sampled"] == 3
    assert [s["in_flight"] for s in doc["in_flight_steps"]] == list(IN_FLIGHT_STEPS)
    assert all(s["requests_per_s"] > 0 for s in doc["in_flight_steps"])
    assert doc["best_in_flight"] in IN_FLIGHT_STEPS
    assert doc["latency_ms"]["read"] is not None
    check_plan(doc["plan"], doc["best_in_flight"])
    # Both small objects were read; the empty one only listed and HEADed.
    paths = proxy.get_paths
    assert any(p.endswith("/tiny/one.bin") for p in paths), paths[:5]
    assert any(p.endswith("/tiny/three.bin") for p in paths), paths[:5]
    assert not any(p.endswith("/tiny/empty.bin") for p in paths)


def test_one_object_of_one_byte(bucket: str, s3: Any, tmp_path: Path) -> None:
    upload(s3, bucket, {"one.bin": b"x"})
    events: list[ProbeEvent] = []
    r = fastload.probe(f"s3://{bucket}/one.bin", dest=tmp_path, seconds=0.5,
                       on_event=events.append)
    assert r.files_sampled == 1 and r.read_ms is not None
    assert r.steps and all(s.mb_per_s >= 0 and s.requests_per_s > 0 for s in r.steps)
    assert [e.values["in_flight"] for e in events if e.kind == "in_flight"] == list(
        IN_FLIGHT_STEPS)
    check_plan(r.to_dict()["plan"], r.best_in_flight)


def test_only_empty_objects(bucket: str, proxy: Any, s3: Any, tmp_path: Path) -> None:
    upload(s3, bucket, {f"void/e{i}": b"" for i in range(3)})
    r = fastload.probe(f"s3://{bucket}/void/", dest=tmp_path, seconds=0.5)
    assert r.files_sampled == 3
    assert r.steps == () and r.best_in_flight is None and r.read_ms is None
    assert r.plan.reason is not None and "nothing was measured" in r.plan.reason
    assert proxy.gets() == 0  # nothing to read, nothing read
    check_schema(r.to_dict(), SCHEMA)


def _tree(root: Path) -> Path:
    for i in range(6):
        p = root / f"d{i % 2}" / f"f{i}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(1 << 16) if i else b"")  # one empty file
    return root


def test_progress_lines_as_it_measures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tree(tmp_path / "src")
    assert main(["probe", str(src), "--seconds", "1", "--dest", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert all(line.startswith("probe: ") for line in lines), lines
    assert lines[0] == f"probe: probing {src} for about 1 s, reading only"
    assert lines[1] == "probe: 6 files sampled"
    assert lines[2].startswith("probe: latency: stat ")
    assert lines[3].startswith("probe: one stream: ")
    steps = [int(line.split()[1]) for line in lines[4:]]
    assert steps == list(IN_FLIGHT_STEPS), lines
    assert len(lines) == 4 + len(IN_FLIGHT_STEPS)
    # The table follows on stdout, the plan's line and, where it differs, why.
    assert "fastload will use engine" in out and "probe: " not in out
    best = int(out.split("in flight     best ")[1].split()[0])
    planned = int(out.split("fastload will use engine ")[1].split(", ")[1].split()[0])
    assert ("\n  why " in out) == (best != planned), out


def test_events_match_the_result(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    events: list[ProbeEvent] = []
    r = fastload.probe(src, dest=tmp_path, seconds=0.5, on_event=events.append)
    kinds = [e.kind for e in events]
    assert kinds == ["start", "sample", "latency", "stream"] + ["in_flight"] * len(
        IN_FLIGHT_STEPS)
    assert events[1].values["files_sampled"] == r.files_sampled == 6
    assert events[2].values == {"stat_ms": r.stat_ms, "open_ms": r.open_ms,
                                "read_ms": r.read_ms}
    assert events[3].values["single_stream_mb_per_s"] == r.single_stream_mb_per_s
    assert [e.values for e in events[4:]] == [
        {"in_flight": s.in_flight, "requests_per_s": s.requests_per_s, "mb_per_s": s.mb_per_s}
        for s in r.steps
    ]
    doc = r.to_dict()
    check_schema(doc, SCHEMA)
    check_plan(doc["plan"], r.best_in_flight)


def test_missing_path_names_it_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events: list[ProbeEvent] = []
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError):
        fastload.probe(missing, on_event=events.append)
    assert events == []  # no "probing ..." line for a path that is not there
    assert main(["probe", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.count(str(missing)) == 1, err
    assert "no such file or directory" in err and "[Errno" not in err
    assert len(err.strip().splitlines()) == 1
