"""The manifest of issue 38: a small JSON header (``manifest.json``) naming a binary table
of the files beside it, per-file state in columns, and manifests of the previous format
(version 1: every record in the JSON) still read."""

from __future__ import annotations

import json
import os
import sys
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload.staging.columns import FileTable, Listing, Record
from fastload.staging.done import Done
from fastload.staging.state import read_manifest, state_dir
from kit import trees

pytestmark = pytest.mark.native


def _header(dst: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((state_dir(dst) / "manifest.json").read_text())
    return data


def _tables(dst: Path) -> list[Path]:
    return sorted(state_dir(dst).glob("files-*.bin"))


def _flip(path: Path) -> None:
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _to_version_1(dst: Path) -> None:
    """Rewrites ``dst``'s manifest as the previous version wrote it: the records in the
    JSON, no table, a fingerprint of its own formula (over each entry's repr)."""
    m = read_manifest(dst)
    assert m is not None
    files = m.pop("files")
    head = {k: v for k, v in m.items() if k != "table"}
    head.update(version=1, files={p: list(r) for p, r in files.items()}, fingerprint="0" * 64)
    (state_dir(dst) / "manifest.json").write_text(json.dumps(head))
    for t in _tables(dst):
        t.unlink()


def test_manifest_is_a_header_naming_a_table(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    trees.build_rich_tree(src)
    fastload.stage(src, dst)
    head = _header(dst)
    assert head["version"] == 2 and "files" not in head
    assert [t.name for t in _tables(dst)] == [head["table"]]
    table = FileTable.read(state_dir(dst) / head["table"])
    want = trees.regular_files(src)
    assert sorted(table) == sorted(want) and head["files_count"] == len(want)
    assert {p: r.size for p, r in table.items()} == want
    assert list(table) == sorted(table, key=os.fsencode)  # sorted by path bytes
    # A changed source: a new table replaces the old one, and verify reads it.
    changed = next(p for p, s in sorted(want.items()) if s > 0)
    (src / changed).write_bytes(b"changed")
    r = fastload.stage(src, dst)
    assert r.copied_files == 1
    assert [t.name for t in _tables(dst)] == [_header(dst)["table"]] != [head["table"]]
    assert fastload.verify(dst).ok
    trees.assert_same_tree(src, dst)


def test_table_rows_sorted_last_wins_and_round_trip(tmp_path: Path) -> None:
    odd = os.fsdecode(b"d/\xff-not-utf8")
    rows: list[tuple[str, int, int, int, Any]] = [
        ("b/2", 5, 50, 0o644, "01" * 8),
        (odd, 7, 70, 0o600, b"\x02" * 16),
        ("a", 0, 10, 0o755, ""),
        ("b/2", 6, 60, 0o644, "03" * 8),  # again: the last row wins
    ]
    table = FileTable.of_rows(rows)
    assert list(table) == ["a", "b/2", odd]
    assert table["b/2"] == Record(6, 60, 0o644, "03" * 8)
    assert table[odd] == Record(7, 70, 0o600, "02" * 16)
    assert "c" not in table and table.find("b") == -1
    table.write(tmp_path / "t.bin")
    back = FileTable.read(tmp_path / "t.bin")
    assert dict(back.items()) == dict(table.items()) and back.total_bytes == 13
    assert list(back.matches([b"a", b"a2", os.fsencode(odd)])) == [0, -1, 2]
    assert list(back.without(["b/2"])) == ["a", odd]
    other = FileTable.of_rows([("b/2", 1, 1, 0o644, "ff" * 8), ("c", 2, 2, 0o644, "ee" * 8)])
    merged = back.union(other)
    assert list(merged) == ["a", "b/2", "c", odd] and merged["b/2"] == back["b/2"]


def test_a_torn_table_is_refused_naming_it(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    trees.build_small_files(src, 40, per_dir=10)
    fastload.stage(src, dst)
    (table,) = _tables(dst)
    with open(table, "r+b") as f:
        f.truncate(os.path.getsize(table) - 3)
    with pytest.raises(ValueError, match=str(table)):
        FileTable.read(table)
    assert read_manifest(dst) is None  # as a torn manifest.json: not complete
    r = fastload.stage(src, dst)
    assert not r.skipped and fastload.verify(dst).ok
    trees.assert_same_tree(src, dst)


def test_a_version_1_manifest_is_read_verified_and_restaged_without_copying(
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    trees.build_small_files(src, 60, per_dir=20)
    fastload.stage(src, dst)
    _to_version_1(dst)
    res = fastload.verify(dst)
    assert res.ok and res.files == 60
    r = fastload.stage(src, dst)  # recognised: every file in place, none copied
    assert r.files == 60 and r.copied_files == 0
    assert _header(dst)["version"] == 2 and len(_tables(dst)) == 1
    trees.assert_same_tree(src, dst)


def test_verify_marks_damage_in_a_version_1_manifest_and_stage_repairs_it(
    tmp_path: Path,
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    trees.build_small_files(src, 60, per_dir=20)
    fastload.stage(src, dst)
    _to_version_1(dst)
    victim = sorted(trees.regular_files(dst))[7]
    _flip(dst / victim)
    res = fastload.verify(dst)
    assert res.mismatched == [victim] and not res.missing
    assert _header(dst)["damaged"] == [victim]
    r = fastload.stage(src, dst)
    assert r.copied_files == 1
    assert fastload.verify(dst).ok
    trees.assert_same_tree(src, dst)


def test_verify_reads_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree larger than one read-back batch: every batch checked, damage found in the
    last one as in the first."""
    from fastload.staging import api

    monkeypatch.setattr(api, "VERIFY_BATCH", 16)
    src, dst = tmp_path / "src", tmp_path / "dst"
    trees.build_small_files(src, 70, per_dir=10)
    fastload.stage(src, dst)
    names = sorted(trees.regular_files(dst), key=os.fsencode)
    _flip(dst / names[0])
    _flip(dst / names[-1])
    (dst / names[40]).unlink()
    res = fastload.verify(dst)
    assert res.mismatched == sorted([names[0], names[-1]]) and res.missing == [names[40]]


def test_a_listing_is_converted_a_slice_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastload.staging import columns

    monkeypatch.setattr(columns, "_SLICE", 4)
    raw = [(f"p{i:03d}", i % 3, i, 1, 0o644, 10 + i, f"t{i}") for i in range(11)]
    kept = Listing.of(raw)
    assert len(raw) == 11  # not consumed unless asked
    eaten = Listing.of(list(raw), consume=True)
    for listing in (kept, eaten):
        assert [tuple(e) for e in listing] == [
            (p, k, s, b, m, t, tgt if k == 2 else "") for p, k, s, b, m, t, tgt in raw
        ]
        assert listing.targets == {i: f"t{i}" for i in range(11) if i % 3 == 2}
    consumed = list(raw)
    Listing.of(consumed, consume=True)
    assert consumed == []


def test_a_tree_is_copied_in_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More files than one copy job takes: every batch copied and journalled, progress
    counted across batches, one manifest at the end; a changed file alone re-copied."""
    from fastload.staging.tree import LocalTree

    monkeypatch.setattr(LocalTree, "batch", 7)
    src, dst = tmp_path / "src", tmp_path / "dst"
    trees.build_small_files(src, 50, per_dir=10)
    seen: list[tuple[int, int, int, int]] = []
    r = fastload.stage(src, dst, progress=lambda *a: seen.append(a))
    assert r.copied_files == 50 and r.files == 50
    total = sum(trees.regular_files(src).values())
    assert seen[-1] == (total, total, 50, 50)
    assert [s[2] for s in seen] == sorted(s[2] for s in seen)  # files done never go back
    trees.assert_same_tree(src, dst)
    victim = sorted(trees.regular_files(src))[33]
    (src / victim).write_bytes(b"new")
    assert fastload.stage(src, dst).copied_files == 1
    assert fastload.verify(dst).ok
    trees.assert_same_tree(src, dst)


def test_columns_cost_few_bytes_per_file() -> None:
    """A listing (made from the walk's list of tuples, there before), the stage's done
    set and the manifest's table of 200,000 files stay within a fixed number of bytes
    per file (Python objects per file would be ~10x)."""
    n = 200_000
    entries = [(f"d{i // 1000:04d}/f{i:07d}.bin", 0, 512, 1, 0o644, 10**18 + i, "")
               for i in range(n)]  # fmt: skip
    tracemalloc.start()
    try:
        listing = Listing.of(entries)
        del entries
        done = Done(listing)
        for i in range(n):
            done.set(i, (512, 10**18 + i, 0o644, i.to_bytes(8, "little")))
        table = done.table()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(table) == n and table.record(n - 1).digests == (n - 1).to_bytes(8, "little").hex()
    assert table.find("d0199/f0199999.bin") == n - 1 and table.find("d0199/f0200000.bin") == -1
    assert peak / n < 200, f"{peak / n:.0f} bytes per file"


def test_a_batch_set_as_listed_equals_records_set_one_by_one() -> None:
    """Done.set_listed (the tree copy's batches) leaves the same done set and table as
    set() of each file's listed size, time and mode: over rows of an earlier table, rows
    set twice (the last wins) and rows set with other metadata before."""
    entries = [(f"d/f{i:03d}", 0, 100 + i, 1, 0o644, 10**18 + i, "") for i in range(40)]
    listing = Listing.of(entries)
    base = Done(listing)
    for i in range(0, 40, 3):
        base.set(i, (100 + i, 10**18 + i, 0o644, b"\0" * 8))
    old = base.table()
    rows = old.matches(listing.path_bytes())
    one, batch = Done(listing, old, rows), Done(listing, old, rows)
    for d in (one, batch):
        d.set(5, (1, 2, 0o600, b"\7" * 8))  # other metadata first: the listed one replaces it
    order = [5, 7, 0, 9, 7, 39, 3]
    digs = [bytes([k]) * 8 for k in range(len(order))]
    for i, dg in zip(order, digs, strict=True):
        one.set(i, (100 + i, 10**18 + i, 0o644, dg))
    batch.set_listed(order, digs)
    assert len(batch) == len(one) and batch.total_bytes == one.total_bytes
    assert dict(batch.items()) == dict(one.items())
    assert batch[listing.path(7)].digests == digs[4].hex()  # the last of two wins
    assert batch[listing.path(5)] == Record(105, 10**18 + 5, 0o644, digs[0].hex())
    a, b = batch.table(), one.table()
    assert list(a.path_bytes()) == list(b.path_bytes())
    assert [a.record(i) for i in range(len(a))] == [b.record(i) for i in range(len(b))]


def test_records_set_from_many_threads_keep_their_own_digests() -> None:
    """The fan-out writers finish files on 8 threads, each calling Done.set: every file
    keeps its own digests (unlocked, two files took one place, and about 1 in 200 the
    other's digests: verify() then failed a correct copy, as in CI)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch between any two bytecodes
    n, threads = 20_000, 8
    listing = Listing.of([(f"f{i:06d}", 0, 8, 1, 0o644, 1, "") for i in range(n)])
    done = Done(listing)

    def work(k: int) -> None:
        for i in range(k, n, threads):
            if i % 3:
                done.set(i, Record(8, 1, 0o644, i.to_bytes(8, "little").hex()))
            else:
                done.set_listed([i], [i.to_bytes(8, "little")])

    try:
        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(old)
    table = done.table()
    assert len(table) == n
    wrong = [p for i, p in enumerate(table) if table.digest(i) != int(p[1:]).to_bytes(8, "little")]
    assert wrong == []


def test_sorted_is_known_for_a_walk_and_checked_otherwise(tmp_path: Path) -> None:
    """A walk's listing (and its files or folders alone) is sorted without a pass over the
    paths; a listing made from entries out of order is found unsorted, and its files'
    table is sorted by Done.table."""
    from fastload import _core

    trees.build_small_files(tmp_path / "t", 30)
    walked = Listing.from_walk(_core.walk_columns(str(tmp_path / "t"), [], [], False, 4))
    assert walked._sorted is True and walked.is_sorted()
    files = walked.of_kind(0)
    assert files._sorted is True and len(files) == 30
    listed = Listing.of([("b", 0, 1, 1, 0o644, 1, ""), ("a", 0, 2, 1, 0o644, 2, "")])
    assert listed._sorted is None and not listed.is_sorted() and listed._sorted is False
    done = Done(listed)
    done.set_listed([0, 1], [b"\1" * 8, b"\2" * 8])
    table = done.table()
    assert [bytes(p) for p in table.path_bytes()] == [b"a", b"b"]
    assert table.record(0) == Record(2, 2, 0o644, (b"\2" * 8).hex())
