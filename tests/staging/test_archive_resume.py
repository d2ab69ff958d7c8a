"""Archive extraction that is interrupted, repeated or raced (issue 3): a real child
process killed (SIGKILL) or interrupted (SIGINT) midway and then resumed; a re-run of a
complete extraction; four processes extracting one archive to one destination.

The reference for every end state is GNU tar's extraction of the same archive. Each
SIGKILL or Ctrl-C lands once a given number of files is whole at their names (a point in
the extraction's progress, not in time: on a busy machine a moment may come before the
first file, or after the last).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from fastload.staging.state import read_manifest
from kit import procs, tars, trees

pytestmark = pytest.mark.native

Stage = Callable[..., Any]


class Archive:
    def __init__(self, path: Path, ref: Path, explicit: set[str], made_dirs: set[str],
                 kwargs: dict[str, Any]) -> None:
        self.path = path
        self.ref = ref
        self.explicit = explicit
        self.made_dirs = made_dirs
        self.kwargs = kwargs
        files = trees.regular_files(ref)
        self.files = len(files)
        self.bytes = sum(files.values())


def _mixed_tree(root: Path) -> Path:
    """1,500 small files and two 32 MiB files: long enough to interrupt, quick to make."""
    trees.build_small_files(root / "small", 1500, seed=3)
    (root / "big").mkdir()
    for i in range(2):
        p = root / "big" / f"big{i}.bin"
        trees.write_patterned(p, 32 * trees.MiB + 4097 * i, seed=200 + i)
        trees.set_mtime(p, 7000 + i)
    return root


@pytest.fixture(scope="session")
def mixed_archive(tmp_path_factory: pytest.TempPathFactory) -> Archive:
    base = tmp_path_factory.mktemp("resume-archive")
    src = _mixed_tree(base / "src")
    a = tars.gnu_create(src, base / "mixed.tar", "gnu")
    shutil.rmtree(src)
    ref = tars.gnu_extract(a, base / "ref")
    return Archive(a, ref, tars.explicit_dirs(a), set(), {})


@pytest.fixture(scope="session")
def mixed_archive_gz(mixed_archive: Archive,
                     tmp_path_factory: pytest.TempPathFactory) -> Archive:
    base = tmp_path_factory.mktemp("resume-archive-gz")
    a = tars.gzip_file(mixed_archive.path, base / "mixed.tar.gz")
    return Archive(a, mixed_archive.ref, mixed_archive.explicit, set(), {})


@pytest.fixture(scope="session")
def nested_archive(tmp_path_factory: pytest.TempPathFactory) -> Archive:
    """A tar of 12 class tars of 100 small files each, and one 32 MiB file per tar
    in the first two."""
    base = tmp_path_factory.mktemp("resume-nested")
    osrc = base / "outer"
    osrc.mkdir()
    for c in range(12):
        cls = base / "classes" / f"n{c:04d}"
        trees.build_small_files(cls, 100, per_dir=100, seed=50 + c)
        if c < 2:
            trees.write_patterned(cls / "big.bin", 32 * trees.MiB, seed=300 + c)
        tars.py_create(cls, osrc / f"n{c:04d}.tar", "gnu")
    a = tars.gnu_create(osrc, base / "train.tar", "gnu", dot=False)
    shutil.rmtree(base / "classes")
    shutil.rmtree(osrc)
    ref, made_dirs = tars.gnu_extract_nested(a, base / "ref")
    return Archive(a, ref, tars.explicit_dirs(a, nested=True), made_dirs, {"unpack": "nested"})


def spec(a: Archive, dst: Path, engine: str, **more: Any) -> dict[str, Any]:
    return procs.stage_spec(a.path, dst, engine=engine, **a.kwargs, **more)


def landed(child: procs.Child, sig: int) -> bool:
    """Whether ``sig`` ended the child before its stage() returned."""
    return child.returncode == -sig and child.result is None and child.error is None


def assert_extracted(a: Archive, dst: Path) -> None:
    tars.assert_same_extraction(a.ref, dst, explicit=a.explicit, skip_meta=a.made_dirs)
    trees.assert_no_tmp(dst)


def resume(a: Archive, dst: Path, engine: str) -> dict[str, Any]:
    """In a child too: a lock left by a killed process would hang this one."""
    res = procs.run_child(spec(a, dst, engine), timeout=180,
                            env=procs.child_env()).expect_result()
    assert_extracted(a, dst)
    assert (res["files"], res["bytes"]) == (a.files, a.bytes)
    assert 0 <= res["copied_files"] <= a.files
    return res


def kill_and_resume(a: Archive, tmp_path: Path, engine: str,
                    fractions: tuple[float, ...]) -> list[tuple[float, int, int]]:
    """Kills an extraction once each fraction of the archive's files is done, and
    resumes it; each resume extracts no member that was whole. Returns (fraction,
    complete files after the kill, files the resume extracted) for each kill that landed
    before the end."""
    killed = []
    for i, frac in enumerate(fractions):
        # An extraction can finish between two looks at its destination; then the same
        # point is tried again, earlier.
        for attempt in range(4):
            dst = tmp_path / f"dst{i}-{attempt}"
            child = procs.signal_once_done(spec(a, dst, engine), dst,
                                         max(1, int(frac * a.files / 2**attempt)))
            complete = trees.assert_no_partial_files(a.ref, dst)
            res = resume(a, dst, engine)
            # Nothing whole is extracted again. (Not "==": the kernel may finish a rename
            # the killed process queued after its files were counted.)
            assert res["copied_files"] <= a.files - complete, (res, complete)
            if landed(child, signal.SIGKILL):
                killed.append((frac / 2**attempt, complete, res["copied_files"]))
                break
            assert res["skipped"] is True, res
    assert killed, "every extraction finished before it could be killed"
    return killed


@pytest.mark.parametrize("tmpfile", ["1", "0"], ids=["O_TMPFILE", "named-temporaries"])
def test_sigkill_then_resume(engine: str, mixed_archive: Archive, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch, tmpfile: str) -> None:
    """Files created unnamed and linked once whole, or (FASTLOAD_TMPFILE=0, as where the
    file system has no O_TMPFILE) written under temporary names and renamed."""
    monkeypatch.setenv("FASTLOAD_TMPFILE", tmpfile)
    killed = kill_and_resume(mixed_archive, tmp_path, engine, (0.4, 0.7))
    assert all(copied < mixed_archive.files for _, _, copied in killed), (
        "a resume extracted again members already complete: (fraction, complete files "
        f"after the kill, files extracted by the resume) = {killed}, "
        f"files = {mixed_archive.files}")


@pytest.mark.slow
def test_sigkill_then_resume_gzip(engine: str, mixed_archive_gz: Archive,
                                  tmp_path: Path) -> None:
    """A gzip stream cannot be seeked; the resume still ends with GNU tar's tree."""
    kill_and_resume(mixed_archive_gz, tmp_path, engine, (0.3, 0.6))


