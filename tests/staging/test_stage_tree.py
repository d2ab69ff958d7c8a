"""fastload.stage() on files and trees: what lands in the destination, and what does not."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit import fs, trees
from kit.tools import missing
from kit.trees import MiB

pytestmark = pytest.mark.native

Stage = Callable[..., Any]


def state_entries(dst: Path) -> set[str]:
    return {f".{dst.name}.fastload.lock", f".{dst.name}.fastload"}


def assert_clean_beside(dst: Path) -> None:
    """Beside dst there is nothing but dst, its lock and its state directory, and the
    manifest is there."""
    extra = {p.name for p in dst.parent.iterdir()} - {dst.name} - state_entries(dst)
    assert not extra, f"left beside the destination: {sorted(extra)}"
    manifest = dst.parent / f".{dst.name}.fastload" / "manifest.json"
    assert manifest.is_file()
    json.loads(manifest.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------------------
# Single files
# --------------------------------------------------------------------------------------


@pytest.fixture
def one_file(tmp_path: Path) -> Path:
    p = tmp_path / "in" / "sample.bin"
    trees.write_file(p, os.urandom(MiB + 17), mode=0o640, mtime_index=3)
    return p


def test_file_to_new_path(stage: Stage, engine: str, one_file: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out" / "copy.bin"
    dst.parent.mkdir()
    res = stage(one_file, dst)
    assert isinstance(res.path, Path)
    assert res.path == dst
    trees.assert_same_file(one_file, dst)
    assert (res.files, res.bytes) == (1, MiB + 17)
    assert (res.copied_files, res.copied_bytes) == (1, MiB + 17)
    assert res.skipped is False
    assert res.engine == engine
    assert isinstance(res.seconds, float) and res.seconds >= 0
    assert trees.tmp_leftovers(dst.parent) == []


def test_file_into_existing_dir(stage: Stage, one_file: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "other.txt").write_bytes(b"already here")
    res = stage(str(one_file), str(dst))  # str paths are accepted too
    assert res.path == dst / "sample.bin"
    trees.assert_same_file(one_file, dst / "sample.bin")
    assert (dst / "other.txt").read_bytes() == b"already here"
    assert (res.files, res.bytes, res.copied_files) == (1, MiB + 17, 1)
    assert trees.tmp_leftovers(dst) == []


def test_empty_file(stage: Stage, tmp_path: Path) -> None:
    src = tmp_path / "empty"
    trees.write_file(src, b"", mode=0o600, mtime_index=1)
    dst = tmp_path / "empty.copy"
    res = stage(src, dst)
    trees.assert_same_file(src, dst)
    assert (res.files, res.bytes) == (1, 0)


# --------------------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------------------


def test_rich_tree(stage: Stage, rich_src: Path, tmp_path: Path, totals: Any) -> None:
    dst = tmp_path / "dst"
    res = stage(rich_src, dst)
    assert res.path == dst
    trees.assert_same_tree(rich_src, dst)
    n, size = totals(rich_src)
    assert res.bytes == size
    # Whether symlinks count as files is not settled; regular files always do.
    n_links = sum(1 for p in trees.walk_entries(rich_src).values() if p.is_symlink())
    assert n <= res.files <= n + n_links
    assert res.copied_bytes == size
    assert res.skipped is False
    assert_clean_beside(dst)


def test_rich_tree_details(stage: Stage, rich_src: Path, tmp_path: Path) -> None:
    """The same as assert_same_tree checks, spelled out, so a failure says which."""
    dst = tmp_path / "dst"
    stage(rich_src, dst)
    deep = trees.deep_dir(dst)
    assert (deep / "leaf.txt").read_bytes() == b"deep leaf\n"
    assert (deep / trees.LONG_ASCII).read_bytes() == b"deep and long\n"
    assert (dst / "long" / trees.LONG_UNICODE).stat().st_size == 300
    assert (dst / trees.UNICODE_DIR / trees.UNICODE_FILE).is_file()
    assert (dst / "empty.txt").stat().st_size == 0
    assert (dst / "empty_dir").is_dir() and not any((dst / "empty_dir").iterdir())
    assert (dst / "nested" / "empty" / "inner").is_dir()
    for rel, mode in [("modes/rw.bin", 0o600), ("modes/exec.sh", 0o755),
                      ("modes/ro.txt", 0o444), ("modes/ro_dir", 0o555),
                      ("modes/private_dir", 0o700)]:
        assert stat.S_IMODE(os.lstat(dst / rel).st_mode) == mode, rel
    assert (dst / "modes" / "ro_dir" / "inside.txt").read_bytes() == b"in a 0555 dir\n"
    assert os.readlink(dst / "link_to_file") == "data/file.bin"
    assert os.readlink(dst / "link_to_dir") == "data"
    assert (dst / "link_to_dir").is_symlink()
    assert os.readlink(dst / "data" / "up_link") == "../top.txt"
    assert (dst / "data" / "up_link").read_bytes() == b"top level\n"
    for rel in ["top.txt", "data/medium.bin", "sparse.bin", "modes/ro.txt"]:
        assert os.stat(dst / rel).st_mtime_ns == os.stat(rich_src / rel).st_mtime_ns, rel


def test_many_small_files(stage: Stage, small_files_src: Path, tmp_path: Path,
                          totals: Any) -> None:
    dst = tmp_path / "dst"
    res = stage(small_files_src, dst)
    trees.assert_same_tree(small_files_src, dst)
    assert (res.files, res.bytes) == totals(small_files_src)
    assert res.copied_files == res.files
    assert_clean_beside(dst)


def test_into_existing_empty_dir(stage: Stage, rich_src: Path, tmp_path: Path) -> None:
    """cp -r src/. dst: an existing empty dst receives the source's contents."""
    dst = tmp_path / "dst"
    dst.mkdir()
    stage(rich_src, dst)
    trees.assert_same_tree(rich_src, dst)


