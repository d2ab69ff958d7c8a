"""fastload.stage() on archives (issue 3): what an extraction leaves in the destination,
compared with GNU tar's own extraction of the same archive (``tar -xf A -C ref
--no-same-owner`` as root): bytes, modes, mtimes (1 s), symlink targets, hard links.

Archives are made by GNU tar (gnu, posix, ustar) and Python tarfile (ustar, gnu, pax),
plain, gzip (tar -czf, Python gzip, pigz, multi-member) and zstd (CLI, multi-frame);
hand-patched headers for the parser's corners (tars of tars: test_archive_nested.py).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest

import fastload
from kit import netsim, procs, tars, trees
from kit.tools import missing, require_tool

pytestmark = pytest.mark.native

Stage = Callable[..., Any]

# (maker, format, long names) -> the portable tree for ustar, the full one otherwise.
FORMAT_CASES = [
    pytest.param("gnutar", "gnu", id="gnutar-gnu"),
    pytest.param("gnutar", "posix", id="gnutar-posix"),
    pytest.param("gnutar", "ustar", id="gnutar-ustar"),
    pytest.param("tarfile", "ustar", id="tarfile-ustar"),
    pytest.param("tarfile", "gnu", id="tarfile-gnu"),
    pytest.param("tarfile", "pax", id="tarfile-pax"),
]


# --------------------------------------------------------------------------------------
# Archives, built once per session, with GNU tar's extraction beside them
# --------------------------------------------------------------------------------------


class Made:
    """An archive, GNU tar's extraction of it and its explicit directories."""

    def __init__(self, archive: Path, ref: Path, explicit: set[str]) -> None:
        self.archive = archive
        self.ref = ref
        self.explicit = explicit


