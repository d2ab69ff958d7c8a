"""The zip format, read defensively: the end of central directory (and its zip64 records),
the central directory, local headers, names, modes and times (:func:`read_directory`,
:func:`local_data`). Nothing here trusts the archive: every length and offset is
checked against the file's size and the records around it, and a broken or hostile zip
is a :class:`ZipFormatError` naming the archive and the member.

Written from the format's specification (PKWARE's APPNOTE.TXT, Info-ZIP's notes on its
extra fields); the standard library's ``zipfile`` is not used to read archives.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import posixpath
import stat
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

from ..errors import StageError

# Signatures.
_EOCD_SIG = b"PK\x05\x06"
_Z64_LOCATOR_SIG = b"PK\x06\x07"
_Z64_EOCD_SIG = b"PK\x06\x06"
_CENTRAL_SIG = b"PK\x01\x02"
LOCAL_SIG = b"PK\x03\x04"
_SPANNED_SIG = b"PK\x07\x08"

_EOCD = struct.Struct("<4sHHHHIIH")  # 22 bytes
_Z64_LOCATOR = struct.Struct("<4sIQI")  # 20 bytes
_Z64_EOCD = struct.Struct("<4sQHHIIQQQQ")  # 56 bytes
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # 46 bytes
LOCAL = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes

_MAX_COMMENT = 0xFFFF
# How much of a local header's name and extra field one read takes beyond the central
# directory's idea of them (a local extra field may differ from the central one).
LOCAL_SLACK = 1024

# Methods: number -> name. Those read here are STORED, DEFLATED and the decoders
# zipcodecs.py finds installed.
METHODS = {
    0: "stored", 1: "shrunk", 6: "imploded", 8: "deflate", 9: "deflate64", 12: "bzip2",
    14: "lzma", 93: "zstd", 95: "xz", 96: "jpeg", 97: "wavpack", 98: "ppmd", 99: "aes",
}  # fmt: skip

FILE, DIR, LINK = 0, 1, 2


class ZipFormatError(StageError, ValueError):
    """A zip archive that cannot be read safely: broken, truncated, or hostile. Names the
    archive (``filename``) and, where one is at fault, the member."""


def zip_error(archive: str, what: str, member: str | None = None) -> ZipFormatError:
    where = f"'{archive}'" + (f", member '{member}'" if member is not None else "")
    e = ZipFormatError(errno.EINVAL, f"{where}: {what}")
    e.filename = archive
    return e


@dataclasses.dataclass(frozen=True)
class ZipLimits:
    """What a zip may ask of the destination before it is refused as a bomb: the
    uncompressed bytes of all its members (``max_size``; None: only the free space
    bounds it), and a member's uncompressed size over its compressed size
    (``max_ratio``, checked for members over ``ratio_above`` bytes)."""

    max_size: int | None = None
    max_ratio: float = 10000.0
    ratio_above: int = 1 << 20
    # Of names not flagged UTF-8: None is unzip's rule (CP437 where the zip was made on
    # DOS, Windows or OS/2; elsewhere the name's bytes as they are), a code page for all.
    encoding: str | None = None

    @classmethod
    def of(cls, options: Any) -> ZipLimits:
        """From stage()'s ``zip_options`` (a mapping, or None), checked: a ValueError
        names a bad key or value."""
        if options is None:
            return cls()
        if isinstance(options, ZipLimits):
            return options
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(options) - known)
        if bad:
            raise ValueError(f"zip_options: unknown key(s) {bad}; known: {sorted(known)}")
        out = cls(**options)
        if out.max_size is not None and int(out.max_size) < 0:
            raise ValueError(f"zip_options: max_size must be >= 0, not {out.max_size!r}")
        if not float(out.max_ratio) >= 1:
            raise ValueError(f"zip_options: max_ratio must be >= 1, not {out.max_ratio!r}")
        try:
            b"x".decode(out.encoding or "cp437")
        except LookupError:
            raise ValueError(f"zip_options: unknown encoding {out.encoding!r}") from None
        return out

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Member:
    """One central directory entry, checked: its path in the tree (normalised), kind,
    method, sizes, CRC-32, where its local header starts, its mode and time."""

    index: int
    path: str
    raw_name: bytes
    kind: int
    method: int
    flags: int
    crc: int
    csize: int
    usize: int
    offset: int  # of the local header
    mode: int
    mtime_ns: int
    end: int = 0  # where the next member (or the central directory) starts


@dataclasses.dataclass
class Directory:
    """What the end of central directory and the central directory say."""

    members: list[Member]
    cd_offset: int
    cd_size: int
    bias: int  # bytes before the archive proper (a self-extracting stub)


# (offset, length) -> the bytes there (fewer at the end)
ReadAt = Callable[[int, int], "bytes | memoryview"]


def is_zip_head(head: bytes) -> bool:
    """Whether a file starting with ``head`` looks like a zip (a local header, or the
    end record of an empty zip)."""
    return head[:4] == LOCAL_SIG or head[:4] == _EOCD_SIG or head[:4] == _SPANNED_SIG


def is_zip_name(name: str) -> bool:
    return name.lower().endswith(".zip")


def is_zip_file(path: str | os.PathLike[str]) -> bool:
    """Whether a local file is a zip: by its name (``.zip``) or its first bytes."""
    if is_zip_name(os.fspath(path)):
        return True
    try:
        with open(path, "rb") as f:
            return is_zip_head(f.read(4))
    except OSError:
        return False


def _find_eocd(name: str, read_at: ReadAt, size: int) -> tuple[int, tuple[Any, ...]]:
    if size < _EOCD.size:
        raise zip_error(name, f"not a zip archive, or truncated: {size} bytes, no end of "
                        "central directory")  # fmt: skip
    start = max(0, size - _EOCD.size - _MAX_COMMENT)
    tail = bytes(read_at(start, size - start))
    if len(tail) != size - start:
        raise zip_error(name, "short read at the end of the archive (changed while read?)")
    at = len(tail)
    while True:
        at = tail.rfind(_EOCD_SIG, 0, at)
        if at < 0:
            raise zip_error(name, "not a zip archive, or truncated: no end of central "
                            "directory record; pass unpack=False to copy it as a file")  # fmt: skip
        if at + _EOCD.size <= len(tail):
            rec = _EOCD.unpack_from(tail, at)
            if at + _EOCD.size + rec[7] == len(tail):  # its comment ends the file
                return start + at, rec


def read_directory(name: str, read_at: ReadAt, size: int, limits: ZipLimits
                   ) -> Directory:  # fmt: skip
    """The central directory of the zip ``name`` (``size`` bytes, read by ``read_at``),
    every entry checked: names, sizes within the file, no overlaps, no duplicates,
    supported features; the limits of a bomb."""
    eocd_at, (_s, disk, cd_disk, n_disk, n_total, cd_size, cd_off, _c) = _find_eocd(
        name, read_at, size
    )
    if disk != 0 or cd_disk != 0 or n_disk != n_total:
        raise zip_error(name, f"a split or spanned archive (disk {disk} of a set): join "
                        "its parts first (zip -s 0 in.zip --out whole.zip)")  # fmt: skip
    end_of_cd = eocd_at
    if 0xFFFF in (n_total,) or 0xFFFFFFFF in (cd_size, cd_off):
        loc_at = eocd_at - _Z64_LOCATOR.size
        loc = bytes(read_at(loc_at, _Z64_LOCATOR.size)) if loc_at >= 0 else b""
        if len(loc) == _Z64_LOCATOR.size and loc[:4] == _Z64_LOCATOR_SIG:
            _s, z_disk, z_off, disks = _Z64_LOCATOR.unpack(loc)
            if z_disk != 0 or disks > 1:
                raise zip_error(name, "a split or spanned zip64 archive: join its parts first")
            rec = bytes(read_at(z_off, _Z64_EOCD.size)) if z_off + _Z64_EOCD.size <= loc_at else b""
            if len(rec) != _Z64_EOCD.size or rec[:4] != _Z64_EOCD_SIG:
                raise zip_error(name, "broken zip64 end of central directory (truncated?)")
            z = _Z64_EOCD.unpack(rec)
            if z[4] != 0 or z[5] != 0 or z[6] != z[7]:
                raise zip_error(name, "a split or spanned zip64 archive: join its parts first")
            n_total, cd_size, cd_off = z[7], z[8], z[9]
            end_of_cd = z_off
    bias = end_of_cd - (cd_off + cd_size)
    if bias < 0 or cd_size > end_of_cd:
        raise zip_error(name, "the central directory lies beyond the end of the archive "
                        "(truncated?)")  # fmt: skip
    cd_off += bias
    if n_total > cd_size // _CENTRAL.size:
        raise zip_error(name, f"{n_total} entries cannot fit in a central directory of "
                        f"{cd_size} bytes")  # fmt: skip
    cd = bytes(read_at(cd_off, cd_size))
    if len(cd) != cd_size:
        raise zip_error(name, "short read of the central directory (truncated?)")
    members = _parse_central(name, cd, n_total, bias, limits)
    _check_layout(name, members, cd_off, limits)
    return Directory(members, cd_off, cd_size, bias)


def _extra_fields(extra: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    at = 0
    while at + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, at)
        if at + 4 + n > len(extra):
            break  # a torn last field: Info-ZIP ignores it too
        out.setdefault(tag, extra[at + 4 : at + 4 + n])
        at += 4 + n
    return out


def _dos_time(t: int, d: int) -> int:
    """A DOS date and time (local time, 2 s steps) as ns since the epoch."""
    parts = ((d >> 9) + 1980, (d >> 5) & 0xF, d & 0x1F, t >> 11, (t >> 5) & 0x3F, (t & 0x1F) * 2)
    try:
        return int(time.mktime((*parts, 0, 0, -1))) * 1_000_000_000
    except (OverflowError, ValueError):
        return 0


def extra_mtime(fields: dict[int, bytes]) -> int | None:
    """A member's time from its extra fields, as unzip takes it on Unix: ``UT`` (extended
    timestamp), else the old Info-ZIP Unix field (``UX``), else NTFS's."""
    ut = fields.get(0x5455)
    if ut is not None and len(ut) >= 5 and ut[0] & 1:
        return int(struct.unpack_from("<i", ut, 1)[0]) * 1_000_000_000
    ux = fields.get(0x5855)
    if ux is not None and len(ux) >= 8:
        return int(struct.unpack_from("<i", ux, 4)[0]) * 1_000_000_000
    nt = fields.get(0x000A)
    if nt is not None and len(nt) >= 32 and struct.unpack_from("<HH", nt, 4) == (1, 24):
        ticks = int(struct.unpack_from("<Q", nt, 8)[0])
        return (ticks - 116444736000000000) * 100
    return None


