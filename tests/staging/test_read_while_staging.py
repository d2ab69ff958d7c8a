"""Reading a tree while it stages (issue 49): stage(wait=False) returns a handle at once;
files read through it before the stage ends are the source's bytes, fetched ahead of the
rest (through the stage's own engine and journal: the store serves each file once); a
path the source lacks is FileNotFoundError at once, one leaving the tree is refused; the
stage's errors reach .wait() and every reader.

The source is a netsim mount (tests/kit/netsim.py: 2 ms per request) and the stage keeps
2 files in flight: its background order takes seconds, and what a test reads from the
end of that order comes first."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import fastload
from fastload.staging.background import Staging
from fastload.staging.state import read_manifest
from kit import trees
from kit.netsim import hold_the_listing, listed, mounts, staging_behind
from kit.trees import RWS_FILES

N = RWS_FILES


@pytest.fixture
def tree(rws_tree: Path) -> Path:
    return rws_tree


def test_reads_come_first_and_are_the_sources_bytes(tree: Path, tmp_path: Path) -> None:
    names = sorted(trees.regular_files(tree))
    with staging_behind(tmp_path, tree) as (m, dst, h):
        assert isinstance(h, Staging) and h.path == dst
        last = names[-5:]  # the end of the background order
        for rel in last:
            with h.open(rel) as f:
                assert f.read() == (tree / rel).read_bytes()
        listed(h)
        seen = h.progress()
        assert seen.state == "copying" and seen.files_total == N
        assert seen.files_done < N  # read before the stage got there
        assert h.local(names[0]).read_bytes() == (tree / names[0]).read_bytes()
        result = h.wait()
        assert h.done and result.files == N and result.copied_files == N
        counts = m.unmount()
    trees.assert_same_tree(tree, dst)
    # Every file was opened once at the source: those read first were not fetched again.
    assert counts["opens"] == N


def _listed_or_failed(h: Staging) -> None:
    deadline = time.monotonic() + 120  # (a bound on the wait, not a timing figure)
    while (p := h.progress()).state in ("waiting", "starting"):  # (this process stages)
        assert time.monotonic() < deadline, f"no listing after 120 s: {p}"
        time.sleep(0.01)


def test_reads_and_the_names_come_before_the_listing(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the stager's listing exists: files() is the source's regular files (a
    walk of its folders, no stat per file), a file asked for is fetched at once (then
    journalled by the plan, not fetched again), a path not in the source fails."""
    names = sorted(trees.regular_files(tree))
    go = hold_the_listing(monkeypatch)
    with staging_behind(tmp_path, tree) as (m, dst, h):
        assert h.files() == names
        wanted = [names[-1], names[N // 2], names[0]]
        assert [p.read_bytes() for p in h.local_all(wanted)] == [
            (tree / rel).read_bytes() for rel in wanted]  # fmt: skip
        with pytest.raises(FileNotFoundError, match=r"dir000/nope\.dat"):
            h.local("dir000/nope.dat")
        seen = h.progress()
        assert seen.state == "starting" and seen.files_total is None  # no listing yet
        go.set()
        result = h.wait()
        counts = m.unmount()
    assert result.files == N and result.copied_files == N
    trees.assert_same_tree(tree, dst)
    assert counts["opens"] == N  # the files fetched early were not fetched again
    manifest = read_manifest(dst)  # their journal records made it
    assert manifest is not None and manifest["complete"] and len(manifest["files"]) == N


def test_a_file_comes_as_it_lands_not_when_its_job_ends(tmp_path: Path) -> None:
    """A small file taken with a big one (one chunk of the plan, both in flight) reaches
    its reader as soon as it is whole, while the big one is still being read."""
    src = tmp_path / "src"
    trees.write_file(src / "a-big.bin", os.urandom(64 << 20))
    trees.write_file(src / "b-small.dat", b"small" * 200)
    with mounts(tmp_path) as mount:
        m = mount(src, 2000, 30000)  # 30 ms per read request: the big file takes seconds
        dst = tmp_path / "dst"
        h = fastload.stage(m.path, dst, wait=False)
        listed(h)
        assert h.local("b-small.dat").read_bytes() == b"small" * 200
        assert not (dst / "a-big.bin").exists()  # not yet whole (files appear whole)
        assert h.wait().files == 2
        m.unmount()
    trees.assert_same_tree(src, dst)


def test_a_path_not_in_the_source_fails_at_once(tree: Path, tmp_path: Path) -> None:
    with staging_behind(tmp_path, tree) as (_m, _dst, h):
        with pytest.raises(FileNotFoundError, match=r"dir000/nope\.dat"):
            h.local("dir000/nope.dat")
        for bad in ("../src/dir000/f00000.dat", "/etc/passwd", "dir000/../../x", ""):
            with pytest.raises(PermissionError, match="not a path inside"):
                h.local(bad)
        with pytest.raises(ValueError, match="reading only"):
            h.open("dir000/f00000.dat", "wb")
        assert not h.done  # all of that answered while the stage runs
        h.wait()
        with pytest.raises(FileNotFoundError):
            h.local("dir000/nope.dat")
        assert h.local("dir000") == tmp_path / "dst" / "dir000"


def test_a_missing_source_fails_wait_and_every_read(tmp_path: Path) -> None:
    h = fastload.stage(tmp_path / "absent", tmp_path / "dst", wait=False)
    with pytest.raises(FileNotFoundError, match="absent"):
        h.local("a.txt")
    with pytest.raises(FileNotFoundError, match="absent") as e:
        h.wait()
    assert isinstance(e.value, fastload.StageError)
    assert not h.done


def test_a_full_disk_fails_the_stage_and_its_readers(tree: Path, small_fs, tmp_path: Path
                                                     ) -> None:  # fmt: skip
    """A fresh stage's plan holds no sizes (its files' are learned as they are copied):
    a write finds the disk full, and the stage and every later read fail with
    NotEnoughSpaceError naming the destination; what is there is whole."""
    disk = small_fs("1m")
    dst = disk / "dst"
    h = fastload.stage(tree, dst, wait=False)
    deadline = time.monotonic() + 120  # (a bound on the wait, not a timing figure)
    while (p := h.progress()).state != "failed":  # (a file asked for early may fit)
        assert p.state != "done" and time.monotonic() < deadline, p
        time.sleep(0.01)
    with pytest.raises(fastload.NotEnoughSpaceError) as e:
        h.local("dir000/f00001.dat")
    assert str(dst) in str(e.value.filename)
    with pytest.raises(fastload.NotEnoughSpaceError):
        h.wait()
    for f in dst.rglob("*"):  # no partial file at a final name, no temporary left
        if f.is_file():
            assert f.read_bytes() == (tree / f.relative_to(dst)).read_bytes()


def test_a_file_changed_at_the_source_fails_its_reader(tmp_path: Path) -> None:
    """The reader that asked for a file that changed since the listing gets the
    SourceChangedError; the stage fails with it too (as a plain stage would). (The
    destination holds a folder when the stage begins: its plan is a walk's, each
    file's size listed; a fresh stage's learns them as it copies, and a file changed
    before its copy is staged as changed: test_read_while_staging_names.py.)"""
    src = tmp_path / "src"
    trees.build_small_files(src, N, per_dir=100, seed=7)
    names = sorted(trees.regular_files(src))
    victim = next(n for n in reversed(names) if (src / n).stat().st_size > 100)
    (tmp_path / "dst" / "dir000").mkdir(parents=True)
    with staging_behind(tmp_path, src) as (_m, _dst, h):
        listed(h)  # the source is listed: its sizes are the plan's
        os.truncate(src / victim, 50)  # shorter than listed
        with pytest.raises(fastload.SourceChangedError) as e:
            h.local(victim)
        assert victim in str(e.value.filename)
        other = names[-10]
        assert h.local(other).read_bytes() == (src / other).read_bytes()
        with pytest.raises(fastload.SourceChangedError):
            h.wait()


def test_a_call_right_after_a_failed_stage_starts_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed stage's thread still holds the lock for a moment after its handles
    have the error (here: its channel closes half a second late). A call in that
    moment, with other options, runs a stage of its own, not the failed one."""
    from fastload.staging import background

    src = tmp_path / "src"
    trees.build_small_files(src, 50, per_dir=25, seed=3)
    os.mkfifo(src / "dir000" / "fifo")
    close = background.Server.close

    def late(self: object) -> None:
        time.sleep(0.5)
        close(self)  # type: ignore[arg-type]

    monkeypatch.setattr(background.Server, "close", late)
    with pytest.raises(fastload.UnsupportedFileError, match="fifo"):
        fastload.stage(src, tmp_path / "dst", wait=False).wait()
    result = fastload.stage(src, tmp_path / "dst", wait=False, on_special="skip").wait()
    assert result.files == 50 and not (tmp_path / "dst" / "dir000" / "fifo").exists()


def test_a_second_call_resumes_and_a_handle_of_a_complete_stage_reads_at_once(
    tree: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "dst"
    h = fastload.stage(tree, dst, wait=False)
    h.cancel()
    with pytest.raises(fastload.StageError):
        h.wait()
    again = fastload.stage(tree, dst, wait=False)
    r = again.wait()
    assert r.files == N
    trees.assert_same_tree(tree, dst)
    third = fastload.stage(tree, dst, wait=False)
    assert third.wait().skipped
    rel = sorted(trees.regular_files(tree))[3]
    assert third.local(rel) == dst / rel
    assert third.progress().state == "done"


def test_the_handle_pickles(tree: Path, tmp_path: Path) -> None:
    import pickle

    h = fastload.stage(tree, tmp_path / "dst", wait=False, progress=lambda *a: None)
    back = pickle.loads(pickle.dumps(h))
    rel = sorted(trees.regular_files(tree))[-1]
    assert back.local(rel).read_bytes() == (tree / rel).read_bytes()
    assert back.wait().files == N
    assert os.path.samefile(back.path, h.path)


@pytest.mark.parametrize("suffix", [".tar", ".tar.zst"])
def test_an_archives_members_come_in_its_order(tree: Path, tmp_path: Path, suffix: str
                                               ) -> None:  # fmt: skip
    """A member is read as soon as the extraction passed it (the first ones long before
    the archive's end); one further on waits for it; progress() says how far the stream
    is."""
    import subprocess

    names = sorted(trees.regular_files(tree))
    store = tmp_path / "store"
    store.mkdir()
    archive = store / f"data{suffix}"
    flag = ["--zstd"] if suffix == ".tar.zst" else []
    pad = tmp_path / "pad"  # a big last member: the stream goes on well after the first
    trees.write_file(pad / "zz-pad.bin", os.urandom(24 << 20))
    subprocess.run(["tar", "-cf", str(archive), *flag, "-C", str(tree), *names,
                    "-C", str(pad), "zz-pad.bin"], check=True)  # fmt: skip
    with mounts(tmp_path) as mount:
        m = mount(store, 2000, 30000)  # 30 ms per read: the archive streams for seconds
        dst = tmp_path / "dst"
        h = fastload.stage(m.path / archive.name, dst, wait=False)
        first = h.local(names[0]).read_bytes()
        seen = h.progress()
        assert first == (tree / names[0]).read_bytes()
        assert seen.state == "copying" and seen.bytes_total == archive.stat().st_size
        assert seen.bytes_done < archive.stat().st_size  # read before the stream's end
        assert h.local(names[-1]).read_bytes() == (tree / names[-1]).read_bytes()
        with pytest.raises(FileNotFoundError):
            h.local("dir000/nope.dat")  # known once the whole archive is read
        assert h.wait().files == N + 1
        m.unmount()
    assert (dst / "zz-pad.bin").read_bytes() == (pad / "zz-pad.bin").read_bytes()
    (dst / "zz-pad.bin").unlink()
    trees.assert_same_tree(tree, dst, mtimes=False)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_imagenet_reads_its_split_while_it_stages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fastload.torchvision.ImageNet(root, wait=False): the split's class folders are
    read through the handle; meta.bin (staged first) names the classes."""
    torch = pytest.importorskip("torch")
    import fastload.torchvision as ftv

    monkeypatch.setenv("FASTLOAD_ENV", "local")
    monkeypatch.setenv("FASTLOAD_TMPDIR", str(tmp_path / "node"))
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    src = tmp_path / "imagenet"
    wnids = ["n01440764", "n01443537"]
    for w in wnids:
        for i in range(3):
            trees.write_file(src / "train" / w / f"{w}_{i}.JPEG", f"{w}{i}".encode() * 50)
    torch.save(({wnids[0]: ("tench", "Tinca tinca"), wnids[1]: ("goldfish",)}, []),
               src / "meta.bin")  # fmt: skip
    ds = ftv.ImageNet(src, split="train", wait=False, loader=_read)
    assert ds.wnids == wnids and ds.classes == [("tench", "Tinca tinca"), ("goldfish",)]
    assert ds.class_to_idx == {"tench": 0, "Tinca tinca": 0, "goldfish": 1}
    assert len(ds) == 6 and ds.targets == [0, 0, 0, 1, 1, 1]
    assert ds[4] == ((src / "train" / wnids[1] / f"{wnids[1]}_1.JPEG").read_bytes(), 1)
    assert ds.staging.wait().files == 6
    assert ds.staging.path == tmp_path / "node" / "imagenet" / "train"
    # A handle of the split itself (no meta.bin beside its copy): the classes are wnids.
    h = fastload.stage(src / "train", tmp_path / "other" / "train", wait=False)
    assert ftv.ImageNet(h, loader=_read).classes == wnids


def test_resolve_returns_the_handle(tree: Path, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("FASTLOAD_ENV", "local")
    monkeypatch.setenv("FASTLOAD_TMPDIR", str(tmp_path / "node"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))
    dst = tmp_path / "node" / "pets"
    h = fastload.resolve(str(tree), destination=dst, wait=False)
    assert isinstance(h, Staging) and h.path == dst
    rel = sorted(trees.regular_files(tree))[-1]
    assert h.local(rel).read_bytes() == (tree / rel).read_bytes()
    assert h.wait().files == N
    # Data already on the node is read where it is, through a handle all the same.
    here = fastload.resolve(str(dst), wait=False)
    assert here.done and here.local(rel) == dst / rel
    assert len(here.files()) == N