@pytest.mark.slow
def test_sigkill_then_resume_nested(engine: str, nested_archive: Archive,
                                    tmp_path: Path) -> None:
    killed = kill_and_resume(nested_archive, tmp_path, engine, (0.3, 0.6))
    assert all(copied < nested_archive.files for _, _, copied in killed), killed


def test_repeated_kills_then_resume(engine: str, mixed_archive: Archive,
                                    tmp_path: Path) -> None:
    """Each run resumes the previous partial state and is itself killed, later in the
    archive each time: what one run finished, the next keeps."""
    for attempt in range(5):  # from the start, earlier, where a run finished first
        dst = tmp_path / f"dst{attempt}"
        whole = [0]
        for _ in range(2):  # each killed 30% of the files further on
            more = max(1, int(0.3 * mixed_archive.files / 2**attempt))
            child = procs.signal_once_done(spec(mixed_archive, dst, engine), dst,
                                           whole[-1] + more)
            whole.append(trees.assert_no_partial_files(mixed_archive.ref, dst))
            if not landed(child, signal.SIGKILL):
                break
        else:
            break  # two kills, each before the end
    else:
        pytest.fail("a run finished before its kill in every attempt")
    res = resume(mixed_archive, dst, engine)
    assert res["skipped"] is False
    assert 0 < res["copied_files"] <= mixed_archive.files - whole[-1], (res, whole)
    assert fastload.verify(dst).ok


def _complete(dst: Path) -> bool:
    """Whether the stage finished (its manifest says so): the condition under which
    verify() stops raising, read without re-reading every file."""
    manifest = read_manifest(dst)
    return bool(manifest and manifest.get("complete"))


