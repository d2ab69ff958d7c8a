"""Fault injection in the native I/O layer (FASTLOAD_FAULTS, read when an engine is
made): EINTR and short reads/writes must be invisible; EIO must surface as an OSError
naming a path, and leave a destination that a clean run completes.

Each case runs in a child process, so the variable is in place before fastload starts.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import fastload
from kit import procs, trees
from kit.trees import MiB

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def fault_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults") / "src"
    trees.build_rich_tree(root / "rich")
    trees.build_small_files(root / "small", 300, per_dir=60, seed=3)
    trees.write_patterned(root / "striped.bin", 9 * MiB + 333, seed=9)
    trees.set_mtime(root / "striped.bin", 77)
    return root


TRANSPARENT = [
    "eintr=0.2,short=0.3,seed=1,ops=read+write",
    "eio=0,eintr=0.2,short=0.3,seed=1,ops=read+write",
    "short=1.0,seed=2,ops=read+write",
    "eintr=0.3,seed=3,ops=open+close+statx",
    "eintr=0.1,short=0.1,seed=4,ops=read+write+open+close+statx,after=50",
]


@pytest.mark.parametrize("faults", TRANSPARENT)
def test_eintr_and_short_io_are_transparent(engine: str, fault_src: Path, tmp_path: Path,
                                            faults: str) -> None:
    dst = tmp_path / "dst"
    child = procs.run_child(procs.stage_spec(fault_src, dst, engine=engine),
                              env=procs.child_env(FASTLOAD_FAULTS=faults))
    res = child.expect_result()
    assert res["engine"] == engine
    assert res["copied_files"] == res["files"]
    trees.assert_same_tree(fault_src, dst)
    v = fastload.verify(dst)
    assert v.ok and not v.mismatched and not v.missing


@pytest.mark.parametrize("faults", [
    "eio=0.05,seed=1,ops=read+write",
    "eio=0.05,seed=2,ops=read",
    "eio=0.05,seed=3,ops=write",
    "eio=0.05,seed=4,ops=open",
    "eio=1,seed=5,ops=read+write,after=200",
])
def test_eio_raises_and_clean_run_completes(engine: str, fault_src: Path, tmp_path: Path,
                                            faults: str) -> None:
    dst = tmp_path / "dst"
    child = procs.run_child(procs.stage_spec(fault_src, dst, engine=engine),
                              env=procs.child_env(FASTLOAD_FAULTS=faults))
    err = child.expect_error()
    assert err["is"]["OSError"], err
    assert err["is"]["StageError"], err
    assert err["errno"] == errno.EIO, err
    where = f"{err['filename']} {err['str']}"
    assert str(fault_src) in where or str(dst) in where, f"no path in {err}"
    trees.assert_no_partial_files(fault_src, dst)

    child = procs.run_child(procs.stage_spec(fault_src, dst, engine=engine),
                              env=procs.child_env())
    res = child.expect_result()
    assert res["skipped"] is False
    trees.assert_same_tree(fault_src, dst)
    assert trees.tmp_leftovers(dst) == []
