"""A fresh stage in the background plans from the names its schedule walked (issue 49):
no stat per file before the copy starts (on a network file system, a round trip each,
which the first batches would queue behind); each file's size, blocks, mode and time
are learned when the copy opens it (CopyFiles' ``stat_at_open``).

What must hold all the same: the copy is the source's, modes and times included, sparse
files stay sparse; the manifest is the one a walk's plan makes (a later ``stage()``
finds the copy complete); a tree holding links or special files is walked as before;
progress says the bytes' total once it is known, not a partial sum."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import fastload
from fastload.staging.state import read_manifest
from kit import trees
from kit.netsim import listed, mounts, staging_behind

N = 300


def _varied(root: Path) -> dict[str, bytes]:
    """A tree of every size the copier treats apart (empty, small, one big stripe,
    several stripes, sparse), odd modes and set times on files and folders; its
    regular files' bytes."""
    files = {
        "empty": b"",
        "one": b"x",
        "a/small.bin": os.urandom(1000),
        "a/b/exec.sh": b"#!/bin/sh\necho hi\n",
        "a/b/above-small.bin": os.urandom(300 << 10),
        "c/stripes.bin": os.urandom((9 << 20) + 17),
    }
    for rel, data in files.items():
        trees.write_file(root / rel, data)
    with open(root / "c/sparse.bin", "wb") as f:  # a hole of 24 MiB, then data
        f.seek(24 << 20)
        f.write(b"tail")
    files["c/sparse.bin"] = b"\0" * (24 << 20) + b"tail"
    os.chmod(root / "a/small.bin", 0o600)
    os.chmod(root / "a/b/exec.sh", 0o755)
    for k, rel in enumerate(["a/b/exec.sh", "a/small.bin", "one", "c/sparse.bin"]):
        os.utime(root / rel, ns=(10**9 * (k + 1), 10**9 * (k + 1) + 123))
    os.chmod(root / "a/b", 0o750)
    os.chmod(root / "c", 0o700)
    for k, rel in enumerate(["a/b", "a", "c"]):  # deepest first: a child's change is undone
        os.utime(root / rel, ns=(10**9 * (k + 7), 10**9 * (k + 7) + 9))
    return files


def _dir_times(root: Path) -> dict[str, int]:
    return {str(d.relative_to(root)): d.stat().st_mtime_ns for d in root.rglob("*") if d.is_dir()}