# Hosts (the high byte of "version made by") whose legacy names are in an OEM code page.
_OEM_HOSTS = {0, 6, 11, 14}  # MS-DOS (FAT), OS/2 HPFS, Windows NTFS, VFAT


def _decode_name(raw: bytes, flags: int, fields: dict[int, bytes], encoding: str | None,
                 host: int) -> str:  # fmt: skip
    if flags & 0x800:
        return raw.decode("utf-8", "surrogateescape")
    up = fields.get(0x7075)  # Info-ZIP Unicode Path: valid while it names this raw name
    if (up is not None and len(up) > 5 and up[0] == 1
            and struct.unpack_from("<I", up, 1)[0] == zlib.crc32(raw)):  # fmt: skip
        return up[5:].decode("utf-8", "surrogateescape")
    if raw.isascii():
        return raw.decode("ascii")
    if encoding is None:
        encoding = "cp437" if host in _OEM_HOSTS else "utf-8"
    return raw.decode(encoding, "surrogateescape")


def safe_path(archive: str, name: str) -> str:
    """The member's path in the tree: ``./`` and repeated slashes dropped; absolute
    names, ``..`` and NUL refused."""
    if "\0" in name:
        raise zip_error(archive, "a name holding a NUL byte", name)
    if name.startswith("/") or (len(name) > 1 and name[1] == ":" and name[0].isalpha()):
        raise zip_error(archive, "an absolute name (refused: it would land outside the "
                        "destination)", name)  # fmt: skip
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise zip_error(archive, "a name with '..' (refused: it would land outside the "
                        "destination)", name)  # fmt: skip
    return "/".join(parts)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _parse_central(archive: str, cd: bytes, n_total: int, bias: int, limits: ZipLimits
                   ) -> list[Member]:  # fmt: skip
    members: list[Member] = []
    umask = _umask()
    at = 0
    for i in range(n_total):
        if at + _CENTRAL.size > len(cd) or cd[at : at + 4] != _CENTRAL_SIG:
            raise zip_error(archive, f"central directory entry {i} is broken (truncated?)")
        (_s, made_by, _need, flags, method, dtime, ddate, crc, csize, usize, n_name,
         n_extra, n_comment, disk, _int, ext_attr, offset) = _CENTRAL.unpack_from(
            cd, at)  # fmt: skip
        body = at + _CENTRAL.size
        at = body + n_name + n_extra + n_comment
        if at > len(cd):
            raise zip_error(archive, f"central directory entry {i} runs past its end")
        raw = cd[body : body + n_name]
        fields = _extra_fields(cd[body + n_name : body + n_name + n_extra])
        name = _decode_name(raw, flags, fields, limits.encoding, made_by >> 8)
        z64 = fields.get(0x0001, b"")
        want = [k for k, v in (("u", usize), ("c", csize), ("o", offset)) if v == 0xFFFFFFFF]
        if disk == 0xFFFF:
            want.append("d")
        if len(z64) < 8 * len([k for k in want if k != "d"]):
            raise zip_error(archive, "a zip64 size or offset without its zip64 extra field",
                            name)  # fmt: skip
        pos = 0
        for k in want:
            if k == "d":
                disk = struct.unpack_from("<I", z64, pos)[0] if pos + 4 <= len(z64) else 0
                continue
            v = struct.unpack_from("<Q", z64, pos)[0]
            pos += 8
            usize, csize, offset = (v if k == "u" else usize, v if k == "c" else csize,
                                    v if k == "o" else offset)  # fmt: skip
        if disk != 0:
            raise zip_error(archive, f"a member on disk {disk} of a split archive", name)
        if flags & 0x41 or method == 99:
            raise zip_error(archive, "an encrypted member (not supported: decrypt the "
                            "archive first)", name)  # fmt: skip
        path = safe_path(archive, name)
        unix = made_by >> 8 == 3 and ext_attr >> 16
        mode = ext_attr >> 16 if unix else 0
        if not unix:
            is_dir = name.endswith("/") or bool(ext_attr & 0x10)
            mode = (stat.S_IFDIR | 0o777 if is_dir else stat.S_IFREG | 0o666) & ~umask
            if ext_attr & 1 and not is_dir:  # read-only (MS-DOS attribute)
                mode &= ~0o222
        kind = {stat.S_IFDIR: DIR, stat.S_IFLNK: LINK, stat.S_IFREG: FILE}.get(
            stat.S_IFMT(mode), FILE if stat.S_IFMT(mode) == 0 else -1
        )
        if name.endswith("/"):
            kind = DIR
        if kind < 0:
            raise zip_error(archive, f"a special file (mode {mode:o}): refused", name)
        if not path and kind != DIR:
            raise zip_error(archive, "a member with an empty name", name)
        mtime = extra_mtime(fields)
        members.append(Member(
            index=i, path=path, raw_name=raw, kind=kind, method=method, flags=flags,
            crc=crc, csize=csize, usize=usize, offset=offset + bias,
            mode=stat.S_IMODE(mode) & 0o1777 if kind != LINK else 0o777,
            mtime_ns=mtime if mtime is not None else _dos_time(dtime, ddate),
        ))  # fmt: skip
    return members


