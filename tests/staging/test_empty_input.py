"""Input that holds nothing to stage is an error naming it (issue 32), as GNU tar says
"does not look like a tar archive" and "Not found in archive": a 0-byte .tar, include
patterns that match nothing in an archive or a tree. ``allow_empty`` stages nothing on
purpose. Also what the messages and bars of such stages show."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastload
from kit.tools import require_tool


def _gnu_tar(src: Path, out: Path, *args: str) -> Path:
    require_tool("tar", "tar")
    subprocess.run(["tar", "-cf", str(out), *args, "-C", str(src), "."], check=True)
    return out


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"alpha")
    (src / "d" / "b.bin").write_bytes(os.urandom(5000))
    return src


def test_zero_byte_tar_is_not_an_archive(tmp_path: Path) -> None:
    empty = tmp_path / "data.tar"
    empty.touch()
    # GNU tar refuses it as well.
    require_tool("tar", "tar")
    gnu = subprocess.run(["tar", "-tf", str(empty)], capture_output=True, text=True)
    assert gnu.returncode != 0 and "does not look like a tar archive" in gnu.stderr
    with pytest.raises(OSError, match="named like a tar archive but is not one: empty") as e:
        fastload.stage(empty, tmp_path / "out")
    assert str(empty) in str(e.value)
    assert not (tmp_path / "out").exists()
    r = subprocess.run(
        [sys.executable, "-m", "fastload", "stage", str(empty), str(tmp_path / "cli")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and "is not one: empty" in r.stderr
    # As a file, it copies.
    assert fastload.stage(empty, tmp_path / "copy.tar", unpack=False).files == 1


def test_include_matching_nothing_in_an_archive(engine: str, tree: Path, tmp_path: Path) -> None:
    tar = _gnu_tar(tree, tmp_path / "t.tar")
    with pytest.raises(FileNotFoundError, match=r"include pattern '\*\.jpg' matched nothing"):
        fastload.stage(tar, tmp_path / "out", include="*.jpg", engine=engine)
    assert not (tmp_path / ".out.fastload" / "manifest.json").exists()
    r = fastload.stage(tar, tmp_path / "out", include="*.jpg", engine=engine, allow_empty=True)
    assert r.files == 0
    r = fastload.stage(tar, tmp_path / "out2", include="*.txt", engine=engine)
    assert r.files == 1 and (tmp_path / "out2" / "a.txt").read_bytes() == b"alpha"


def test_include_matching_nothing_in_a_tree(engine: str, tree: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"patterns '\*\.jpg', '\*\.png' matched nothing"):
        fastload.stage(tree, tmp_path / "out", include=["*.jpg", "*.png"], engine=engine)
    assert not (tmp_path / "out").exists()  # nothing left behind
    r = fastload.stage(tree, tmp_path / "out", include="*.jpg", engine=engine, allow_empty=True)
    assert r.files == 0 and (tmp_path / "out").is_dir()
    # An empty directory without patterns is an empty tree, staged as such.
    (tmp_path / "empty").mkdir()
    assert fastload.stage(tmp_path / "empty", tmp_path / "e", engine=engine).files == 0


def test_progress_of_an_unknown_total_shows_the_count_alone(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fastload.staging.job import Bar

    bar = Bar("extract -", 0, 0)
    bar(1 << 20, 0, 553, 0)
    bar.close()
    shown = capsys.readouterr().err
    assert "553 files" in shown and "553/0" not in shown
    bar = Bar("stage x", 100, 0)
    bar(50, 100, 5, 10)
    bar.close()
    assert "5/10 files" in capsys.readouterr().err


def test_not_a_tar_message_escapes_non_ascii_bytes(tmp_path: Path) -> None:
    bad = tmp_path / "x.tar"
    # Valid UTF-8 ("é", "€") and a control byte, then junk: none may reach the terminal raw.
    head = "é€".encode() + b"\x1b[2J" + b"\xff" * 10
    bad.write_bytes(head + b"\x01" * (1024 - len(head)))
    with pytest.raises(fastload.TarFormatError) as e:
        fastload.stage(bad, tmp_path / "out")
    text = str(e.value)
    starts = text[text.index("it starts with") :]
    assert all(32 <= ord(c) < 127 for c in starts), starts
    assert "\\xc3\\xa9" in starts and "\\x1b" in starts