@pytest.mark.parametrize("workers", [1, 8])
def test_workers_and_stripes(stage: Stage, rich_src: Path, tmp_path: Path,
                             workers: int) -> None:
    dst = tmp_path / "dst"
    stage(rich_src, dst, workers=workers, stripe_size=256 * 1024)
    trees.assert_same_tree(rich_src, dst)


def test_stage_creates_missing_parents(stage: Stage, rich_src: Path, tmp_path: Path) -> None:
    """Not in the spec in so many words; a node-local path like /tmp/job/data/x whose
    parents do not exist yet is the ordinary case."""
    dst = tmp_path / "a" / "b" / "dst"
    stage(rich_src, dst)
    trees.assert_same_tree(rich_src, dst)


# --------------------------------------------------------------------------------------
# Sparse and big files
# --------------------------------------------------------------------------------------


def test_sparse_file_stays_sparse(stage: Stage, tmp_path: Path) -> None:
    src = tmp_path / "holes.bin"
    with open(src, "wb") as f:
        f.truncate(64 * MiB)
        f.write(os.urandom(4096))
        f.seek(64 * MiB - 4096)
        f.write(os.urandom(4096))
    if fs.allocated_bytes(src) > MiB:
        missing("this file system does not keep holes")
    dst = tmp_path / "holes.copy"
    stage(src, dst, stripe_size=MiB)
    trees.assert_same_file(src, dst)
    # Two stripes hold data; the 62 whole-hole stripes must not be written.
    assert fs.allocated_bytes(dst) <= 4 * MiB, fs.allocated_bytes(dst)


def test_file_over_4gib(stage: Stage, tmp_path: Path) -> None:
    """Sparse source: costs no disk. A copier that reads the holes takes a few seconds
    here; one that writes them fails the allocation check."""
    size = 4 * trees.GiB + 3 * MiB + 7
    src = tmp_path / "huge.bin"
    marks = {0: os.urandom(MiB), 4 * trees.GiB - 512 * 1024: os.urandom(MiB),
             size - 7: b"theend!"}
    with open(src, "wb") as f:
        f.truncate(size)
        for off, data in marks.items():
            f.seek(off)
            f.write(data)
    if fs.allocated_bytes(src) > 64 * MiB:
        missing("this file system does not keep holes")
    dst = tmp_path / "huge.copy"
    res = stage(src, dst)
    assert res.bytes == size
    assert dst.stat().st_size == size
    with open(dst, "rb") as f:
        for off, data in marks.items():
            f.seek(off)
            assert f.read(len(data)) == data, f"bytes at {off} differ"
    trees.assert_same_file(src, dst)  # holes read as zero; data compared everywhere
    assert fs.allocated_bytes(dst) <= 512 * MiB, "the copy of the holes is not sparse"


# --------------------------------------------------------------------------------------
# include / exclude
# --------------------------------------------------------------------------------------