def _check_layout(archive: str, members: list[Member], cd_off: int, limits: ZipLimits) -> None:
    """Members within the archive, none overlapping another (a bomb's trick), no name
    twice, nothing needing more than the limits allow."""
    order = sorted(members, key=lambda m: m.offset)
    for k, m in enumerate(order):
        m.end = order[k + 1].offset if k + 1 < len(order) else cd_off
        if m.kind == DIR:
            continue  # (an Info-ZIP directory has no data; its header still takes room)
        if m.offset + LOCAL.size + len(m.raw_name) + m.csize > m.end:
            nxt = "the central directory" if k + 1 == len(order) else f"'{order[k + 1].path}'"
            raise zip_error(archive, f"its data ({m.csize} bytes at {m.offset}) overlaps "
                            f"{nxt} (a zip bomb, or a broken archive)", m.path)  # fmt: skip
        if m.method == 0 and m.csize != m.usize:
            raise zip_error(archive, f"stored with {m.csize} bytes but declared {m.usize}",
                            m.path)  # fmt: skip
        if m.usize > limits.ratio_above and m.usize > limits.max_ratio * max(1, m.csize):
            raise zip_error(archive, f"expands {m.csize} bytes to {m.usize} (over the "
                            f"ratio limit {limits.max_ratio:g}: a zip bomb? raise "
                            "zip_options max_ratio to allow it)", m.path)  # fmt: skip
    total = sum(m.usize for m in members if m.kind == FILE)
    if limits.max_size is not None and total > limits.max_size:
        raise zip_error(archive, f"its members hold {total} bytes uncompressed, over the "
                        f"limit of {limits.max_size} (zip_options max_size)")  # fmt: skip
    seen: dict[str, Member] = {}
    for m in members:
        if m.path in seen and not (m.kind == DIR and seen[m.path].kind == DIR):
            raise zip_error(archive, "the name appears twice in the archive", m.path)
        seen[m.path] = m
    for m in members:  # a file (or link) cannot also be a folder of another member
        parent = posixpath.dirname(m.path)
        while parent:
            other = seen.get(parent)
            if other is not None and other.kind != DIR:
                raise zip_error(archive, f"'{parent}' is both a file and a folder", m.path)
            parent = posixpath.dirname(parent)


