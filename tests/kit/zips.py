"""Zip archives for the tests: a tree to zip, zips made by Info-ZIP ``zip``, ``bsdtar
--format zip`` and Python's ``zipfile`` (zip64 forced, data descriptors), ``unzip`` as
the reference extraction and comparing a tree with it, and byte patches that make a
zip hostile or broken (the writers make only well-formed ones)."""

from __future__ import annotations

import io
import os
import stat
import struct
import subprocess
import zipfile
from pathlib import Path
from typing import Any

from kit import trees
from kit.tools import require_tool


def build_tree(root: Path, *, seed: int = 5) -> Path:
    """Files of every kind a zip holds: empty, random, compressible, executable, UTF-8
    names, nested and empty folders, a symbolic link inside the tree."""
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "café").mkdir()
    trees.write_patterned(root / "a" / "b" / "random.bin", 300_001, seed=seed)
    (root / "a" / "text.txt").write_bytes(b"the quick brown fox\n" * 5000)
    (root / "a" / "empty").write_bytes(b"")
    (root / "café" / "naïve name.txt").write_bytes("ünïcödé\n".encode() * 10)
    run_me = root / "a" / "run.sh"
    run_me.write_bytes(b"#!/bin/sh\necho hi\n")
    run_me.chmod(0o755)
    os.symlink("b/random.bin", root / "a" / "link")
    for i, p in enumerate(sorted(root.rglob("*"))):
        if not p.is_symlink():
            trees.set_mtime(p, i)
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        trees.set_mtime(d, 50)
    return root


def run(cmd: list[str], **kw: Any) -> None:
    subprocess.run(cmd, check=True, capture_output=True, **kw)


def infozip(src: Path, out: Path, *args: str) -> Path:
    """Info-ZIP ``zip -ry`` of ``src``'s contents (links stored as links)."""
    require_tool("zip", "zip")
    run(["zip", "-qry", *args, str(out), "."], cwd=src)
    return out


def bsdtar_zip(src: Path, out: Path) -> Path:
    require_tool("bsdtar", "libarchive-tools")
    run(["bsdtar", "--format", "zip", "-cf", str(out), "-C", str(src), "."])
    return out


class _Unseekable(io.RawIOBase):
    """A write-only stream: zipfile writes a data descriptor after every member."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return int(self._f.write(b))


def py_zip(src: Path, out: Path, *, zip64: bool = False, descriptors: bool = False,
           method: int = zipfile.ZIP_DEFLATED) -> Path:  # fmt: skip
    """Python's zipfile of ``src`` (folders, links with their unix modes), zip64 records
    forced on every member, or data descriptors (written to an unseekable stream)."""
    with open(out, "wb") as raw:
        target: Any = _Unseekable(raw) if descriptors else raw
        with zipfile.ZipFile(target, "w", method, allowZip64=True) as zf:
            for p in sorted(src.rglob("*")):
                rel = p.relative_to(src).as_posix()
                st = os.lstat(p)
                if stat.S_ISDIR(st.st_mode):
                    zf.write(p, rel + "/")
                    continue
                info = zipfile.ZipInfo.from_file(p, rel)
                info.compress_type = method
                if stat.S_ISLNK(st.st_mode):
                    info.external_attr = (stat.S_IFLNK | 0o777) << 16
                    zf.writestr(info, os.readlink(p))
                    continue
                with zf.open(info, "w", force_zip64=zip64) as w:
                    w.write(p.read_bytes())
    return out


def unzip_ref(archive: Path, ref: Path) -> Path:
    """``unzip``'s extraction of ``archive`` into ``ref``: the reference."""
    require_tool("unzip", "unzip")
    ref.mkdir(parents=True)
    run(["unzip", "-q", str(archive), "-d", str(ref)])
    return ref