@pytest.fixture
def filter_src(tmp_path: Path) -> Path:
    root = tmp_path / "fsrc"
    files = ["a/x.txt", "a/y.bin", "a/b/z.txt", "a/b/w.bin", "c/w.txt", "c/a/q.txt",
             "top.txt", "top.bin", "logs/keep.txt", "logs/run.log"]
    for i, rel in enumerate(files):
        trees.write_file(root / rel, f"{rel}\n".encode() * (i + 1), mtime_index=i)
    (root / "e").mkdir()
    return root


def _staged_files(dst: Path) -> set[str]:
    return set(trees.regular_files(dst))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param({"include": "*.txt"},
                     {"a/x.txt", "a/b/z.txt", "c/w.txt", "c/a/q.txt", "top.txt",
                      "logs/keep.txt"}, id="include-basename-glob"),
        pytest.param({"include": ["a/*", "top.bin"]},
                     {"a/x.txt", "a/y.bin", "a/b/z.txt", "a/b/w.bin", "top.bin"},
                     id="include-star-crosses-slash"),
        pytest.param({"include": "a/b/*.txt"}, {"a/b/z.txt"}, id="include-full-path"),
        pytest.param({"exclude": "*.bin"},
                     {"a/x.txt", "a/b/z.txt", "c/w.txt", "c/a/q.txt", "top.txt",
                      "logs/keep.txt", "logs/run.log"}, id="exclude-glob"),
        pytest.param({"exclude": "a"},
                     {"c/w.txt", "top.txt", "top.bin", "logs/keep.txt", "logs/run.log"},
                     id="exclude-dir-by-basename-prunes-all-a"),
        pytest.param({"exclude": ["a/b", "logs/*.log"]},
                     {"a/x.txt", "a/y.bin", "c/w.txt", "c/a/q.txt", "top.txt", "top.bin",
                      "logs/keep.txt"}, id="exclude-dir-path"),
        pytest.param({"include": "*.txt", "exclude": ["a/*", "logs"]},
                     {"c/w.txt", "c/a/q.txt", "top.txt"}, id="include-and-exclude"),
    ],
)
def test_include_exclude(stage: Stage, filter_src: Path, tmp_path: Path,
                         kwargs: dict[str, Any], expected: set[str]) -> None:
    dst = tmp_path / "dst"
    res = stage(filter_src, dst, **kwargs)
    assert _staged_files(dst) == expected
    for rel in expected:
        trees.assert_same_file(filter_src / rel, dst / rel)
    assert res.files == len(expected)
    assert res.bytes == sum((filter_src / rel).stat().st_size for rel in expected)
    if "include" in kwargs:
        assert not (dst / "e").exists(), "an empty directory was kept despite include"
    else:
        assert (dst / "e").is_dir(), "the empty directory was dropped without include"


def test_exclude_prunes_before_walking(stage: Stage, filter_src: Path,
                                           tmp_path: Path) -> None:
    """A pruned directory is not walked: a FIFO inside it does not raise."""
    os.mkfifo(filter_src / "a" / "b" / "pipe")
    dst = tmp_path / "dst"
    stage(filter_src, dst, exclude="a/b")
    assert not (dst / "a" / "b").exists()
    assert (dst / "a" / "x.txt").is_file()


# --------------------------------------------------------------------------------------
# Symlinks and special files
# --------------------------------------------------------------------------------------


@pytest.fixture
def link_src(tmp_path: Path) -> Path:
    root = tmp_path / "lsrc"
    trees.write_file(root / "real" / "data.txt", b"data\n", mtime_index=1)
    trees.write_file(root / "plain.txt", b"plain\n", mtime_index=2)
    (tmp_path / "outside.txt").write_bytes(b"outside\n")
    return root


@pytest.mark.parametrize("target", ["../outside.txt", "real/../../outside.txt", "/etc/hostname",
                                    "real/../.."])
def test_symlink_leaving_tree_refused(stage: Stage, link_src: Path, tmp_path: Path,
                                      target: str) -> None:
    os.symlink(target, link_src / "escape")
    dst = tmp_path / "dst"
    with pytest.raises(fastload.UnsupportedFileError) as info:
        stage(link_src, dst)
    e = info.value
    assert isinstance(e, OSError)
    assert "escape" in f"{e} {e.filename}"


