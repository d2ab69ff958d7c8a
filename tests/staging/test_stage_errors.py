"""fastload.stage() failures: the exception raised, and a destination that stays resumable.

Permission checks need another user than root (root bypasses them): those tests run the
stage in a child process without that bypass (see the
``unprivileged`` fixture). Disk-full tests mount a small tmpfs.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit import fs, procs, trees
from kit.trees import MiB

pytestmark = pytest.mark.native

Stage = Callable[..., Any]


def _names(e: BaseException) -> str:
    """Everything an error says about where it happened."""
    return f"{e} {getattr(e, 'filename', '')} {getattr(e, 'filename2', '')}"


# --------------------------------------------------------------------------------------
# Missing paths
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["top", "parent"])
def test_missing_source(stage: Stage, tmp_path: Path, shape: str) -> None:
    src = tmp_path / "nope" if shape == "top" else tmp_path / "no" / "such" / "dir"
    dst = tmp_path / "dst"
    with pytest.raises(FileNotFoundError) as info:
        stage(src, dst)
    e = info.value
    assert isinstance(e, fastload.StageError)
    assert isinstance(e, fastload.FastloadError)
    assert e.errno == errno.ENOENT
    assert os.fspath(e.filename) == str(src)
    assert str(src) in str(e)
    assert not dst.exists()


# --------------------------------------------------------------------------------------
# Permissions (a child without root's permission bypass)
# --------------------------------------------------------------------------------------


def _locked_tree(base: Path) -> Path:
    src = base / "src"
    trees.build_small_files(src / "many", 50, per_dir=10)
    trees.write_file(src / "locked" / "secret.bin", os.urandom(50_000), mtime_index=1)
    trees.write_file(src / "open.bin", os.urandom(70_000), mtime_index=2)
    fs.make_world_readable(src)
    return src


@pytest.mark.parametrize("what", ["file", "dir"])
def test_unreadable_source(engine: str, world_dir: Path, unprivileged: dict[str, Any],
                           what: str) -> None:
    src = _locked_tree(world_dir)
    locked = src / "locked" / "secret.bin" if what == "file" else src / "locked"
    os.chmod(locked, 0o000)  # root-owned: the child (root without bypass, or nobody) is locked out
    dst = world_dir / "dst"
    child = procs.run_child(procs.stage_spec(src, dst, engine=engine), **unprivileged,
                              env=procs.child_env())
    err = child.expect_error()
    assert err["is"]["PermissionError"], err
    assert err["is"]["StageError"], err
    assert err["errno"] in (errno.EACCES, errno.EPERM)
    assert locked.name in f"{err['str']} {err['filename']}", err
    trees.assert_no_partial_files(src, dst)

    # Fixed: the same user resumes and gets the whole tree.
    os.chmod(locked, 0o644 if what == "file" else 0o755)
    child = procs.run_child(procs.stage_spec(src, dst, engine=engine), **unprivileged,
                              env=procs.child_env())
    res = child.expect_result()
    trees.assert_same_tree(src, dst)
    assert res["files"] == 52


def test_dst_in_unwritable_dir(engine: str, world_dir: Path, unprivileged: dict[str, Any]) -> None:
    src = _locked_tree(world_dir)
    parent = world_dir / "root_only"
    parent.mkdir()
    os.chmod(parent, 0o555)  # root-owned: the child cannot create in it
    dst = parent / "dst"
    child = procs.run_child(procs.stage_spec(src, dst, engine=engine), **unprivileged,
                              env=procs.child_env())
    err = child.expect_error()
    assert err["is"]["PermissionError"] and err["is"]["StageError"], err
    assert str(parent) in f"{err['str']} {err['filename']}", err
    assert list(parent.iterdir()) == []


def test_dst_on_readonly_fs(stage: Stage, rich_src: Path, small_fs: Any) -> None:
    mnt = small_fs("1m", ro=True)
    dst = mnt / "dst"
    with pytest.raises(OSError) as info:
        stage(rich_src, dst)
    e = info.value
    assert isinstance(e, fastload.StageError), repr(e)
    assert e.errno == errno.EROFS
    assert str(mnt) in _names(e)


# --------------------------------------------------------------------------------------
# Destination inside the source
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["sub/dst", "dst", "."])
def test_dst_inside_src(stage: Stage, tmp_path: Path, where: str) -> None:
    src = tmp_path / "src"
    trees.write_file(src / "sub" / "a.bin", os.urandom(1000), mtime_index=1)
    trees.write_file(src / "b.bin", os.urandom(1000), mtime_index=2)
    before = trees.snapshot(src)
    dst = src / where if where != "." else src
    with pytest.raises(fastload.FastloadError) as info:
        stage(src, dst)
    e = info.value
    assert isinstance(e, (ValueError, fastload.StageError)), repr(e)
    text = _names(e)
    assert str(dst) in text, text
    assert str(src) in text.replace(str(dst), "", 1) or src == dst, text
    assert trees.snapshot(src) == before, "the source was changed"


# --------------------------------------------------------------------------------------
# Disk full
# --------------------------------------------------------------------------------------


def test_not_enough_space(stage: Stage, tmp_path: Path, small_fs: Any) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        trees.write_patterned(src / f"part{i}.bin", 4 * MiB, seed=i)
    mnt = small_fs("8m")
    dst = mnt / "dst"
    with pytest.raises(fastload.NotEnoughSpaceError) as info:
        stage(src, dst)
    e = info.value
    assert isinstance(e, OSError) and isinstance(e, fastload.StageError)
    assert e.errno == errno.ENOSPC
    assert e.needed >= 12 * MiB
    assert 0 < e.free <= 8 * MiB
    msg = str(e)
    assert fs.mentions_size(msg, e.needed), f"needed {e.needed} not in {msg!r}"
    assert fs.mentions_size(msg, e.free), f"free {e.free} not in {msg!r}"
    if dst.exists():
        copied = trees.regular_files(dst)
        assert sum(copied.values()) == 0, f"copied before the space check: {copied}"

    # With room, the same call succeeds.
    assert fs.remount_tmpfs_size(mnt, 64 * MiB) == 0
    res = stage(src, dst)
    trees.assert_same_tree(src, dst)
    assert res.bytes == 12 * MiB


@pytest.fixture(scope="module")
def eight_big_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("enospc") / "src"
    src.mkdir()
    for i in range(8):
        p = src / f"big{i}.bin"
        trees.write_patterned(p, 16 * MiB + i, seed=200 + i)
        trees.set_mtime(p, i)
    trees.write_file(src / "small.txt", b"small\n", mtime_index=9)
    return src


def test_disk_fills_up_midway(engine: str, eight_big_files: Path, small_fs: Any) -> None:
    src = eight_big_files
    mnt = small_fs("192m")
    dst = mnt / "dst"
    # Once data is being written (the space check has passed), the tmpfs's limit is
    # lowered to what it holds: the next writes fail with ENOSPC. The stage runs in a
    # child at idle priority so this process notices the first writes at once.
    # 1 MiB stripes: many writes per file, so some are still to come when the disk fills.
    child, fired = procs.run_child_with_trigger(
        procs.stage_spec(src, dst, engine=engine, stripe_size=MiB), mnt,
        lambda: fs.shrink_tmpfs_to_used(mnt))
    assert fired, "the stage finished before the disk could be filled"
    err = child.expect_error()
    assert err["is"]["OSError"] and err["errno"] == errno.ENOSPC, err
    assert err["is"]["StageError"], err
    text = f"{err['str']} {err['filename']}"
    names = [Path(rel).name for rel in trees.regular_files(src)]
    assert any(name in text for name in names), f"no file named in {text!r}"
    trees.assert_no_partial_files(src, dst)

    assert fs.remount_tmpfs_size(mnt, 192 * MiB) == 0
    res = procs.run_child(procs.stage_spec(src, dst, engine=engine, stripe_size=MiB),
                            env=procs.child_env()).expect_result()
    trees.assert_same_tree(src, dst)
    assert res["skipped"] is False
    assert res["copied_bytes"] <= res["bytes"]
    assert trees.tmp_leftovers(mnt) == []


# --------------------------------------------------------------------------------------
# Source changing under the copy
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("change", ["grow", "shrink"])
def test_source_changes_during_copy(engine: str, tmp_path: Path, small_fs: Any,
                                    change: str) -> None:
    src = tmp_path / "src"
    trees.build_small_files(src / "small", 100, per_dir=50)
    big = src / "sub" / "big.bin"
    big.parent.mkdir()
    size = 96 * MiB
    trees.write_patterned(big, size, seed=5)
    old_digest = trees.content_digest(big)
    mnt = small_fs("256m")
    dst = mnt / "dst"

    def mutate() -> None:
        if change == "grow":
            with open(big, "ab") as f:
                f.write(b"x" * MiB)
        else:
            os.truncate(big, size // 2)

    child, fired = procs.run_child_with_trigger(
        procs.stage_spec(src, dst, engine=engine), mnt, mutate)
    assert fired, "the stage finished before the source could be changed"
    err = child.expect_error()
    assert err["is"]["SourceChangedError"], err
    assert err["is"]["OSError"] and err["is"]["StageError"], err
    assert "big.bin" in f"{err['str']} {err['filename']}", err
    trees.assert_no_partial_files(src, dst, also_ok={"sub/big.bin": {old_digest}})

    res = procs.run_child(procs.stage_spec(src, dst, engine=engine),
                            env=procs.child_env()).expect_result()
    trees.assert_same_tree(src, dst)
    assert res["bytes"] == sum(trees.regular_files(src).values())


def _stage_in_child(src: str, dst: str) -> None:
    fastload.stage(src, dst, progress=False)


def test_errors_cross_process_boundaries_as_themselves(tmp_path: Path) -> None:
    # A DataLoader worker or a pool process sends its error back pickled: the class made
    # at run time (a StageError that is also FileNotFoundError) must survive it.
    import concurrent.futures
    import multiprocessing
    import pickle

    missing = tmp_path / "no-such-dataset"
    ctx = multiprocessing.get_context("spawn")
    with (concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool,
          pytest.raises(FileNotFoundError) as info):
        pool.submit(_stage_in_child, str(missing), str(tmp_path / "out")).result()
    e = info.value
    assert isinstance(e, fastload.errors.StageError) and e.errno == errno.ENOENT
    assert e.filename == str(missing) and str(missing) in str(e)
    full = fastload.errors.NotEnoughSpaceError("no room in /x", path="/x", needed=10, free=3)
    back = pickle.loads(pickle.dumps(full))
    assert type(back) is fastload.errors.NotEnoughSpaceError and str(back) == "no room in /x"
    assert (back.filename, back.needed, back.free, back.errno) == ("/x", 10, 3, errno.ENOSPC)


def test_a_combined_error_class_pickles_by_name_into_a_fresh_process() -> None:
    """A DataLoader worker sends its exception's type by name: a class stage_error()
    combines with a built-in (FileNotFoundStageError) must be found by that name in a
    process that has not made it yet (a CI run lost a worker's error to a PicklingError)."""
    import pickle
    import subprocess
    import sys

    from fastload.errors import SourceChangedError, stage_error

    exc = stage_error(errno.EACCES, "denied", "/p", SourceChangedError)
    blob = pickle.dumps((type(exc), exc))
    code = ("import pickle, sys; t, e = pickle.loads(sys.stdin.buffer.read()); "
            "print(t.__name__, isinstance(e, t), isinstance(e, PermissionError), e.filename)")
    r = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                       check=True)  # fmt: skip
    assert r.stdout.decode().split() == ["PermissionSourceChangedError", "True", "True", "/p"]
