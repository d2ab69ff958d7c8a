"""A tar stream (issue 21): ``fastload stage - DST`` with the archive on a pipe, and
``fastload.stage(stream, dst)`` for a binary file object or a pipe's descriptor; plain,
gzip or zstd told by the first bytes, read once in order (a pipe cannot seek). Each
extraction is compared with GNU tar's of the same archive.

A stream is read again on every call (nothing identifies its content before it is
read): members already staged with the size and mtime the manifest records are not
rewritten.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit import procs, tars, trees
from kit.tools import require_tool

pytestmark = pytest.mark.native

Stage = Callable[..., Any]


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A GNU tar archive of the archive tree (long names, symlinks, hard links, empty
    files, a file of several MiB), and GNU tar's extraction of it."""
    base = tmp_path_factory.mktemp("stream")
    src = trees.build_archive_tree(base / "src")
    (src / "big.bin").write_bytes(os.urandom(9 << 20))  # more than one read block
    os.link(src / "big.bin", src / "big-link.bin")
    a = tars.gnu_create(src, base / "a.tar", "gnu")
    return a, tars.gnu_extract(a, base / "ref")


def compressed(a: Path, how: str, tmp: Path) -> Path:
    if how == "none":
        return a
    if how == "gzip":
        return tars.gzip_file(a, tmp / "a.tar.gz")
    tars.need_zstd()
    return tars.zstd_file(a, tmp / "a.tar.zst")


def cli(*args: str, **kw: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "fastload", "stage", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=procs.child_env(), **kw)


def pipeline(producer: list[str], *args: str) -> tuple[int, str]:
    """``producer | fastload stage ARGS``: the exit status and stderr of fastload."""
    prod = subprocess.Popen(producer, stdout=subprocess.PIPE)
    assert prod.stdout is not None
    p = cli(*args, stdin=prod.stdout)
    prod.stdout.close()  # fastload holds the only reading end
    _, err = p.communicate(timeout=300)
    assert prod.wait(timeout=60) == 0
    return p.returncode, err.decode(errors="replace")


@pytest.mark.parametrize("tool", ["cat", "gzip", "zstd"])
def test_cli_reads_a_pipe(archive: tuple[Path, Path], tmp_path: Path, tool: str) -> None:
    a, ref = archive
    if tool == "zstd":
        require_tool("zstd", "zstd")
    producer = {"cat": ["cat", str(a)], "gzip": ["gzip", "-c", str(a)],
                "zstd": ["zstd", "-q", "-c", str(a)]}[tool]
    rc, err = pipeline(producer, "-", str(tmp_path / "out"))
    assert rc == 0, err
    assert "Traceback" not in err, err
    tars.assert_same_extraction(ref, tmp_path / "out", explicit=tars.explicit_dirs(a))


@pytest.mark.parametrize("how", ["none", "gzip", "zstd"])
def test_stage_reads_a_buffered_reader_over_a_pipe(
    stage: Stage, archive: tuple[Path, Path], tmp_path: Path, how: str
) -> None:
    """In process: the archive written into a pipe by a thread in odd-sized pieces (reads
    return short), read through io.BufferedReader."""
    a, ref = archive
    data = compressed(a, how, tmp_path).read_bytes()
    r, w = os.pipe()

    def write() -> None:
        with open(w, "wb", buffering=0) as f:
            for i in range(0, len(data), 70_001):
                f.write(data[i:i + 70_001])

    t = threading.Thread(target=write)
    t.start()
    try:
        with io.BufferedReader(io.FileIO(r, "rb")) as stream:
            res = stage(stream, tmp_path / "out")
    finally:
        t.join()
    tars.assert_same_extraction(ref, tmp_path / "out", explicit=tars.explicit_dirs(a))
    n, size = tars.member_totals(a)
    assert res.files >= n and not res.skipped
    assert res.copied_bytes >= size


def test_stage_reads_a_descriptor_and_an_in_memory_stream(
    stage: Stage, archive: tuple[Path, Path], tmp_path: Path
) -> None:
    a, ref = archive
    fd = os.open(a, os.O_RDONLY)
    try:
        stage(fd, tmp_path / "fd")
    finally:
        os.close(fd)
    tars.assert_same_extraction(ref, tmp_path / "fd", explicit=tars.explicit_dirs(a))
    stage(io.BytesIO(tars.gzip_file(a, tmp_path / "a.tgz").read_bytes()), tmp_path / "mem")
    tars.assert_same_extraction(ref, tmp_path / "mem", explicit=tars.explicit_dirs(a))