def explicit_dirs(archive: Path) -> set[str]:
    with zipfile.ZipFile(archive) as zf:
        # zipfile reads a name not flagged UTF-8 as CP437; unzip (on Unix) as its bytes.
        names = [i.filename if i.flag_bits & 0x800 or i.filename.isascii()
                 else i.filename.encode("cp437").decode("utf-8", "surrogateescape")
                 for i in zf.infolist()]  # fmt: skip
        named = {n.removeprefix("./").rstrip("/") for n in names if n.endswith("/")}
    return named - {"", "."}


def assert_same_extraction(archive: Path, ref: Path, dst: Path) -> None:
    """``dst`` holds what ``unzip`` made in ``ref``: the same entries, bytes, modes, file
    times and link targets, and the times of the folders the archive names."""
    problems = trees.differences(trees.snapshot(ref), trees.snapshot(dst),
                                 names=("unzip", "fastload"))  # fmt: skip
    for d in explicit_dirs(archive):
        a, b = os.stat(ref / d).st_mtime_ns, os.stat(dst / d).st_mtime_ns
        if a != b:
            problems.append(f"folder time differs: {d!r}: unzip={a} fastload={b}")
    assert not problems, "extractions differ:\n  " + "\n  ".join(problems)
    trees.assert_no_tmp(dst)


# --------------------------------------------------------------------------------------
# Patching a zip's bytes
# --------------------------------------------------------------------------------------

_LOCAL_FIELDS = {"crc": 14, "csize": 18, "usize": 22, "offset": None}
_CENTRAL_FIELDS = {"crc": 16, "csize": 20, "usize": 24, "offset": 42}


def central_entries(data: bytes) -> list[int]:
    """Where each central directory entry starts (zipfile finds the directory)."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        start = zf.start_dir
        n = len(zf.infolist())
    out, at = [], start
    for _ in range(n):
        assert data[at : at + 4] == b"PK\x01\x02"
        out.append(at)
        n_name, n_extra, n_comment = struct.unpack_from("<HHH", data, at + 28)
        at += 46 + n_name + n_extra + n_comment
    return out


def local_offset(data: bytes, index: int) -> int:
    return int(struct.unpack_from("<I", data, central_entries(data)[index] + 42)[0])


def patch_member(data: bytes, index: int, *, local: bool = True, **fields: int) -> bytes:
    """Member ``index``'s 32-bit fields (crc, csize, usize; offset: central only) set in
    its central entry and (``local``) its local header."""
    out = bytearray(data)
    cen = central_entries(data)[index]
    loc = local_offset(data, index)
    for k, v in fields.items():
        struct.pack_into("<I", out, cen + _CENTRAL_FIELDS[k], v)
        if local and _LOCAL_FIELDS[k] is not None:
            struct.pack_into("<I", out, loc + int(_LOCAL_FIELDS[k] or 0), v)
    return bytes(out)


def member_bytes(members: list[tuple[str, bytes]], *, method: int = zipfile.ZIP_STORED,
                 modes: dict[str, int] | None = None, system: int = 3) -> bytes:  # fmt: skip
    """A zip of ``members`` (name, data) made by zipfile, in that order (a name may
    repeat); ``modes``: unix modes by name (a link's data is its target)."""
    import warnings

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name
        with zipfile.ZipFile(buf, "w", method) as zf:
            for name, body in members:
                info = zipfile.ZipInfo(name, (2020, 1, 2, 3, 4, 6))
                info.compress_type = method
                info.create_system = system
                info.external_attr = ((modes or {}).get(name, stat.S_IFREG | 0o644)) << 16
                zf.writestr(info, body)
    return buf.getvalue()


def rename_member(data: bytes, old: bytes, new: bytes, *, local: bool = True,
                  central: bool = True) -> bytes:  # fmt: skip
    """A member's name replaced by another of the same length, in its local header
    and/or its central entry."""
    assert len(old) == len(new)
    out = bytearray(data)
    cd = central_entries(data)[0]
    at = data.find(old)
    while at >= 0:
        if (at < cd and local) or (at >= cd and central):
            out[at : at + len(old)] = new
        at = data.find(old, at + 1)
    return bytes(out)
