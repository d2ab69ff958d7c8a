"""Hostile and broken zips (issue 53): each is refused with an error naming the archive
(and the member at fault), and nothing of that member is at its final name."""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

import pytest

import fastload
from fastload.errors import StageError, UnsupportedFileError
from fastload.staging.zipformat import ZipFormatError
from kit import trees, zips

LINK = stat.S_IFLNK | 0o777


def stage_fails(tmp_path: Path, data: bytes, match: str, member: str | None = None,
                err: type[Exception] = ZipFormatError, **kw: object) -> Path:  # fmt: skip
    archive = tmp_path / "bad.zip"
    archive.write_bytes(data)
    dst = tmp_path / "dst"
    with pytest.raises(err, match=match) as info:
        fastload.stage(archive, dst, **kw)  # type: ignore[arg-type]
    assert str(archive) in str(info.value)
    if member is not None:
        assert f"'{member}'" in str(info.value)
        assert not os.path.lexists(dst / member)
    trees.assert_no_tmp(dst) if dst.exists() else None
    assert not (tmp_path / "evil").exists()
    return dst


@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "/evil"])
def test_names_leaving_the_destination(name: str, tmp_path: Path) -> None:
    data = zips.member_bytes([("ok.txt", b"fine"), ("X" * len(name), b"bad")])
    data = zips.rename_member(data, b"X" * len(name), name.encode())
    stage_fails(tmp_path, data, "absolute name|'..'", name)


def test_symlink_leaving_the_tree(tmp_path: Path) -> None:
    data = zips.member_bytes([("a/link", b"../../evil")], modes={"a/link": LINK})
    stage_fails(tmp_path, data, "leaves the destination", "a/link", err=UnsupportedFileError)
    res = fastload.stage(tmp_path / "bad.zip", tmp_path / "skip", on_special="skip")
    assert res.files == 0 and not os.path.lexists(tmp_path / "skip" / "a" / "link")


def test_symlink_inside_the_tree(tmp_path: Path) -> None:
    data = zips.member_bytes([("a/f", b"x"), ("a/link", b"f")], modes={"a/link": LINK})
    (tmp_path / "ok.zip").write_bytes(data)
    fastload.stage(tmp_path / "ok.zip", tmp_path / "dst")
    assert os.readlink(tmp_path / "dst" / "a" / "link") == "f"


def test_duplicate_names(tmp_path: Path) -> None:
    data = zips.member_bytes([("a.txt", b"one"), ("a.txt", b"two")])
    stage_fails(tmp_path, data, "appears twice", "a.txt")


def test_file_and_folder_of_one_name(tmp_path: Path) -> None:
    data = zips.member_bytes([("a", b"one"), ("a/b", b"two")])
    stage_fails(tmp_path, data, "both a file and a folder", "a/b")


def test_data_larger_than_declared(tmp_path: Path) -> None:
    data = zips.member_bytes([("ok.txt", b"fine"), ("big.txt", b"x" * 5000)],
                             method=zipfile.ZIP_DEFLATED)  # fmt: skip
    data = zips.patch_member(data, 1, usize=100)
    stage_fails(tmp_path, data, "more than the 100 bytes declared", "big.txt")


def test_crc_mismatch(tmp_path: Path) -> None:
    data = bytearray(zips.member_bytes([("ok.txt", b"fine"), ("c.txt", b"payload!")]))
    at = bytes(data).find(b"payload!")
    data[at] ^= 0xFF
    dst = stage_fails(tmp_path, bytes(data), "CRC-32 mismatch", "c.txt")
    # the other member may be whole: a resume after fixing the archive keeps it
    assert not (dst / "c.txt").exists()


def test_overlapping_members(tmp_path: Path) -> None:
    data = zips.member_bytes([("a.txt", b"A" * 1000), ("b.txt", b"B" * 1000)])
    data = zips.patch_member(data, 1, offset=zips.local_offset(data, 0))
    stage_fails(tmp_path, data, "overlaps", "a.txt")


def test_ratio_and_size_limits(tmp_path: Path) -> None:
    data = zips.member_bytes([("zeros", b"\0" * (8 << 20))], method=zipfile.ZIP_BZIP2)
    stage_fails(tmp_path, data, "ratio limit", "zeros")
    deflated = zips.member_bytes([("zeros", b"\0" * (8 << 20))], method=zipfile.ZIP_DEFLATED)
    stage_fails(tmp_path, deflated, "ratio limit 100", "zeros", zip_options={"max_ratio": 100})
    stage_fails(tmp_path, deflated, "over the limit of 1000000",
                zip_options={"max_size": 1_000_000})  # fmt: skip
    res = fastload.stage(tmp_path / "bad.zip", tmp_path / "ok", zip_options={"max_ratio": 1e6})
    assert res.bytes == 8 << 20


