"""The one engine rule (io::resolve_kind, issue 31) as staging and ``fastload probe`` see
it, and the option objects of the native jobs (CopyOptions, CopyFiles, ExtractOptions)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fastload
from fastload import _core
from fastload.staging.engine import resolve_engine
from kit import tars, trees
from kit.netsim import mounts

PLAIN = fastload.available_engines()[0]  # what "auto" runs on a local disk here


def test_auto_follows_the_environment_and_explicit_kinds_do_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FASTLOAD_ENGINE", raising=False)
    assert resolve_engine("auto") == PLAIN
    assert resolve_engine("auto", tmp_path) == PLAIN
    assert resolve_engine("pread", tmp_path) == "pread"
    monkeypatch.setenv("FASTLOAD_ENGINE", "Pread")
    assert resolve_engine("auto", tmp_path) == "pread"
    if "uring" in fastload.available_engines():
        assert resolve_engine("uring") == "uring"  # asked for: kept


def test_a_malformed_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FASTLOAD_ENGINE", "aio")
    with pytest.raises(ValueError, match="FASTLOAD_ENGINE='aio'"):
        resolve_engine("auto")
    assert resolve_engine("pread") == "pread"
    src = tmp_path / "src"
    trees.build_small_files(src, 3)
    with pytest.raises(ValueError, match="FASTLOAD_ENGINE='aio'"):
        fastload.stage(src, tmp_path / "dst")
    tars.members_archive(tmp_path / "a.tar", [(tars.tinfo("f"), b"x")])
    with pytest.raises(ValueError, match="FASTLOAD_ENGINE='aio'"):
        fastload.stage(tmp_path / "a.tar", tmp_path / "x")


def test_probe_plans_the_engine_stage_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """probe used to map "auto" to io_uring by itself, ignoring FASTLOAD_ENGINE."""
    src = tmp_path / "src"
    trees.build_small_files(src, 4)
    monkeypatch.setenv("FASTLOAD_ENGINE", "pread")
    planned = fastload.probe(src, dest=tmp_path, seconds=0.3).plan.engine
    ran = fastload.stage(src, tmp_path / "dst").engine
    assert planned == ran == "pread"
    monkeypatch.delenv("FASTLOAD_ENGINE")
    planned = fastload.probe(src, dest=tmp_path, seconds=0.3).plan.engine
    ran = fastload.stage(src, tmp_path / "dst2").engine
    assert planned == ran == PLAIN


def test_auto_takes_the_pool_on_a_network_mount(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The rule looks at the path a job names: a FUSE mount (netsim) means pread, for the
    plan and for the job that runs."""
    monkeypatch.delenv("FASTLOAD_ENGINE", raising=False)
    src = tmp_path / "src"
    trees.build_small_files(src, 4)
    with mounts(tmp_path) as mount:
        mnt = mount(src, 0, 0).path
        assert resolve_engine("auto", mnt) == "pread"
        assert fastload.stage(mnt, tmp_path / "dst").engine == "pread"
    trees.assert_same_tree(src, tmp_path / "dst")


def test_option_objects_check_their_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown engine 'aio'"):
        _core.CopyOptions(engine="aio")
    opts = _core.CopyOptions(engine="pread", engine_path=tmp_path, files_in_flight=3)
    assert (opts.engine, opts.files_in_flight, opts.engine_path) == ("pread", 3, str(tmp_path))
    with pytest.raises(ValueError, match="unknown engine"):
        opts.engine = "bogus"
    with pytest.raises(ValueError, match="differ in length"):
        _core.CopyFiles(["a", "b"], ["a", "b"], [1], [1, 1], [0o644] * 2, [0, 0])
    with pytest.raises(ValueError, match="dst list length"):
        _core.CopyFiles(["a"], ["a", "b"], [1], [1], [0o644], [0])
    assert len(_core.CopyFiles(["a"], None, [1], [1], [0o644], [0])) == 1
    with pytest.raises(ValueError, match="unknown compression 'lz4'"):
        _core.ExtractOptions(compression="lz4")
    ex = _core.ExtractOptions(compression="gzip", engine="pread", files_in_flight=5)
    assert (ex.compression, ex.engine, ex.files_in_flight) == ("gzip", "pread", 5)


def test_a_copy_job_runs_from_its_option_objects(tmp_path: Path) -> None:
    src = tmp_path / "src"
    names = [f"f{i}" for i in range(40)]
    src.mkdir()
    for i, n in enumerate(names):
        (src / n).write_bytes(bytes([i]) * (i * 1000))
    dst = tmp_path / "dst"
    dst.mkdir()
    sizes = [i * 1000 for i in range(40)]
    files = _core.CopyFiles(names, names, sizes, [(s + 511) // 512 for s in sizes],
                            [0o644] * 40, [0] * 40)
    job = _core.CopyJob(src, dst, files, _core.CopyOptions(engine="pread", files_in_flight=4))
    job.start()
    while not job.wait(100):
        pass
    job.rethrow()
    assert job.engine == "pread" and job.files_done == 40
    assert sorted(i for i, _ in job.take_done()) == list(range(40))
    for n in names:
        assert (dst / n).read_bytes() == (src / n).read_bytes()


def test_a_job_told_the_source_is_networked_sends_no_statfs(tmp_path: Path) -> None:
    """copy_options() tells each job what the source's file system is (CopyOptions
    .src_network), so a job does not ask statfs(2), a round trip on a network file
    system: a background stage runs a job per chunk, and per readers' batch. netsim
    counts every metadata request; the same jobs asked, cost one more each."""
    from fastload.staging.job import copy_options

    jobs = 10

    src = tmp_path / "src"
    trees.build_small_files(src, 3)
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file())
    sts = [(src / n).stat() for n in names]
    listed = ([st.st_size for st in sts], [st.st_blocks for st in sts],
              [st.st_mode & 0o7777 for st in sts], [st.st_mtime_ns for st in sts])  # fmt: skip
    meta = {}
    for told in (True, False):
        with mounts(tmp_path) as mount:
            m = mount(src, 0, 0)
            opts = copy_options("pread", 2, 1 << 20, m.path, None)
            assert opts.src_network == 1
            if not told:
                opts = _core.CopyOptions(engine="pread", files_in_flight=2)
                assert opts.src_network == -1
            for k in range(jobs):
                dst = tmp_path / f"dst-{told}-{k}"
                for n in names:
                    (dst / n).parent.mkdir(parents=True, exist_ok=True)
                job = _core.CopyJob(m.path, dst, _core.CopyFiles(names, names, *listed), opts)
                job.start()
                while not job.wait(100):
                    pass
                job.rethrow()
                trees.assert_same_tree(src, dst)
            meta[told] = m.unmount()["meta"]
    # One statfs per job asked (about: a name looked up again once the kernel's entry
    # cache, 1 s, expired mid-pass would count too); none where told.
    assert jobs - 3 <= meta[False] - meta[True] <= jobs + 3, meta
    assert copy_options("pread", 2, 1 << 20, src, None).src_network == 0
    assert copy_options("pread", 2, 1 << 20, None, None).src_network == -1