@pytest.fixture(scope="session")
def archive_trees(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    base = tmp_path_factory.mktemp("archive-trees")
    return {long: trees.build_archive_tree(base / f"long-{long}", long=long)
            for long in (True, False)}


@pytest.fixture(scope="session")
def made(tmp_path_factory: pytest.TempPathFactory,
         archive_trees: dict[bool, Path]) -> Callable[..., Made]:
    """``made(maker, fmt, compress=None)``: the archive of the rich tree (cached)."""
    cache: dict[tuple[Any, ...], Made] = {}
    base = tmp_path_factory.mktemp("archives")

    def get(maker: str, fmt: str, compress: str | None = None) -> Made:
        key = (maker, fmt, compress)
        if key not in cache:
            src = archive_trees[fmt != "ustar"]
            stem = f"{maker}-{fmt}"
            if maker == "gnutar":
                plain = tars.gnu_create(src, base / f"{stem}.tar", fmt)
            else:
                plain = tars.py_create(src, base / f"{stem}.tar", fmt, pax_global=fmt == "pax")
            archive = plain
            if compress is not None:
                archive = compress_archive(plain, compress, src, fmt)
            ref = tars.gnu_extract(archive, base / f"ref-{stem}-{compress}")
            cache[key] = Made(archive, ref, tars.explicit_dirs(archive))
        return cache[key]

    return get


def compress_archive(plain: Path, how: str, src: Path, fmt: str) -> Path:
    stem = plain.with_suffix("")
    if how == "tar-czf":
        return tars.gnu_create(src, stem.with_name(stem.name + "-czf.tar.gz"), fmt, extra=["-z"])
    if how == "gzip-tgz":
        return tars.gzip_file(plain, stem.with_name(stem.name + ".tgz"))
    if how == "pigz":
        require_tool("pigz", "pigz")
        out = stem.with_name(stem.name + "-pigz.tar.gz")
        out.write_bytes(tars.run(["pigz", "-c", "-p", "2", str(plain)]).stdout)
        return out
    if how == "gzip-multimember":
        return tars.gzip_file(plain, stem.with_name(stem.name + "-multi.tar.gz"), members=3)
    if how == "zstd":
        return tars.zstd_file(plain, stem.with_name(stem.name + ".tar.zst"))
    if how == "zstd-tzst":
        return tars.zstd_file(plain, stem.with_name(stem.name + ".tzst"))
    if how == "zstd-multiframe":
        return tars.zstd_file(plain, stem.with_name(stem.name + "-multi.tar.zst"), frames=3)
    if how == "gzip-named-tar":
        out = stem.with_name(stem.name + "-gz-content.tar")
        out.write_bytes(tars.gzip_file(plain, out.with_suffix(".tmpgz")).read_bytes())
        out.with_suffix(".tmpgz").unlink()
        return out
    if how == "zstd-named-tar":
        tmp = tars.zstd_file(plain, stem.with_name(stem.name + ".tmpzst"))
        out = stem.with_name(stem.name + "-zst-content.tar")
        tmp.rename(out)
        return out
    raise ValueError(how)


def check_result(res: Any, m: Made, dst: Path) -> None:
    """files/bytes are the regular files extracted, each hard link counted as the file it
    is (issue 21); a fresh extraction copies them all."""
    assert res.path == dst
    assert res.skipped is False
    files = trees.regular_files(m.ref)
    assert (res.files, res.bytes) == (len(files), sum(files.values())), res
    assert (res.copied_files, res.copied_bytes) == (res.files, res.bytes), res


def assert_clean_beside(dst: Path) -> None:
    extra = {p.name for p in dst.parent.iterdir()} - {dst.name} - tars.state_names(dst)
    assert not extra, f"left beside the destination: {sorted(extra)}"


def extract_and_compare(stage: Stage, m: Made, tmp_path: Path, **kw: Any) -> Any:
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir(parents=True)
    res = stage(m.archive, dst, **kw)
    assert dst.is_dir() and not dst.is_symlink(), (
        f"{m.archive.name} was not extracted: dst is not a directory ({res})")
    tars.assert_same_extraction(m.ref, dst, explicit=m.explicit)
    trees.assert_no_tmp(dst)
    assert_clean_beside(dst)
    check_result(res, m, dst)
    return res


# --------------------------------------------------------------------------------------
# Formats and makers
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("maker", "fmt"), FORMAT_CASES)
def test_format_matches_gnu_tar(stage: Stage, made: Callable[..., Made], tmp_path: Path,
                                maker: str, fmt: str) -> None:
    m = made(maker, fmt)
    extract_and_compare(stage, m, tmp_path)


@pytest.mark.parametrize(("maker", "fmt"), [FORMAT_CASES[0], FORMAT_CASES[5]])
def test_format_details(stage: Stage, made: Callable[..., Made], tmp_path: Path,
                        maker: str, fmt: str) -> None:
    """What the comparison checks, spelled out for the long-name cases, so a failure
    says which feature broke."""
    m = made(maker, fmt)
    dst = tmp_path / "dst"
    stage(m.archive, dst)
    deep = dst / trees.DEEP_LONG_DIR
    assert len(str(deep.relative_to(dst)).encode()) > 255
    assert (deep / "leaf.txt").read_bytes() == b"deep and long\n"
    assert (dst / "long" / trees.LONG_ASCII).stat().st_size == 5000
    assert (dst / trees.USTAR_PREFIX_PATH).stat().st_size == 3000
    assert (dst / trees.UNICODE_DIR / trees.UNICODE_FILE).is_file()
    assert os.readlink(dst / "links" / ("t" * 120)) == trees.LONG_LINK_TARGET
    assert (dst / "links" / ("t" * 120)).read_bytes() == b"deep and long\n"
    assert os.readlink(dst / "links" / "up") == ".."
    a = os.lstat(dst / "hard" / "a.bin")
    for rel in ["hard/b.bin", "other/c.bin", "long/" + "h" * 200 + ".hl"]:
        assert os.lstat(dst / rel).st_ino == a.st_ino, f"{rel} is not a hard link of hard/a.bin"
    assert os.lstat(dst / "zz" / "to_long").st_ino == os.lstat(deep / "target.bin").st_ino
    assert oct(os.lstat(dst / "modes" / "ro_dir").st_mode & 0o7777) == oct(0o555)
    assert (dst / "empty_dir").is_dir() and not any((dst / "empty_dir").iterdir())
    assert (dst / "nested" / "empty" / "inner").is_dir()


