"""The journal (issue 38): binary frames of fixed records, a CRC per frame. What must hold:
every record written is read back exactly; a frame torn by a kill (cut short, or its
bytes not those its CRC was taken of) ends the journal, everything before it kept; an
older version's ``journal.jsonl`` is still read, and a resume from it copies only what it
does not record; a record costs well under what a JSON line did."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import fastload
from fastload.staging.columns import FileTable, Record
from fastload.staging.state import JOURNAL, OLD_JOURNAL, Journal, state_dir

CHUNK = 1 << 20


def _records(n: int) -> dict[str, Record]:
    out = {}
    for i in range(n):
        chunks = 1 + i % 3
        digest = b"".join((i * 7919 + k).to_bytes(8, "little") for k in range(chunks)).hex()
        out[f"dir{i % 7}/file é {i:05d}.bin"] = Record(i * 1000, 1_700_000_000_123_456_789 + i,
                                                      0o644 if i % 2 else 0o600, digest)
    return out


def _written(dst: Path, keep: dict[str, Record], batches: list[dict[str, Record]]) -> Journal:
    j = Journal(dst, CHUNK)
    j.open(keep)
    for b in batches:
        j.append([(p, *r) for p, r in b.items()])
    j.close()
    return Journal(dst, CHUNK)


def test_every_record_is_read_back(tmp_path: Path) -> None:
    recs = _records(3000)
    items = list(recs.items())
    keep = dict(items[:1000])
    batches = [dict(items[1000:1001]), dict(items[1001:2500]), dict(items[2500:])]
    j = _written(tmp_path / "dst", keep, batches)
    assert j.load() == recs
    assert (j.found, j.trusted, j.same_boot) == (True, True, True)
    table = j.table()
    assert list(table) == sorted(recs, key=os.fsencode)
    assert dict(table.items()) == recs
    # A path journalled again (a file re-fetched) keeps its last record.
    again = Record(1, 2, 0o644, "00" * 8)
    j2 = _written(tmp_path / "dst2", keep, [{items[0][0]: again}])
    assert j2.load()[items[0][0]] == again
    assert j2.table()[items[0][0]] == again


def test_a_torn_or_damaged_last_frame_is_ignored(tmp_path: Path) -> None:
    recs = _records(200)
    items = list(recs.items())
    first, second = dict(items[:120]), dict(items[120:])
    dst = tmp_path / "dst"
    j = _written(dst, {}, [first, second])
    path = state_dir(dst) / JOURNAL
    whole = path.read_bytes()
    assert j.load() == recs
    for cut in (1, 9, len(whole) // 4):  # cut inside the second frame, or its head
        path.write_bytes(whole[:-cut])
        assert Journal(dst, CHUNK).load() == first, cut
    damaged = bytearray(whole)
    damaged[-5] ^= 0x40  # a byte of the last frame's last digest
    path.write_bytes(bytes(damaged))
    assert Journal(dst, CHUNK).load() == first
    # A journal of another chunk size, or not a journal, holds nothing.
    path.write_bytes(whole)
    other = Journal(dst, CHUNK * 2)
    assert other.load() == {} and not other.found
    path.write_bytes(b"not a journal at all")
    assert Journal(dst, CHUNK).load() == {}


def test_a_record_costs_less_than_a_json_line(tmp_path: Path) -> None:
    recs = _records(2000)
    dst = tmp_path / "dst"
    _written(dst, {}, [recs])
    binary = (state_dir(dst) / JOURNAL).stat().st_size
    as_json = sum(len(json.dumps([p, *r])) + 1 for p, r in recs.items())
    paths = sum(len(os.fsencode(p)) for p in recs)
    digests = sum(len(r.digests) // 2 for r in recs.values())
    # 28 bytes of fixed record besides path and digests, a frame header, the header.
    assert binary <= paths + digests + 28 * len(recs) + 200
    assert binary < 0.7 * as_json


@pytest.mark.native
def test_an_older_versions_json_journal_is_resumed(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = {}
    for i in range(60):
        rel = f"d{i % 4}/f{i:03d}.bin"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(500 + 97 * i)
        (src / rel).write_bytes(data)
        files[rel] = data

    def stop(bd: int, bt: int, fd: int, ft: int) -> None:
        if fd >= 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fastload.stage(src, dst, progress=stop, workers=1)
    raw = (state_dir(dst) / JOURNAL).read_bytes()
    n = int.from_bytes(raw[8:12], "little")
    header = json.loads(raw[12 : 12 + n])
    done = Journal(dst, header["chunk_size"]).load()
    assert len(done) >= 20
    # Some of those records as an older version wrote them: one JSON line per file; the
    # files it does not record are gone.
    kept = dict(sorted(done.items())[:15])
    lines = [json.dumps(header)] + [json.dumps([p, *r]) for p, r in kept.items()]
    (state_dir(dst) / OLD_JOURNAL).write_text("\n".join(lines) + "\n")
    (state_dir(dst) / JOURNAL).unlink()
    for rel in files:
        if rel not in kept:
            (dst / rel).unlink(missing_ok=True)
    assert Journal(dst, header["chunk_size"]).load() == kept

    r = fastload.stage(src, dst)
    assert r.copied_files == len(files) - len(kept)
    for rel, data in files.items():
        assert (dst / rel).read_bytes() == data
    assert not (state_dir(dst) / OLD_JOURNAL).exists()
    assert not (state_dir(dst) / JOURNAL).exists()
    assert fastload.verify(dst).ok
    assert len(FileTable.read(next(state_dir(dst).glob("files-*.bin")))) == len(files)