def test_ctrl_c_stops_and_resumes(engine: str, mixed_archive: Archive, tmp_path: Path) -> None:
    for attempt, frac in enumerate((0.4, 0.2, 0.1, 0.05)):
        dst = tmp_path / f"dst{attempt}"
        child = procs.signal_once_done({**spec(mixed_archive, dst, engine), "progress": True},
                                       dst, max(1, int(frac * mixed_archive.files)),
                                       signal.SIGINT)
        if child.returncode != 0 and not _complete(dst):
            break  # (a Ctrl-C after stage() returned, before the child printed, is late)
    else:
        pytest.fail("every extraction finished before Ctrl-C arrived")
    assert child.result is None
    assert child.error is None, f"Ctrl-C became another exception: {child.error}"
    assert "KeyboardInterrupt" in child.stderr, child.stderr[-2000:]
    trees.assert_no_partial_files(mixed_archive.ref, dst)
    with pytest.raises(fastload.StageError):
        fastload.verify(dst)  # not complete
    res = resume(mixed_archive, dst, engine)
    assert res["skipped"] is False


def test_second_run_is_skipped(stage: Stage, mixed_archive: Archive, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    first = stage(mixed_archive.path, dst)
    assert (first.files, first.bytes) == (mixed_archive.files, mixed_archive.bytes)
    assert first.copied_files == first.files and not first.skipped
    probe = dst / "big" / "big0.bin"
    before = os.stat(probe)
    second = stage(mixed_archive.path, dst)
    assert second.skipped is True
    assert (second.files, second.bytes) == (first.files, first.bytes)
    assert second.copied_files == 0
    after = os.stat(probe)
    assert (after.st_ino, after.st_mtime_ns, after.st_ctime_ns) == (
        before.st_ino, before.st_mtime_ns, before.st_ctime_ns), "the re-run rewrote files"
    assert_extracted(mixed_archive, dst)


def test_nested_second_run_is_skipped(stage: Stage, nested_archive: Archive,
                                      tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    stage(nested_archive.path, dst, unpack="nested")
    assert_extracted(nested_archive, dst)
    assert stage(nested_archive.path, dst, unpack="nested").skipped is True


def test_changed_archive_is_extracted_again(stage: Stage, tmp_path: Path) -> None:
    """Same archive path, new content: not skipped; the new members are there."""
    T = tars.tinfo
    a = tmp_path / "in" / "data.tar"
    tars.members_archive(a, [(T("x.txt", mtime=1_600_000_000), b"version one\n")])
    dst = tmp_path / "dst"
    stage(a, dst)
    assert (dst / "x.txt").read_bytes() == b"version one\n"
    tars.members_archive(a, [(T("x.txt", mtime=1_600_000_100), b"version two!\n"),
                           (T("y.txt"), b"new\n")])
    res = stage(a, dst)
    assert res.skipped is False
    assert (dst / "x.txt").read_bytes() == b"version two!\n"
    assert (dst / "y.txt").read_bytes() == b"new\n"
    assert fastload.verify(dst).ok


@pytest.mark.parametrize("n_procs", [4])
def test_concurrent_extractors_make_one_extraction(engine: str, mixed_archive: Archive,
                                                   tmp_path: Path, n_procs: int) -> None:
    dst = tmp_path / "data" / "dst"
    dst.parent.mkdir()
    s = {**spec(mixed_archive, dst, engine), "wait_stdin": True}
    children = [procs.Child(s, env=procs.child_env(), stdin=True) for _ in range(n_procs)]
    try:
        for c in children:  # all imported and waiting: start them together
            assert c.wait_line("READY") is not None, c.finish().stderr
        for c in children:
            c.go()
    finally:
        for c in children:
            c.finish(timeout=180)
    results = [c.expect_result() for c in children]
    for r in results:
        assert (r["files"], r["bytes"]) == (mixed_archive.files, mixed_archive.bytes), r
        assert r["path"] == str(dst)
    extractors = [r for r in results if r["copied_files"] > 0]
    assert len(extractors) == 1, f"{len(extractors)} processes extracted: {results}"
    assert extractors[0]["copied_files"] == mixed_archive.files
    for r in results:
        if r is not extractors[0]:
            assert r["skipped"] is True or r["copied_files"] == 0, r
    assert_extracted(mixed_archive, dst)
    leftovers = {p.name for p in dst.parent.iterdir()} - {"dst"} - tars.state_names(dst)
    assert not leftovers, leftovers