def test_symlink_leaving_tree_skipped(stage: Stage, link_src: Path, tmp_path: Path) -> None:
    os.symlink("../outside.txt", link_src / "escape")
    os.symlink("real/data.txt", link_src / "inside")
    dst = tmp_path / "dst"
    res = stage(link_src, dst, on_special="skip")
    assert not os.path.lexists(dst / "escape")
    assert os.readlink(dst / "inside") == "real/data.txt"
    assert (dst / "plain.txt").read_bytes() == b"plain\n"
    assert res.bytes == len(b"data\n") + len(b"plain\n")


def test_absolute_symlink_inside_tree(stage: Stage, link_src: Path, tmp_path: Path) -> None:
    """An absolute link to a file of the tree is kept and resolves inside the copy (the
    spec keeps relative links as-is; where an absolute one must point is our reading)."""
    os.symlink(str(link_src / "real" / "data.txt"), link_src / "abs_link")
    dst = tmp_path / "dst"
    stage(link_src, dst)
    assert (dst / "abs_link").is_symlink()
    resolved = Path(os.path.realpath(dst / "abs_link"))
    assert resolved == (dst / "real" / "data.txt").resolve()


def _make_special(kind: str, path: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(str(path))
        finally:
            s.close()
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        except PermissionError:
            missing("cannot make a device node here")


class _FifoWatchdog:
    """If staging opens the FIFO for reading it blocks forever: this opens the write side
    now and then, so such a bug fails the test instead of hanging the suite."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue  # ENXIO: no reader, as it should be
            os.close(fd)

    def __enter__(self) -> _FifoWatchdog:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.parametrize("kind", ["fifo", "socket", "chardev"])
def test_special_file_refused(stage: Stage, link_src: Path, tmp_path: Path, kind: str) -> None:
    special = link_src / "real" / f"the_{kind}"
    _make_special(kind, special)
    dst = tmp_path / "dst"
    with _FifoWatchdog(special), pytest.raises(fastload.UnsupportedFileError) as info:
        stage(link_src, dst)
    assert isinstance(info.value, OSError)
    assert f"the_{kind}" in f"{info.value} {info.value.filename}"


@pytest.mark.parametrize("kind", ["fifo", "socket", "chardev"])
def test_special_file_skipped(stage: Stage, link_src: Path, tmp_path: Path, kind: str) -> None:
    special = link_src / "real" / f"the_{kind}"
    _make_special(kind, special)
    dst = tmp_path / "dst"
    with _FifoWatchdog(special):
        res = stage(link_src, dst, on_special="skip")
    assert not os.path.lexists(dst / "real" / f"the_{kind}")
    assert (dst / "real" / "data.txt").read_bytes() == b"data\n"
    assert res.files == 2


# --------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------


def test_progress_callback(stage: Stage, mixed_src: Path, tmp_path: Path) -> None:
    calls: list[tuple[int, int, int, int]] = []
    dst = tmp_path / "dst"
    res = stage(mixed_src, dst, progress=lambda *a: calls.append(tuple(a)))
    assert calls, "the progress callback was never called"
    for bd, bt, fd, ft in calls:
        assert all(isinstance(x, int) for x in (bd, bt, fd, ft))
        assert (bt, ft) == (res.bytes, res.files), "totals changed or differ from the result"
        assert 0 <= bd <= bt and 0 <= fd <= ft
    for i in range(1, len(calls)):
        (b0, _, f0, _), (b1, _, f1, _) = calls[i - 1], calls[i]
        assert b1 >= b0 and f1 >= f0, f"progress went backwards: {calls[i - 1]} -> {calls[i]}"
    assert calls[-1] == (res.bytes, res.bytes, res.files, res.files)


def test_progress_true_writes_a_bar(stage: Stage, rich_src: Path, tmp_path: Path,
                                    capfd: pytest.CaptureFixture[str]) -> None:
    stage(rich_src, tmp_path / "dst", progress=True)
    out, err = capfd.readouterr()
    assert err.strip(), "progress=True printed nothing on stderr"
    assert "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("value", [None, False])
def test_progress_off_prints_nothing(stage: Stage, rich_src: Path, tmp_path: Path,
                                     capfd: pytest.CaptureFixture[str], value: Any) -> None:
    stage(rich_src, tmp_path / "dst", progress=value)
    assert capfd.readouterr() == ("", "")


# --------------------------------------------------------------------------------------
# Idempotence and incremental re-runs
# --------------------------------------------------------------------------------------


def test_second_run_is_skipped(stage: Stage, rich_src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    first = stage(rich_src, dst)
    before = trees.snapshot(dst)
    second = stage(rich_src, dst)
    assert second.skipped is True
    assert (second.copied_files, second.copied_bytes) == (0, 0)
    assert (second.files, second.bytes) == (first.files, first.bytes)
    assert second.path == dst
    assert trees.snapshot(dst) == before
    trees.assert_same_tree(rich_src, dst)


def test_changed_source_copies_only_the_change(stage: Stage, tmp_path: Path,
                                               totals: Any) -> None:
    src = tmp_path / "src"
    for i in range(20):
        trees.write_file(src / f"d{i % 3}" / f"f{i}.bin", os.urandom(1000 + i), mtime_index=i)
    dst = tmp_path / "dst"
    first = stage(src, dst)
    assert first.copied_files == 20

    grown = src / "d0" / "f0.bin"
    with open(grown, "ab") as f:
        f.write(b"more")
    trees.set_mtime(grown, 100)
    rewritten = src / "d1" / "f1.bin"  # same size, new bytes, new mtime
    trees.write_file(rewritten, os.urandom(1001), mtime_index=101)
    added = src / "new" / "added.bin"
    trees.write_file(added, os.urandom(4321), mtime_index=102)

    again = stage(src, dst)
    assert again.skipped is False
    assert again.copied_files == 3
    assert again.copied_bytes == 1004 + 1001 + 4321
    assert (again.files, again.bytes) == totals(src)
    trees.assert_same_tree(src, dst)
    third = stage(src, dst)
    assert third.skipped is True


def test_check_source_false_trusts_the_manifest(stage: Stage, tmp_path: Path) -> None:
    """check_source=False returns on a complete manifest without listing the source
    again (the documented meaning; the spec only names the flag); the default notices
    the change."""
    src = tmp_path / "src"
    for i in range(5):
        trees.write_file(src / f"f{i}.bin", os.urandom(2000), mtime_index=i)
    dst = tmp_path / "dst"
    stage(src, dst)
    trees.write_file(src / "f0.bin", os.urandom(3000), mtime_index=50)
    trusted = stage(src, dst, check_source=False)
    assert trusted.skipped is True and trusted.copied_files == 0
    assert (dst / "f0.bin").stat().st_size == 2000
    checked = stage(src, dst)
    assert checked.skipped is False and checked.copied_files == 1
    trees.assert_same_tree(src, dst)


def test_no_temporary_files_left(stage: Stage, mixed_src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    stage(mixed_src, dst)
    assert trees.tmp_leftovers(tmp_path) == []
    assert not [p for p in dst.rglob(".*")], "hidden entries inside the dataset directory"


def test_copy_of_copy(stage: Stage, rich_src: Path, tmp_path: Path) -> None:
    """A staged tree is an ordinary tree: staging it again elsewhere gives the same."""
    first = tmp_path / "one"
    stage(rich_src, first)
    second = tmp_path / "two"
    stage(first, second)
    trees.assert_same_tree(rich_src, second)


def test_env_forces_pread(rich_src: Path, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    assert "pread" in fastload.available_engines()
    assert set(fastload.available_engines()) <= {"uring", "pread"}
    monkeypatch.setenv("FASTLOAD_ENGINE", "pread")
    res = fastload.stage(rich_src, tmp_path / "dst", engine="auto")
    assert res.engine == "pread"
    trees.assert_same_tree(rich_src, tmp_path / "dst")


def test_auto_engine_picks_first_available(rich_src: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTLOAD_ENGINE", raising=False)
    res = fastload.stage(rich_src, tmp_path / "dst")
    assert res.engine == fastload.available_engines()[0]


def test_staging_imports_neither_numpy_nor_torch(tmp_path: Path) -> None:
    """A job that only stages pays for neither: numpy (with its BLAS threads) is
    imported by the writer on first use, torch by the datasets."""
    import subprocess
    import sys

    trees.build_small_files(tmp_path / "src", 50)
    code = (
        "import sys, fastload\n"
        f"fastload.stage({str(tmp_path / 'src')!r}, {str(tmp_path / 'dst')!r})\n"
        "fastload.verify; fastload.ShardIndex\n"
        "assert not {'numpy', 'torch'} & set(sys.modules), sorted(sys.modules)\n"
        "assert fastload.pack is fastload.packing.api.pack and 'numpy' in sys.modules\n"
        "from fastload import ShardWriter, register_encoder, PackResult, pack_dataset\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    trees.assert_same_tree(tmp_path / "src", tmp_path / "dst")
