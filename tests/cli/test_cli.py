"""The command line: ``python -m fastload`` and the ``fastload`` console script."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest

from kit import procs, trees

pytestmark = pytest.mark.native

SCRIPT = Path(sys.executable).with_name("fastload")


def run(*args: str, script: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [str(SCRIPT)] if script else [sys.executable, "-m", "fastload"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300,
                          env=procs.child_env(), check=False)


def assert_one_line_error(p: subprocess.CompletedProcess[str], must_name: str) -> None:
    assert p.returncode not in (0, None), p
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {p.stderr!r}"
    assert must_name in lines[0], lines[0]


@pytest.mark.parametrize("how", ["module", "script"])
def test_stage_and_verify(engine: str, rich_src: Path, tmp_path: Path, how: str) -> None:
    if how == "script":
        assert SCRIPT.exists(), f"no console script at {SCRIPT}"
    dst = tmp_path / "dst"
    p = run("stage", str(rich_src), str(dst), "--engine", engine, "--no-progress",
            script=how == "script")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    trees.assert_same_tree(rich_src, dst)
    p = run("verify", str(dst), script=how == "script")
    assert p.returncode == 0, p.stdout + p.stderr


def test_stage_with_filters_and_workers(engine: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    for rel in ["a/x.txt", "a/y.bin", "b/z.txt", "b/skip/w.txt", "top.txt"]:
        trees.write_file(src / rel, rel.encode(), mtime_index=len(rel))
    dst = tmp_path / "dst"
    p = run("stage", str(src), str(dst), "--include", "*.txt", "--include", "a/*",
            "--exclude", "b/skip", "--exclude", "top.*", "--engine", engine,
            "--workers", "2", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert set(trees.regular_files(dst)) == {"a/x.txt", "a/y.bin", "b/z.txt"}
    trees.assert_same_file(src / "a" / "y.bin", dst / "a" / "y.bin")


def run_on_a_terminal(*args: str) -> tuple[int, str]:
    """``python -m fastload ARGS`` with stderr on a pseudo-terminal (stdout a pipe): the
    exit status and what the terminal showed."""
    leader, follower = pty.openpty()
    # A terminal 160 columns wide (a new pseudo-terminal has no size: a bar of width 0).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    try:
        p = subprocess.Popen([sys.executable, "-m", "fastload", *args], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=follower, env=procs.child_env())
    finally:
        os.close(follower)
    shown = bytearray()
    try:
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
    return p.wait(timeout=300), shown.decode(errors="replace")


def test_stage_with_progress_by_default(rich_src: Path, tmp_path: Path, totals: Any) -> None:
    """No flag: a bar where stderr is a terminal, ending at every file; none where it is
    a pipe (a log)."""
    files, _ = totals(rich_src)
    rc, shown = run_on_a_terminal("stage", str(rich_src), str(tmp_path / "tty"))
    assert rc == 0, shown
    assert "Traceback" not in shown
    assert f"{files}/{files} files" in shown, shown
    trees.assert_same_tree(rich_src, tmp_path / "tty")
    p = run("stage", str(rich_src), str(tmp_path / "pipe"))
    assert p.returncode == 0, p.stderr
    assert "files" not in p.stderr and "\r" not in p.stderr, p.stderr
    trees.assert_same_tree(rich_src, tmp_path / "pipe")


def test_stage_twice_succeeds(rich_src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    for _ in range(2):
        p = run("stage", str(rich_src), str(dst), "--no-progress")
        assert p.returncode == 0, p.stderr
    trees.assert_same_tree(rich_src, dst)


def test_verify_reports_each_differing_path(rich_src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    assert run("stage", str(rich_src), str(dst), "--no-progress").returncode == 0
    target = dst / "data" / "medium.bin"
    st = target.stat()
    with open(target, "r+b") as f:
        f.seek(1000)
        f.write(b"\x00\x01\x02")
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    (dst / "top.txt").unlink()
    p = run("verify", str(dst))
    assert p.returncode == 1, p
    out = p.stdout + p.stderr
    assert "data/medium.bin" in out
    assert "top.txt" in out
    assert "Traceback" not in out
    assert "file.bin" not in out.replace("medium.bin", ""), "an intact file was reported"


def test_stage_missing_source(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    p = run("stage", str(missing), str(tmp_path / "dst"), "--no-progress")
    assert_one_line_error(p, str(missing))


def test_stage_dst_inside_src(tmp_path: Path) -> None:
    src = tmp_path / "src"
    trees.write_file(src / "a.txt", b"a")
    p = run("stage", str(src), str(src / "inner"), "--no-progress")
    assert_one_line_error(p, str(src))


def test_stage_special_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    trees.write_file(src / "a.txt", b"a")
    os.symlink("/etc/hostname", src / "escape")
    p = run("stage", str(src), str(tmp_path / "dst"), "--no-progress")
    assert_one_line_error(p, "escape")


def test_verify_never_staged(tmp_path: Path) -> None:
    dst = tmp_path / "never"
    p = run("verify", str(dst))
    assert_one_line_error(p, str(dst))


def test_help_and_no_command() -> None:
    p = run("--help")
    assert p.returncode == 0
    assert "stage" in p.stdout and "verify" in p.stdout
    p = run()
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
