"""``fastload stage ARCHIVE DST [--nested] [--no-unpack] [--checksum ALGO:HEX]
[--include G] [--exclude G]`` (issue 3), run as ``python -m fastload``."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import fastload
from kit import procs, tars, trees

pytestmark = pytest.mark.native

T = tars.tinfo


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fastload", *args], capture_output=True,
                          text=True, timeout=300, env=procs.child_env(), check=False)


def assert_ok(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def assert_one_line_error(p: subprocess.CompletedProcess[str], *must_name: str) -> None:
    assert p.returncode not in (0, None), p
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {p.stderr!r}"
    assert any(n in lines[0] for n in must_name), lines[0]


@pytest.fixture(scope="module")
def nested(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, set[str]]:
    """A small tar of two class tars and a README; GNU tar's shell-loop extraction."""
    base = tmp_path_factory.mktemp("cli-nested")
    classes = []
    for c in ("n01440764", "n01443537"):
        inner = [(T(f"{c}_{j}.JPEG", mtime=1_500_000_000 + j), os.urandom(2000 + 100 * j))
                 for j in range(4)]
        classes.append((c, tars.members_archive(base / f"{c}.tar", inner).read_bytes()))
    outer = tars.members_archive(
        base / "train.tar",
        [(T(f"{c}.tar"), data) for c, data in classes] + [(T("README.txt"), b"readme\n")])
    ref, made = tars.gnu_extract_nested(outer, base / "ref")
    return outer, ref, made


def test_stage_archive_default_unpacks(engine: str, nested: tuple[Path, Path, set[str]],
                                       tmp_path: Path) -> None:
    outer, _, _ = nested
    dst = tmp_path / "dst"
    p = run("stage", str(outer), str(dst), "--engine", engine, "--no-progress")
    assert_ok(p)
    tars.assert_same_extraction(tars.gnu_extract(outer, tmp_path / "flat"), dst,
                              explicit=tars.explicit_dirs(outer))
    assert_ok(run("verify", str(dst)))


def test_stage_nested(engine: str, nested: tuple[Path, Path, set[str]], tmp_path: Path) -> None:
    outer, ref, made = nested
    dst = tmp_path / "imagenet"
    p = run("stage", str(outer), str(dst), "--nested", "--engine", engine, "--no-progress")
    assert_ok(p)
    tars.assert_same_extraction(ref, dst, skip_meta=made)
    assert (dst / "n01440764" / "n01440764_0.JPEG").is_file()
    # A second run: already there.
    assert_ok(run("stage", str(outer), str(dst), "--nested", "--no-progress"))
    tars.assert_same_extraction(ref, dst, skip_meta=made)


def test_stage_no_unpack(nested: tuple[Path, Path, set[str]], tmp_path: Path) -> None:
    outer, _, _ = nested
    dst = tmp_path / "copy.tar"
    assert_ok(run("stage", str(outer), str(dst), "--no-unpack", "--no-progress"))
    assert dst.is_file() and dst.read_bytes() == outer.read_bytes()


def test_stage_include_exclude(nested: tuple[Path, Path, set[str]], tmp_path: Path) -> None:
    outer, ref, _ = nested
    dst = tmp_path / "dst"
    p = run("stage", str(outer), str(dst), "--nested", "--include", "n01440764/*",
            "--include", "*.txt", "--exclude", "*_3.JPEG", "--no-progress")
    assert_ok(p)
    got = set(trees.regular_files(dst))
    want = tars.selected(trees.regular_files(ref), ["n01440764/*", "*.txt"], ["*_3.JPEG"])
    assert got == want == {"README.txt", *(f"n01440764/n01440764_{j}.JPEG" for j in range(3))}


@pytest.mark.parametrize("algo", ["md5", "sha256"])
def test_stage_checksum_ok(algo: str, nested: tuple[Path, Path, set[str]],
                           tmp_path: Path) -> None:
    outer, ref, made = nested
    hexd = hashlib.new(algo, outer.read_bytes()).hexdigest()
    dst = tmp_path / "dst"
    assert_ok(run("stage", str(outer), str(dst), "--nested", "--checksum", f"{algo}:{hexd}",
                  "--no-progress"))
    tars.assert_same_extraction(ref, dst, skip_meta=made)


def test_stage_checksum_mismatch(nested: tuple[Path, Path, set[str]], tmp_path: Path) -> None:
    outer, _, _ = nested
    dst = tmp_path / "dst"
    p = run("stage", str(outer), str(dst), "--checksum", "sha256:" + "0" * 64, "--no-progress")
    assert_one_line_error(p, outer.name)
    assert p.returncode == 1
    with pytest.raises(fastload.StageError):
        fastload.verify(dst)
    assert run("verify", str(dst)).returncode != 0


def test_stage_hostile_archive_fails_cleanly(tmp_path: Path) -> None:
    a = tars.members_archive(tmp_path / "in" / "evil.tar",
                           [(T("ok.txt"), b"ok\n"), (T("../fl_evil_cli.txt"), b"pwned\n")])
    dst = tmp_path / "out" / "dst"
    p = run("stage", str(a), str(dst), "--no-progress")
    assert_one_line_error(p, "fl_evil_cli")
    assert p.returncode == 1
    assert not (tmp_path / "out" / "fl_evil_cli.txt").exists()


def test_stage_truncated_archive_fails_cleanly(tmp_path: Path) -> None:
    a = tars.members_archive(tmp_path / "cut.tar", [(T("big.bin"), os.urandom(50_000))],
                           fmt=tarfile.USTAR_FORMAT)
    a.write_bytes(a.read_bytes()[:20_000])
    p = run("stage", str(a), str(tmp_path / "dst"), "--no-progress")
    assert_one_line_error(p, "cut.tar", "big.bin")
    assert p.returncode == 1