def test_local_header_disagreeing_with_the_central_directory(tmp_path: Path) -> None:
    data = zips.member_bytes([("ok.txt", b"fine"), ("name.txt", b"data")])
    stage_fails(tmp_path, zips.rename_member(data, b"name.txt", b"evil.txt", central=False),
                "disagrees", "name.txt")  # fmt: skip
    crc = zips.patch_member(data, 1, local=False, crc=0x1234)
    stage_fails(tmp_path, crc, "disagree", "name.txt")


def test_encrypted_member(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "secret.txt").write_bytes(b"hush")
    archive = zips.infozip(src, tmp_path / "enc.zip", "-P", "pw")
    stage_fails(tmp_path, archive.read_bytes(), "encrypted", "secret.txt")


def test_split_archive(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    trees.write_patterned(src / "big.bin", 300_000, seed=1)
    archive = zips.infozip(src, tmp_path / "split.zip", "-s", "64k")
    assert (tmp_path / "split.z01").exists()
    stage_fails(tmp_path, archive.read_bytes(), "split or spanned")


def test_unsupported_method_named(tmp_path: Path) -> None:
    data = bytearray(zips.member_bytes([("m.txt", b"data")]))
    data[zips.central_entries(bytes(data))[0] + 10] = 98  # PPMd, in the central entry
    data[zips.local_offset(bytes(data), 0) + 8] = 98
    stage_fails(tmp_path, bytes(data), "compressed with ppmd", "m.txt")


def test_truncated_at_every_byte(tmp_path: Path) -> None:
    data = zips.member_bytes([("a/x.txt", b"x" * 300), ("b.txt", b"hello")],
                             method=zipfile.ZIP_DEFLATED)  # fmt: skip
    for n in range(len(data)):
        archive = tmp_path / "cut.zip"
        archive.write_bytes(data[:n])
        dst = tmp_path / f"dst{n}"
        with pytest.raises(StageError) as info:
            fastload.stage(archive, dst, unpack=True)
        assert str(archive) in str(info.value), (n, info.value)
        assert not dst.exists() or trees.regular_files(dst) == {}, n


def test_truncated_data_with_its_directory_intact(tmp_path: Path) -> None:
    """The last member's data cut short, the central directory rebuilt after it: the
    member is refused, the one before is whole."""
    data = zips.member_bytes([("a.txt", b"A" * 100), ("b.txt", os.urandom(5000))])
    cut = 2000
    cd = zips.central_entries(data)[0]
    end = bytearray(data[: cd - cut] + data[cd:])
    eocd = bytes(end).rfind(b"PK\x05\x06")
    end[eocd + 16 : eocd + 20] = (cd - cut).to_bytes(4, "little")  # the directory's offset
    stage_fails(tmp_path, bytes(end), "overlaps", "b.txt")


def test_random_corruption_is_refused_or_extracted_whole(tmp_path: Path) -> None:
    """Bytes of a small zip changed at random (seeded): each stage extracts it (the
    members' bytes whole: their CRC-32s held) or raises a StageError or ValueError
    naming the archive; never another exception."""
    import random

    data = zips.member_bytes(
        [("a/x.txt", b"x" * 300), ("b.txt", b"hello world" * 20), ("c/", b""), ("l", b"b.txt")],
        method=zipfile.ZIP_DEFLATED, modes={"c/": stat.S_IFDIR | 0o755, "l": LINK},
    )  # fmt: skip
    rnd = random.Random(53)
    for it in range(300):
        damaged = bytearray(data)
        for _ in range(rnd.randint(1, 4)):
            damaged[rnd.randrange(len(damaged))] = rnd.randrange(256)
        archive = tmp_path / f"z{it}.zip"
        archive.write_bytes(damaged)
        try:
            fastload.stage(archive, tmp_path / f"d{it}")
        except (StageError, ValueError) as e:
            assert str(archive) in str(e) or "zip_options" in str(e), e
            continue
        # It extracted: every member's CRC-32 held, so a file at an original name holds
        # that member's bytes (a flipped name lands elsewhere, a flipped time is a time).
        for name, body in (("a/x.txt", b"x" * 300), ("b.txt", b"hello world" * 20)):
            p = tmp_path / f"d{it}" / name
            if p.is_file() and not p.is_symlink():
                assert p.read_bytes() == body, (it, name)
