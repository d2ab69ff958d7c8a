"""ObjectList (issue 38): objects in columns read back as the ObjectInfo they were made
from, whatever the mix of ETags (an MD5's, kept as 16 raw bytes; others; none) and
versions; sorted, joined, selected and pickled without losing or reordering one."""

from __future__ import annotations

import pickle
import random

from fastload.sources.objlist import ObjectInfo, ObjectList, compact_identity


def _infos(n: int, seed: int, odd_every: int = 0, versions: bool = False) -> list[ObjectInfo]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        etag: str | None = f'"{rng.getrandbits(128):032x}"'
        if odd_every and i % odd_every == odd_every - 1:
            etag = None if i % 2 else f'"{rng.getrandbits(64):x}-3"'
        odd = "\udcff" if i % 7 == 0 else ""  # a byte that is not UTF-8
        key = f"d{rng.randrange(5)}/k é {rng.getrandbits(30):09d}{odd}"
        version = f"v{i}" if versions and i % 3 else None
        out.append(ObjectInfo(key, rng.randrange(1 << 40), etag, rng.getrandbits(60), version))
    return out


def test_read_back_as_made() -> None:
    for odd, versions in ((0, False), (5, False), (0, True), (4, True)):
        infos = _infos(300, seed=odd, odd_every=odd, versions=versions)
        objs = ObjectList.of(infos)
        assert list(objs) == infos
        assert (objs.etag_ends is None) == (odd == 0)  # MD5s alone: 16 bytes each
        for i, o in enumerate(infos):
            assert objs.identity(i) == o.identity.encode("utf-8", "surrogateescape")
            assert objs.tag(i) == compact_identity(o.identity)
            if o.version is None and o.etag is not None and len(o.etag) == 34:
                assert objs.tag(i) == bytes.fromhex(o.etag[1:33])  # an MD5's: 16 bytes
        assert list(pickle.loads(pickle.dumps(objs))) == infos
        assert objs[-1] == infos[-1] and objs[3:6] == infos[3:6]


def test_sorted_joined_selected() -> None:
    infos = _infos(500, seed=9, odd_every=11, versions=True)

    def key(o: ObjectInfo) -> bytes:
        return o.key.encode("utf-8", "surrogateescape")

    want = sorted({key(o): o for o in reversed(infos)}.values(), key=key)
    assert list(ObjectList.of(infos).sorted()) == want  # a key twice: kept once
    # Folders' listings, each sorted, in order, and a few keys at the top among them.
    by_folder = [[o for o in want if o.key.startswith(f"d{d}/")] for d in range(5)]
    top = [ObjectInfo(k, 1, f'"{7:032x}"', 5) for k in ("a", "d1", "d3x", "z")]
    parts = [ObjectList.of(f) for f in by_folder]
    got = ObjectList.joined(ObjectList.of(top), parts)
    assert list(got) == sorted(want + top, key=key)
    assert parts == []  # each part let go of once appended
    keep = bytearray(i % 3 == 0 for i in range(len(got)))
    assert list(got.select(keep)) == [o for i, o in enumerate(got) if i % 3 == 0]
    assert got.select(bytearray(b"\1") * len(got)) is got


def test_placed_keys_keep_their_stored_names() -> None:
    """Keys placed under another name (a leading "/" dropped) sort by that name, and an
    ObjectInfo (what a GET uses) still has the key as stored; the mapping survives a
    pickle (fan-out sends the list)."""
    objs = ObjectList.of([ObjectInfo("/abs.txt", 3, '"%s"' % ("a" * 32), 1),
                          ObjectInfo("b.txt", 4, '"%s"' % ("b" * 32), 2)])  # fmt: skip
    placed = objs.placed({0: "abs.txt"})
    assert list(placed.key_bytes()) == [b"abs.txt", b"b.txt"]
    for got in (placed, pickle.loads(pickle.dumps(placed))):
        assert got[0].key == "/abs.txt" and got.stored_key(0) == "/abs.txt"
        assert got[1].key == "b.txt" and got.key_str(0) == "abs.txt"
    assert objs.placed({}) is objs