def test_gnu_tar_top_level_names(stage: Stage, archive_trees: dict[bool, Path],
                                 tmp_path: Path) -> None:
    """Members named without "./" (``tar -cf A -C dir a b c``)."""
    a = tars.gnu_create(archive_trees[True], tmp_path / "in" / "top.tar", "gnu", dot=False)
    m = Made(a, tars.gnu_extract(a, tmp_path / "ref"), tars.explicit_dirs(a))
    extract_and_compare(stage, m, tmp_path)


def test_into_existing_empty_dir(stage: Stage, made: Callable[..., Made], tmp_path: Path) -> None:
    m = made("tarfile", "gnu")
    dst = tmp_path / "dst"
    dst.mkdir()
    stage(m.archive, dst)
    tars.assert_same_extraction(m.ref, dst, explicit=m.explicit)


def test_verify_extracted_tree(stage: Stage, made: Callable[..., Made], tmp_path: Path) -> None:
    m = made("gnutar", "posix")
    dst = tmp_path / "dst"
    res = stage(m.archive, dst)
    v = fastload.verify(dst)
    assert v.ok, (v.mismatched, v.missing)
    assert v.files == res.files
    target = dst / "sizes" / f"b{100 * 1024 + 7}"
    st = target.stat()
    with open(target, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    v = fastload.verify(dst)
    assert not v.ok
    assert v.mismatched == [f"sizes/b{100 * 1024 + 7}"]


def test_progress_callback(stage: Stage, made: Callable[..., Made], tmp_path: Path) -> None:
    m = made("tarfile", "pax")
    calls: list[tuple[int, ...]] = []
    stage(m.archive, tmp_path / "dst", progress=lambda *a: calls.append(tuple(a)))
    assert calls, "the progress callback was never called"
    for c in calls:
        assert len(c) == 4 and all(isinstance(x, int) and x >= 0 for x in c), c
    for prev, cur in itertools.pairwise(calls):
        assert cur[0] >= prev[0] and cur[2] >= prev[2], f"went backwards: {prev} -> {cur}"
    assert calls[-1][0] > 0 and calls[-1][2] > 0, calls[-1]


# --------------------------------------------------------------------------------------
# Compression
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["tar-czf", "gzip-tgz", "pigz", "gzip-multimember"])
def test_gzip(stage: Stage, made: Callable[..., Made], tmp_path: Path, how: str) -> None:
    extract_and_compare(stage, made("gnutar", "gnu", how), tmp_path)


@pytest.mark.parametrize("how", ["zstd", "zstd-tzst", "zstd-multiframe"])
def test_zstd(stage: Stage, made: Callable[..., Made], tmp_path: Path, how: str) -> None:
    tars.need_zstd()
    extract_and_compare(stage, made("tarfile", "pax", how), tmp_path)


@pytest.mark.parametrize("how", ["gzip-named-tar", "zstd-named-tar"])
def test_compression_recognised_by_content(stage: Stage, made: Callable[..., Made],
                                           tmp_path: Path, how: str) -> None:
    """A ``.tar`` that holds gzip or zstd data (a common mislabelling)."""
    if how.startswith("zstd"):
        tars.need_zstd()
    extract_and_compare(stage, made("tarfile", "gnu", how), tmp_path)


def test_unpack_true_on_a_name_without_suffix(stage: Stage, made: Callable[..., Made],
                                              tmp_path: Path) -> None:
    m = made("tarfile", "ustar")
    renamed = tmp_path / "in" / "dataset_archive"
    renamed.parent.mkdir()
    shutil.copyfile(m.archive, renamed)
    extract_and_compare(stage, Made(renamed, m.ref, m.explicit), tmp_path, unpack=True)


