"""A CopyJob split across several submitters, each a thread with an engine of its own
(issue 33): every file copied once and whole, the count from the cores this process may
use, and a failure in one submitter reported as itself, not as the others' stop."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fastload import _core
from kit import trees
from kit.jobs import run_copy_job

N = 300


def _tree(root: Path, n: int = N) -> tuple[list[str], list[int]]:
    names, sizes = [], []
    for i in range(n):
        rel = f"d{i % 7}/f{i:04d}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        size = (i * 7919) % 300_000  # empty, small and striped files (stripe 64 KiB below)
        (root / rel).write_bytes(os.urandom(size))
        names.append(rel)
        sizes.append(size)
    return names, sizes


def _job(src: Path, dst: Path, names: list[str], sizes: list[int], **opts: Any) -> Any:
    dst.mkdir(exist_ok=True)
    for d in {n.rsplit("/", 1)[0] for n in names}:
        (dst / d).mkdir(exist_ok=True)
    mtimes = [(src / n).stat().st_mtime_ns for n in names]
    files = _core.CopyFiles(names, names, sizes, [(s + 511) // 512 for s in sizes],
                            [0o640] * len(names), mtimes)
    opts.setdefault("stripe_size", 64 << 10)
    opts.setdefault("files_in_flight", 16)
    return _core.CopyJob(src, dst, files, _core.CopyOptions(**opts))


@pytest.mark.parametrize("submitters", [1, 3, 8])
def test_every_file_once_and_whole(tmp_path: Path, engine: str, submitters: int) -> None:
    names, sizes = _tree(tmp_path / "src")
    job = _job(tmp_path / "src", tmp_path / "dst", names, sizes, engine=engine,
               submitters=submitters)
    done = run_copy_job(job)
    job.rethrow()
    # 300 files make at most 300 // 32 = 9 shares, so each count asked for is kept.
    assert job.submitters == submitters and job.engine == engine
    assert sorted(done) == list(range(N))
    assert job.files_done == N and job.bytes_done == sum(sizes)
    for rel in names:
        a, b = tmp_path / "src" / rel, tmp_path / "dst" / rel
        assert a.read_bytes() == b.read_bytes(), rel
        assert b.stat().st_mode & 0o777 == 0o640
        assert b.stat().st_mtime_ns == a.stat().st_mtime_ns
    assert not [p for p in (tmp_path / "dst").rglob("*") if p.name.endswith(".fl-tmp")]


def test_default_count_follows_the_cores_allowed(tmp_path: Path) -> None:
    """submitters=0: one per core this thread may run on (taskset), at most 8, and no
    more than a share of 32 files each."""
    names, sizes = _tree(tmp_path / "src")
    job = _job(tmp_path / "src", tmp_path / "dst", names, sizes)
    run_copy_job(job)
    job.rethrow()
    assert job.submitters == min(len(os.sched_getaffinity(0)), 8, N // 32)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mask)})  # this thread: the job's thread inherits it
    try:
        job = _job(tmp_path / "src", tmp_path / "one", names, sizes)
        run_copy_job(job)
    finally:
        os.sched_setaffinity(0, mask)
    job.rethrow()
    assert job.submitters == 1
    few = _job(tmp_path / "src", tmp_path / "few", names[:40], sizes[:40])
    run_copy_job(few)
    few.rethrow()
    assert few.submitters == 1  # 40 files: one share


def test_one_submitters_failure_is_the_jobs_error(tmp_path: Path, engine: str) -> None:
    """A file gone from the source fails its submitter; the others stop, the error names
    that file (not "staging stopped"), and no temporary is left behind: every file in
    the destination is whole."""
    names, sizes = _tree(tmp_path / "src")
    gone = names[N // 2]
    (tmp_path / "src" / gone).write_bytes(b"")  # listed below with its old size
    job = _job(tmp_path / "src", tmp_path / "dst", names, sizes, engine=engine, submitters=4)
    (tmp_path / "src" / gone).unlink()
    done = run_copy_job(job)
    with pytest.raises(FileNotFoundError) as e:
        job.rethrow()
    assert gone in str(e.value)
    assert N // 2 not in done
    assert not [p for p in (tmp_path / "dst").rglob("*") if p.name.endswith(".fl-tmp")]
    for i in done:
        rel = names[i]
        assert (tmp_path / "dst" / rel).read_bytes() == (tmp_path / "src" / rel).read_bytes()
    copied = {str(p.relative_to(tmp_path / "dst")) for p in (tmp_path / "dst").rglob("f*")}
    assert copied == {names[i] for i in done}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_modes_whatever_the_umask_and_leftover_temporaries(
    tmp_path: Path, engine: str, umask: int
) -> None:
    """A temporary is created with its file's final mode where the umask keeps it (no
    fchmod), else set after. One an interrupted run left under the temporary name (mode
    0600, stale bytes) is never taken for the file: an anonymous temporary (O_TMPFILE,
    where the file system has it) leaves it alone, a named one truncates it. Either way
    the copy has the source's mode, bytes and time, and an older copy at the final
    name is replaced whole."""
    modes = [0o644, 0o640, 0o600, 0o664, 0o755, 0o444, 0o400, 0o2755, 0o1777]
    names = [f"d/m{i}" for i in range(len(modes))]
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "d").mkdir(parents=True)
    (dst / "d").mkdir(parents=True)
    sizes = []
    for i, rel in enumerate(names):
        (src / rel).write_bytes(os.urandom(1000 + i))
        sizes.append(1000 + i)
    # Temporaries of an interrupted run, and older copies at the final names of some
    # files (a changed source staged again).
    trees.leave_interrupted_run(dst, names, b"stale" * 1000)
    mtimes = [(src / n).stat().st_mtime_ns for n in names]
    files = _core.CopyFiles(names, names, sizes, [(s + 511) // 512 for s in sizes], modes,
                            mtimes)  # fmt: skip
    old = os.umask(umask)
    try:
        job = _core.CopyJob(src, dst, files, _core.CopyOptions(engine=engine))
        run_copy_job(job)
    finally:
        os.umask(old)
    job.rethrow()
    for rel, mode, mtime in zip(names, modes, mtimes, strict=True):
        st = (dst / rel).stat()
        assert oct(st.st_mode & 0o7777) == oct(mode), rel
        assert st.st_mtime_ns == mtime, rel
        assert (dst / rel).read_bytes() == (src / rel).read_bytes(), rel
    # What is left under temporary names is an earlier run's, untouched.
    for p in dst.rglob("*.fl-tmp"):
        assert p.read_bytes() == b"stale" * 1000, p