def data_span(archive: str, m: Member, head: bytes | memoryview) -> tuple[int, int]:
    """Checks the local header at the start of ``head`` (read from ``m.offset``) against
    the central directory's entry; returns where the member's data starts (relative to
    the header) and ends (its compressed size after that)."""
    if len(head) < LOCAL.size:
        raise zip_error(archive, "truncated local header", m.path)
    (sig, _need, flags, method, _t, _d, crc, csize, usize, n_name,
     n_extra) = LOCAL.unpack_from(head)  # fmt: skip
    if sig != LOCAL_SIG:
        raise zip_error(archive, f"no local header at offset {m.offset} (the central "
                        "directory disagrees with the data)", m.path)  # fmt: skip
    start = LOCAL.size + n_name + n_extra
    name = head[LOCAL.size : LOCAL.size + n_name]
    if len(head) >= LOCAL.size + n_name and name != m.raw_name:
        raise zip_error(archive, f"the local header names it {name!r}: the central "
                        "directory disagrees with the local headers", m.path)  # fmt: skip
    if method != m.method or (flags ^ m.flags) & 0x0009:
        raise zip_error(archive, "its local header's method or flags disagree with the "
                        "central directory", m.path)  # fmt: skip
    if not flags & 0x8:  # no data descriptor: the local header's sizes and CRC count
        if csize == 0xFFFFFFFF or usize == 0xFFFFFFFF:
            if len(head) < start:
                raise zip_error(archive, "truncated local header", m.path)
            z64 = _extra_fields(bytes(head[LOCAL.size + n_name : start])).get(0x0001, b"")
            if len(z64) >= 16:
                usize, csize = struct.unpack_from("<QQ", z64)
        if (crc, csize, usize) != (m.crc, m.csize, m.usize):
            raise zip_error(archive, f"the local header declares crc {crc:08x}, {csize} -> "
                            f"{usize} bytes, the central directory crc {m.crc:08x}, "
                            f"{m.csize} -> {m.usize}: they disagree", m.path)  # fmt: skip
    if m.offset + start + m.csize > m.end:
        raise zip_error(archive, f"its data ({m.csize} bytes) runs into the next member "
                        "(overlapping members: a zip bomb, or a broken archive)", m.path)
    return start, start + m.csize