# --------------------------------------------------------------------------------------
# unpack=False and non-archives
# --------------------------------------------------------------------------------------


def test_unpack_false_copies_the_archive(stage: Stage, made: Callable[..., Made],
                                         tmp_path: Path) -> None:
    m = made("gnutar", "gnu", "tar-czf")
    dst = tmp_path / "copy.tar.gz"
    res = stage(m.archive, dst, unpack=False)
    assert dst.is_file()
    assert dst.read_bytes() == m.archive.read_bytes()
    assert (res.files, res.bytes) == (1, m.archive.stat().st_size)
    into = tmp_path / "into"
    into.mkdir()
    res = stage(m.archive, into, unpack=False)
    assert res.path == into / m.archive.name
    assert (into / m.archive.name).read_bytes() == m.archive.read_bytes()
    assert set(os.listdir(into)) - tars.state_names(into / m.archive.name) == {m.archive.name}


def test_non_archive_is_copied_as_a_file(stage: Stage, tmp_path: Path) -> None:
    src = tmp_path / "weights.bin"
    trees.write_file(src, os.urandom(70_000), mtime_index=5)
    dst = tmp_path / "weights.copy"
    res = stage(src, dst)
    trees.assert_same_file(src, dst)
    assert (res.files, res.bytes) == (1, 70_000)


# --------------------------------------------------------------------------------------
# Parser corners, hand-made (each also extracted by GNU tar as the reference)
# --------------------------------------------------------------------------------------


def corner_archive(kind: str, path: Path) -> Path:
    T = tars.tinfo
    if kind == "base256-size":
        data = os.urandom(3000)
        path = tars.members_archive(path, [(T("b256.bin"), data), (T("after.txt"), b"after\n")])
        buf = bytearray(path.read_bytes())
        tars.set_base256(buf, tars.header_offsets(bytes(buf))[0][0], tars.F_SIZE, len(data))
        path.write_bytes(buf)
    elif kind == "base256-mtime":
        path = tars.members_archive(path, [(T("t.txt"), b"time\n"), (T("u.txt"), b"u\n")])
        buf = bytearray(path.read_bytes())
        tars.set_base256(buf, tars.header_offsets(bytes(buf))[0][0], tars.F_MTIME, 1_234_567_891)
        path.write_bytes(buf)
    elif kind == "pax-size-overrides-header":
        data = os.urandom(2000)
        path = tars.members_archive(
            path, [(T("a.bin", pax={"size": str(len(data))}), data), (T("b.txt"), b"bbb\n")],
            fmt=tarfile.PAX_FORMAT)
        buf = bytearray(path.read_bytes())
        off = tars.header_offsets(bytes(buf))[0][0]
        buf[off + tars.F_SIZE[0]:off + tars.F_SIZE[1]] = b"%011o\0" % 0
        tars.fix_checksum(buf, off)
        path.write_bytes(buf)
    elif kind == "pax-mtime-fraction-and-global":
        path = tars.members_archive(
            path,
            [(T("frac.txt", pax={"mtime": "1500000000.987654321"}), b"frac\n"),
             (T("global.txt"), b"global mtime\n"),
             (T("d", tarfile.DIRTYPE), None)],
            fmt=tarfile.PAX_FORMAT, pax_headers={"mtime": "1234567890"})
    elif kind == "pax-unicode-path":
        path = tars.members_archive(
            path, [(T("\u00e9t\u00e9/\u65e5\u672c.txt"), b"unicode\n")], fmt=tarfile.PAX_FORMAT)
    elif kind == "dir-after-its-contents":
        path = tars.members_archive(
            path,
            [(T("ro/inner/f.txt", mode=0o600), b"inside\n"),
             (T("ro/inner", tarfile.DIRTYPE, mode=0o500), None),
             (T("ro", tarfile.DIRTYPE, mode=0o555, mtime=1_400_000_000), None)])
    elif kind == "same-dir-twice":
        path = tars.members_archive(
            path,
            [(T("d", tarfile.DIRTYPE, mode=0o755), None), (T("d/x.txt"), b"x\n"),
             (T("d", tarfile.DIRTYPE, mode=0o700, mtime=1_300_000_000), None)])
    elif kind == "hardlink-to-earlier-in-ro-dir":
        path = tars.members_archive(
            path,
            [(T("ro", tarfile.DIRTYPE, mode=0o555), None), (T("ro/orig.bin"), b"orig" * 300),
             (T("copy.bin", tarfile.LNKTYPE, linkname="ro/orig.bin"), None)])
    elif kind == "empty-archive":
        path = tars.members_archive(path, [])
    else:
        raise ValueError(kind)
    return path