def test_a_fresh_stage_learns_each_file_as_it_copies_it(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = _varied(src)
    result = fastload.stage(src, dst, wait=False).wait()
    assert result.files == len(files) and result.bytes == sum(map(len, files.values()))
    trees.assert_same_tree(src, dst)
    assert _dir_times(dst) == _dir_times(src)
    assert (dst / "c/sparse.bin").stat().st_blocks * 512 < 12 << 20  # most of the hole stays
    manifest = read_manifest(dst)
    assert manifest is not None and manifest["complete"]
    for rel, data in files.items():
        rec, st = manifest["files"][rel], (src / rel).stat()
        assert (rec.size, rec.mtime_ns, rec.mode) == (len(data), st.st_mtime_ns,
                                                      st.st_mode & 0o7777)  # fmt: skip
    # The manifest is a walk's: a plain stage of the same tree finds the copy complete.
    again = fastload.stage(src, dst)
    assert again.skipped and again.copied_files == 0
    assert fastload.verify(dst).ok


def test_progress_has_no_bytes_total_till_the_files_are_copied(tmp_path: Path) -> None:
    src = tmp_path / "src"
    trees.build_small_files(src, N, per_dir=100, seed=11)
    with staging_behind(tmp_path, src) as (_m, _dst, h):
        listed(h)
        seen = h.progress()
        assert seen.state == "copying" and seen.files_total == N
        assert seen.bytes_total is None  # not the sum of the sizes learned so far
        result = h.wait()
    end = h.progress()
    assert end.bytes_total == end.bytes_done == result.bytes == sum(
        (src / n).stat().st_size for n in trees.regular_files(src))  # fmt: skip


def test_a_file_changed_before_its_copy_is_staged_as_it_is_then(tmp_path: Path) -> None:
    """The plan holds no size to contradict: a file changed after the plan was made
    but before its copy is copied as the copy finds it (a change during its copy is
    still SourceChangedError: the copier's own check)."""
    src = tmp_path / "src"
    trees.build_small_files(src, N, per_dir=100, seed=13)
    names = sorted(trees.regular_files(src))
    victim = next(n for n in reversed(names) if (src / n).stat().st_size > 100)
    with staging_behind(tmp_path, src) as (_m, dst, h):
        listed(h)
        os.truncate(src / victim, 50)
        assert h.local(victim).read_bytes() == (src / victim).read_bytes()
        result = h.wait()
    assert result.files == N
    trees.assert_same_tree(src, dst)
    manifest = read_manifest(dst)
    assert manifest is not None and manifest["files"][victim].size == 50


def test_a_tree_with_links_and_a_fifo_is_walked_as_before(tmp_path: Path) -> None:
    """Links and special files need a stat (where a link points; what to refuse): the
    names walk gives up on such a tree, and the stager's own walk lists it."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _varied(src)
    os.symlink("small.bin", src / "a/link")
    os.mkfifo(src / "c/fifo")
    with pytest.raises(fastload.UnsupportedFileError, match="fifo"):
        fastload.stage(src, dst, wait=False).wait()
    result = fastload.stage(src, dst, wait=False, on_special="skip").wait()
    assert result.files == 7
    assert os.readlink(dst / "a/link") == "small.bin"
    assert not (dst / "c/fifo").exists()
    os.unlink(src / "c/fifo")
    trees.assert_same_tree(src, dst)


def test_a_tree_made_by_gnu_tar_stages_the_same_either_way(tmp_path: Path) -> None:
    """A tree unpacked by GNU tar (its times and modes as tar sets them), staged fresh
    in the background and by a plain stage: the two manifests are the same."""
    made = tmp_path / "made"
    _varied(made)
    tar = tmp_path / "t.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(made), "."], check=True)
    src = tmp_path / "src"
    src.mkdir()
    subprocess.run(["tar", "-xpf", str(tar), "-C", str(src)], check=True)
    fastload.stage(src, tmp_path / "bg", wait=False).wait()
    fastload.stage(src, tmp_path / "fg")
    bg, fg = read_manifest(tmp_path / "bg"), read_manifest(tmp_path / "fg")
    assert bg is not None and fg is not None
    assert bg["fingerprint"] == fg["fingerprint"]
    assert dict(bg["files"]) == dict(fg["files"])


def test_the_source_is_asked_one_lookup_per_file(tmp_path: Path) -> None:
    """The stager's walk stat'ed each file, and its copy, seconds later on a network
    file system, looked each name up again (netsim, as the kernel's FUSE client, trusts
    a lookup for a second); from the names, each file is looked up once, by its open.
    netsim counts its metadata requests: a lookup and an open per file, and a few per
    folder. (Reads take 20 ms, 2 files in flight: the copy takes seconds.)"""
    src = tmp_path / "src"
    trees.build_small_files(src, N, per_dir=100, seed=17)
    with mounts(tmp_path) as mount:
        m = mount(src, 2000, 20000)
        dst = tmp_path / "dst"
        result = fastload.stage(m.path, dst, wait=False, workers=2).wait()
        counts = m.unmount()
    assert result.files == N
    trees.assert_same_tree(src, dst)
    assert counts["opens"] == N
    assert counts["meta"] < 2 * N + 50, counts


def test_a_job_says_each_file_as_it_lands_and_what_it_found(tmp_path: Path) -> None:
    """The copier itself: ``wait(any_done=True)`` returns as soon as a file is done
    (a small one, while a big one is still read at 30 ms a request), not when the job
    ends; a ``stat_at_open`` task's size, blocks, mode and time are the source's."""
    from fastload import _core

    src = tmp_path / "src"
    trees.write_file(src / "big.bin", os.urandom(32 << 20))
    trees.write_file(src / "small.bin", b"s" * 1000)
    os.chmod(src / "small.bin", 0o640)
    os.utime(src / "small.bin", ns=(5, 1_234_567_891))
    names = [b"big.bin", b"small.bin"]
    with mounts(tmp_path) as mount:
        m = mount(src, 2000, 30000)
        dst = tmp_path / "dst"
        dst.mkdir()
        job = _core.CopyJob(str(m.path), str(dst),
                            _core.CopyFiles(names, names, [0, 0], [0, 0], [0, 0], [0, 0],
                                            stat_at_open=True),
                            _core.CopyOptions(files_in_flight=2))  # fmt: skip
        job.start()
        finished = job.wait(60_000, any_done=True)  # (a bound: a file, or the job's end)
        first = job.take_done()
        while not job.wait(100):
            pass
        job.rethrow()
        m.unmount()
    assert not finished and [i for i, _d in first] == [1]  # the small one, the big one on
    st = (src / "small.bin").stat()
    assert job.task_meta(1) == (1000, st.st_blocks, 0o640, 1_234_567_891)
    assert job.task_meta(0)[0] == 32 << 20
    assert (dst / "small.bin").read_bytes() == b"s" * 1000
    assert (dst / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
