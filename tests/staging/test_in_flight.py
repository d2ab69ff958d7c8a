"""The one rule for files in flight (staging/job.py ``in_flight``, issue 33): from the
cores this process may use (taskset respected) and the storage's latency (a network or
FUSE file system gets more in flight); ``workers`` overrides it; the copy options, the
plan ``fastload probe`` reports and the jobs that run all take it.

The expected figures are the documented rule's numbers (docs/DESIGN.md, staging/job.py),
written here, not read from the code under test: 16 files per usable core up to 8 cores
(4 to 64 threads, half the files); on a network or FUSE file system 64 per core per ms
of request latency, between 16 and 64 per core (64 where not measured), at most 512 in
all, with up to 256 threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastload
from fastload.staging.engine import request_latency
from fastload.staging.job import copy_options, in_flight, network_per_core
from fastload.staging.request import StageRequest
from fastload.staging.tree import LocalTree
from kit import procs, trees
from kit.netsim import mounts


@pytest.mark.parametrize(("cores", "files", "threads"),
                         [(1, 16, 8), (2, 32, 16), (5, 80, 40), (8, 128, 64), (16, 128, 64),
                          (64, 128, 64)])  # fmt: skip
def test_local_storage_keeps_a_few_files_per_core(tmp_path: Path, cores: int, files: int,
                                                  threads: int) -> None:  # fmt: skip
    f = in_flight(None, tmp_path, cores=cores)
    assert not f.network and f.cores == cores
    assert (f.files, f.threads) == (files, threads)


def test_workers_overrides_the_rule(tmp_path: Path) -> None:
    assert in_flight(7, tmp_path, cores=16).files == 7
    assert in_flight(300, tmp_path, cores=1).files == 300
    assert in_flight(300, tmp_path, cores=1).threads == 64  # local: at most 64 threads
    opts = copy_options("auto", 5, 1 << 20, tmp_path)
    assert (opts.files_in_flight, opts.threads) == (5, 4)


def test_without_a_path_the_storage_counts_as_local() -> None:
    f = in_flight(None, None, cores=4)
    assert not f.network and f.files == 64


_CHILD = """
import json, os, sys
from fastload.staging.job import copy_options, in_flight
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, set(cpus[: int(sys.argv[2])]))
f = in_flight(None, sys.argv[1])
o = copy_options("auto", None, 1 << 20, sys.argv[1])
print(json.dumps([f.cores, f.files, o.files_in_flight, o.threads]))
"""


@pytest.mark.parametrize("which", ["one", "all"])
def test_the_default_follows_the_affinity(tmp_path: Path, which: str) -> None:
    """A process pinned to fewer cores (taskset) keeps fewer files in flight; the copy
    options a job gets say the same."""
    allowed = 1 if which == "one" else len(os.sched_getaffinity(0))
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), str(allowed)],
        env=procs.child_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    cores, files, opt_files, threads = json.loads(r.stdout)
    assert cores == allowed
    assert files == opt_files == 16 * min(allowed, 8)
    assert threads == min(max(4, files // 2), 64)


def test_a_network_mount_gets_more_in_flight(tmp_path: Path) -> None:
    """A FUSE mount (netsim, 1 ms per request) is a network file system to the rule:
    64 per submitter core and up to 256 pool threads; a stage through it with the default
    copies the tree whole."""
    src = tmp_path / "src"
    trees.build_small_files(src, 40)
    with mounts(tmp_path) as mount:
        mnt = mount(src, 1000, 1000).path
        for cores, files, threads in ((1, 64, 32), (2, 128, 64), (16, 512, 256)):
            f = in_flight(None, mnt, cores=cores)
            assert f.network
            assert (f.files, f.threads) == (files, threads)
        assert in_flight(None, mnt, cores=2).files > in_flight(None, tmp_path, cores=2).files
        opts = copy_options("auto", None, 1 << 20, mnt)
        assert opts.files_in_flight == in_flight(None, mnt).files
        res = fastload.stage(mnt, tmp_path / "dst")
        assert res.engine == "pread" and res.copied_files == 40
    trees.assert_same_tree(src, tmp_path / "dst")


def test_network_files_follow_the_measured_latency() -> None:
    """Per core: 64 per millisecond, never fewer than local storage gets (16), never
    more than 64; 64 where not measured."""
    assert network_per_core(None) == 64
    assert network_per_core(0.0) == 16
    assert network_per_core(0.0001) == 16  # 6.4, raised to the local figure
    assert network_per_core(0.0005) == 32
    assert network_per_core(0.00075) == 48
    assert network_per_core(0.010) == 64
    assert network_per_core(5.0) == 64
    got = [network_per_core(us / 1e6) for us in range(0, 3000, 50)]
    assert got == sorted(got) and got[0] == 16 and got[-1] == 64


def test_a_local_path_ignores_a_latency(tmp_path: Path) -> None:
    """The latency only sets a network file system's figure: local storage keeps
    16 per core whatever is passed, and ``workers`` still wins."""
    assert in_flight(None, tmp_path, cores=2, latency_s=0.05).files == 32
    assert in_flight(9, tmp_path, cores=2, latency_s=0.05).files == 9
    assert request_latency(tmp_path / "missing") is None
    (tmp_path / "one").write_bytes(b"x")
    assert request_latency(tmp_path / "one") is None  # a file, not a folder: nothing to keep


def test_the_latency_of_a_mount_sets_its_files_in_flight(tmp_path: Path) -> None:
    """netsim mounts of 0 and 10 ms per request (each delay a floor): the files in flight
    derived from the latency measured on each (a few opens): the slow
    mount's are at least what the rule gives its floor and no fewer than the fast one's,
    within 512; a stage's plan through the mount (LocalTree: its walk and
    its CopyJob) takes its measure, and the stage copies the tree whole."""
    src = tmp_path / "src"
    trees.build_small_files(src, 40)
    req = StageRequest.make()
    with mounts(tmp_path) as mount:
        got = {}
        for ms in (0, 10):
            mnt = mount(src, ms * 1000, 1000).path
            lat = request_latency(mnt)
            assert lat is not None
            got[ms] = in_flight(None, mnt, cores=1, latency_s=lat).files
            for cores in (1, 2, 16):
                f = in_flight(None, mnt, cores=cores, latency_s=lat)
                assert f.network and f.threads == min(f.files // 2, 256)
                assert f.files <= 512
            tree = LocalTree(mnt, req, single=False)
            lat_tree = tree.latency(req)
            assert lat_tree is not None
            opts = copy_options("auto", None, 1 << 20, mnt, lat_tree)
            assert opts.files_in_flight == in_flight(None, mnt, latency_s=lat_tree).files
        assert got[10] == 64 >= got[0] >= 16
        res = fastload.stage(mnt, tmp_path / "dst")
        assert res.engine == "pread" and res.copied_files == 40
    trees.assert_same_tree(src, tmp_path / "dst")