CORNERS = ["base256-size", "base256-mtime", "pax-size-overrides-header",
           "pax-mtime-fraction-and-global", "pax-unicode-path", "dir-after-its-contents",
           "same-dir-twice", "hardlink-to-earlier-in-ro-dir", "empty-archive"]


@pytest.mark.parametrize("kind", CORNERS)
def test_parser_corner(stage: Stage, tmp_path: Path, kind: str) -> None:
    a = corner_archive(kind, tmp_path / "in" / f"{kind}.tar")
    m = Made(a, tars.gnu_extract(a, tmp_path / "ref"), tars.explicit_dirs(a))
    extract_and_compare(stage, m, tmp_path)


# --------------------------------------------------------------------------------------
# Include / exclude on a flat archive
# --------------------------------------------------------------------------------------

FLAT_FILTERS = [
    pytest.param(["sizes/*"], None, id="include-dir-glob"),
    pytest.param(["*.txt"], None, id="include-basename"),
    pytest.param(["s*5*"], None, id="star-crosses-slash"),
    pytest.param(None, ["b512", "modes/*"], id="exclude-basename-and-glob"),
    pytest.param(["sizes/*", "*.txt"], ["b1", "top.*"], id="include-and-exclude"),
]


@pytest.mark.parametrize(("include", "exclude"), FLAT_FILTERS)
def test_include_exclude(stage: Stage, made: Callable[..., Made], tmp_path: Path,
                         include: list[str] | None, exclude: list[str] | None) -> None:
    m = made("tarfile", "gnu")  # member names without "./"
    ref_files = trees.regular_files(m.ref)
    # Hard-linked paths: whether a link member is taken when only its target is
    # selected is open; keep them out of the expectation.
    links = {p for g in trees.hardlink_groups(m.ref) for p in g}
    want = tars.selected(ref_files, include, exclude)
    assert want and want != set(ref_files), "the filter must select some, not all"
    dst = tmp_path / "dst"
    res = stage(m.archive, dst, include=include, exclude=exclude)
    got = set(trees.regular_files(dst))
    assert got - links == want - links, (
        f"missing {sorted(want - got - links)[:10]}, unexpected {sorted(got - want - links)[:10]}")
    for rel in want - links:
        assert trees.describe(dst / rel) == trees.describe(m.ref / rel), rel
    if not (want & links):
        assert (res.files, res.bytes) == (len(want), sum(ref_files[p] for p in want))


# --------------------------------------------------------------------------------------
# Checksums
# --------------------------------------------------------------------------------------


def digest(path: Path, algo: str) -> str:
    return f"{algo}:{hashlib.new(algo, path.read_bytes()).hexdigest()}"


@pytest.mark.parametrize("algo", ["md5", "sha256"])
@pytest.mark.parametrize("compress", [None, "tar-czf"])
def test_checksum_ok(stage: Stage, made: Callable[..., Made], tmp_path: Path, algo: str,
                     compress: str | None) -> None:
    m = made("gnutar", "gnu", compress)
    extract_and_compare(stage, m, tmp_path, checksum=digest(m.archive, algo))