def test_a_second_stream_redoes_only_what_is_not_done(
    stage: Stage, archive: tuple[Path, Path], tmp_path: Path
) -> None:
    a, ref = archive
    out = tmp_path / "out"
    with open(a, "rb") as f:
        first = stage(f, out)
    assert first.copied_files > 0
    # Everything is there: the stream is read again, nothing is rewritten.
    with open(a, "rb") as f:
        again = stage(f, out)
    assert not again.skipped and again.copied_files == 0 and again.files == first.files
    victim = "sizes/b513"
    (out / victim).unlink()
    with open(a, "rb") as f:
        third = stage(f, out)
    assert third.copied_files == 1
    assert third.copied_bytes == os.path.getsize(ref / victim)
    tars.assert_same_extraction(ref, out, explicit=tars.explicit_dirs(a))


def test_another_stream_into_the_same_destination_is_extracted(
    stage: Stage, tmp_path: Path
) -> None:
    """A complete manifest from an earlier stream does not make a stream return at once:
    this one may hold something else."""
    one = tars.members_archive(tmp_path / "1.tar", [(tars.tinfo("a.txt"), b"one")])
    two = tars.members_archive(tmp_path / "2.tar", [(tars.tinfo("b.txt"), b"two")])
    stage(io.BytesIO(one.read_bytes()), tmp_path / "out")
    r = stage(io.BytesIO(two.read_bytes()), tmp_path / "out")
    assert r.copied_files == 1 and r.files == 1
    assert (tmp_path / "out" / "b.txt").read_bytes() == b"two"


def test_checksum_of_a_stream(stage: Stage, archive: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = archive
    good = "sha256:" + hashlib.sha256(a.read_bytes()).hexdigest()
    with open(a, "rb") as f:
        stage(f, tmp_path / "ok", checksum=good)
    with open(a, "rb") as f, pytest.raises(fastload.ChecksumMismatchError):
        stage(f, tmp_path / "bad", checksum="sha256:" + "0" * 64)


def test_nested_from_a_stream(stage: Stage, tmp_path: Path) -> None:
    inner = tars.members_archive(tmp_path / "c.tar", [(tars.tinfo("x.jpg"), b"x" * 3000)])
    outer = tars.members_archive(tmp_path / "o.tar", [(tars.tinfo("c.tar"), inner.read_bytes())])
    stage(io.BytesIO(outer.read_bytes()), tmp_path / "out", unpack="nested")
    assert (tmp_path / "out" / "c" / "x.jpg").read_bytes() == b"x" * 3000


@pytest.mark.parametrize(("data", "says"), [
    (b"", "is empty"),
    (os.urandom(4096), "not a tar archive"),
    (b"BZh91AY&SY" + bytes(600), "bzip2"),
])
def test_cli_refuses_what_is_no_tar_stream_in_one_line(
    tmp_path: Path, data: bytes, says: str
) -> None:
    p = cli("-", str(tmp_path / "out"), stdin=subprocess.PIPE)
    _, err = p.communicate(data, timeout=300)
    lines = err.decode(errors="replace").strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1, lines
    assert says in lines[0] and "<stdin>" in lines[0], lines[0]


def test_a_stream_cannot_be_copied_as_a_file(tmp_path: Path) -> None:
    with pytest.raises(fastload.StageError, match="stream"):
        fastload.stage(io.BytesIO(b"x" * 1024), tmp_path / "out", unpack=False)


def test_a_text_stream_is_refused_with_the_binary_one_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"sys\.stdin\.buffer"):
        fastload.stage(io.StringIO("not bytes"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gnu_tar_reads_the_same_stream(archive: tuple[Path, Path], tmp_path: Path) -> None:
    """The reference for the pipes above: GNU tar, the same archive on its stdin."""
    a, ref = archive
    out = tmp_path / "gnu"
    out.mkdir()
    with open(a, "rb") as f:
        tars.run([tars.need_gnu_tar(), "-xf", "-", "-C", str(out), "--no-same-owner"], stdin=f)
    tars.assert_same_extraction(ref, out, explicit=tars.explicit_dirs(a))
    assert tarfile.is_tarfile(a)