@pytest.mark.parametrize("algo", ["md5", "sha256"])
def test_checksum_mismatch(stage: Stage, made: Callable[..., Made], tmp_path: Path,
                           algo: str) -> None:
    m = made("gnutar", "gnu", "tar-czf")
    good = digest(m.archive, algo)
    bad = good[:-1] + ("0" if good[-1] != "0" else "1")
    dst = tmp_path / "dst"
    with pytest.raises(fastload.ChecksumMismatchError) as ei:
        stage(m.archive, dst, checksum=bad)
    e = ei.value
    assert isinstance(e, fastload.StageError) and isinstance(e, OSError)
    assert m.archive.name in str(e), str(e)
    # Not marked complete: verify() finds no complete manifest, and a re-run checks again.
    with pytest.raises(fastload.StageError):
        fastload.verify(dst)
    with pytest.raises(fastload.ChecksumMismatchError):
        stage(m.archive, dst, checksum=bad)
    res = stage(m.archive, dst, checksum=good)
    assert res.skipped is False
    tars.assert_same_extraction(m.ref, dst, explicit=m.explicit)
    assert fastload.verify(dst).ok
    assert stage(m.archive, dst, checksum=good).skipped is True


def test_result_counts_plain_members(stage: Stage, tmp_path: Path) -> None:
    """files/bytes: the regular files extracted and their total size; directories and
    symlinks are not files."""
    T = tars.tinfo
    a = tars.members_archive(tmp_path / "in" / "counts.tar", [
        (T("d", tarfile.DIRTYPE), None), (T("d/a"), b"a" * 10), (T("d/b"), b""),
        (T("l", tarfile.SYMTYPE, linkname="d/a"), None), (T("e", tarfile.DIRTYPE), None),
        (T("c"), b"c" * 1000)])
    res = stage(a, tmp_path / "dst")
    assert (res.files, res.bytes) == (3, 1010)


@pytest.mark.parametrize("tmpfile", ["1", "0"], ids=["O_TMPFILE", "named-temporaries"])
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o000, 0o277])
def test_modes_exact_under_any_umask(stage: Stage, tmp_path: Path, umask: int,
                                     monkeypatch: pytest.MonkeyPatch, tmpfile: str) -> None:
    """Files get the member's mode exactly, whatever the umask (files are created with
    their mode and fixed up only where the umask took bits away); a temporary left by a
    killed run with another mode is not reused as it is (without O_TMPFILE, the named
    temporary is opened O_EXCL and replaced)."""
    monkeypatch.setenv("FASTLOAD_TMPFILE", tmpfile)
    T = tars.tinfo
    modes = [0o644, 0o600, 0o755, 0o777, 0o666, 0o400, 0o640, 0o711, 0o000]
    a = tars.members_archive(tmp_path / "in" / "modes.tar", [
        (T(f"f{mode:03o}", mode=mode), b"x" * (mode + 1)) for mode in modes])
    dst = tmp_path / "dst"
    dst.mkdir()
    stale = dst / ".f644.fl-tmp"
    stale.write_bytes(b"stale")
    stale.chmod(0o600)
    old = os.umask(umask)
    try:
        stage(a, dst)
    finally:
        os.umask(old)
    for mode in modes:
        p = dst / f"f{mode:03o}"
        assert (p.stat().st_mode & 0o7777, p.stat().st_size) == (mode, mode + 1), p
    # Written unnamed (O_TMPFILE) the member never touches the old temporary; written
    # under that name it replaces it.
    if tmpfile == "1":
        assert stale.read_bytes() == b"stale"
    else:
        assert not stale.exists()


def _replacing_archive(path: Path) -> tuple[Path, dict[str, bytes]]:
    """Members that land on names already taken: a file repeated (the later wins) and a
    symlink replaced by a file; what the destination must end with."""
    T = tars.tinfo
    a = tars.members_archive(path, [
        (T("d", tarfile.DIRTYPE), None),
        (T("d/x"), b"first" * 1000),
        (T("d/l", tarfile.SYMTYPE, linkname="x"), None),
        (T("d/y"), b"y" * 70_000),
        (T("d/x"), b"second" * 3000),
        (T("d/l"), b"a file now"),
    ])
    return a, {"d/x": b"second" * 3000, "d/y": b"y" * 70_000, "d/l": b"a file now"}


def _check_replaced(dst: Path, want: dict[str, bytes]) -> None:
    got = {str(p.relative_to(dst)): p for p in dst.rglob("*") if not p.is_dir()}
    assert sorted(got) == sorted(want), got
    for rel, data in want.items():
        assert not got[rel].is_symlink() and got[rel].read_bytes() == data, rel
    assert trees.tmp_leftovers(dst) == []


@pytest.mark.parametrize("tmpfile", ["1", "0"], ids=["O_TMPFILE", "named-temporaries"])
def test_members_replace_earlier_names(stage: Stage, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch, tmpfile: str) -> None:
    """A repeated member and a file over an extracted symlink replace what is there
    (files are named once whole; a taken name is replaced atomically), also on a re-run
    over a destination holding other versions of the files."""
    monkeypatch.setenv("FASTLOAD_TMPFILE", tmpfile)
    a, want = _replacing_archive(tmp_path / "in" / "replace.tar")
    dst = tmp_path / "dst"
    stage(a, dst)
    _check_replaced(dst, want)
    # Other versions in place and no record of them (the state directory gone): every
    # member is written again over them.
    (dst / "d" / "y").write_bytes(b"changed by hand")
    (dst / "d" / "x").unlink()
    (dst / "d" / "x").symlink_to("y")
    shutil.rmtree(tmp_path / ".dst.fastload")
    res = stage(a, dst)
    _check_replaced(dst, want)
    assert (res.files, res.copied_files) == (3, 4), res  # d/x is written twice


def test_unprivileged_extraction(engine: str, world_dir: Path,
                                 unprivileged: dict[str, Any]) -> None:
    """Without CAP_DAC_READ_SEARCH (or as nobody), files created unnamed are still named
    (through /proc/self/fd where linkat by descriptor is refused)."""
    a, want = _replacing_archive(world_dir / "replace.tar")
    os.chmod(a, 0o644)
    dst = world_dir / "dst"
    child = procs.run_child(procs.stage_spec(a, dst, engine=engine), **unprivileged,
                              env=procs.child_env())
    res = child.expect_result()
    assert res["files"] == 3, res
    _check_replaced(dst, want)


def test_archive_on_network_storage_is_written_with_io_uring(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             ) -> None:
    """engine="auto" takes the thread pool for a tree on a network file system (its reads
    go through the engine) but not for an archive there: the archive is read by a
    prefetching thread and the engine only writes members to the local destination.
    The source is a real FUSE mount adding 200 us per request (netsim)."""
    if "uring" not in fastload.available_engines():
        missing("io_uring is not available here")
    monkeypatch.delenv("FASTLOAD_ENGINE", raising=False)
    remote = tmp_path / "remote"
    (remote / "tree").mkdir(parents=True)
    for i in range(5):
        (remote / "tree" / f"f{i}").write_bytes(bytes([i]) * 3000)
    T = tars.tinfo
    tars.members_archive(remote / "a.tar", [(T(f"f{i}"), bytes([i]) * 3000) for i in range(5)])
    with netsim.mounts(tmp_path) as mount:
        mnt = mount(remote, 200, 200).path
        res = fastload.stage(mnt / "a.tar", tmp_path / "x")
        assert res.engine == "uring" and res.files == 5, res
        assert (tmp_path / "x" / "f4").read_bytes() == b"\4" * 3000
        res = fastload.stage(mnt / "tree", tmp_path / "t")
        assert res.engine == "pread" and res.files == 5, res
