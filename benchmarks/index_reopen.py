"""What a remote reader's shard change costs on a large index (issue 55): before, the
reader reopened its index each time it let go of a pinned shard (``ShardIndex.open``:
one mmap and a checksum of every table, a full pass over the index); now it drops the
index's mapping of that shard only (``forget_shard``).

Makes an index of ``--samples`` samples (one empty member each, in ``--shards`` ustar
shards written with numpy: only headers, 512 bytes a sample), then times both, each
``--rounds`` times, the index in the page cache (as it is for a reader).

    python benchmarks/index_reopen.py --dir D [--samples 10000000] [--shards 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from fastload import ShardIndex, _core

_CHUNK = 250_000


def _headers(first: int, n: int) -> np.ndarray:
    """``n`` ustar headers of empty members ``s<first+i>.c`` (12-char names)."""
    h = np.zeros((n, 512), dtype=np.uint8)
    ids = np.arange(first, first + n, dtype=np.int64)
    h[:, 0] = ord("s")
    for d in range(10):  # ten decimal digits
        h[:, 10 - d] = ord("0") + (ids // 10**d) % 10
    h[:, 11:13] = np.frombuffer(b".c", dtype=np.uint8)
    for at, text in ((100, b"0000644\0"), (108, b"0000000\0"), (116, b"0000000\0"),
                     (124, b"00000000000\0"), (136, b"14000000000\0"), (156, b"0"),
                     (257, b"ustar\x0000")):  # fmt: skip
        h[:, at:at + len(text)] = np.frombuffer(text, dtype=np.uint8)
    h[:, 148:156] = ord(" ")
    total = h.sum(axis=1, dtype=np.int64)
    for d in range(6):  # six octal digits, NUL, space
        h[:, 153 - d] = ord("0") + (total >> (3 * d)) % 8
    h[:, 154] = 0
    return h


def make_index(folder: Path, samples: int, shards: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    index = folder / "index.fidx"
    if index.exists():
        return index
    per = -(-samples // shards)
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:04d}.tar"
        with open(path, "wb") as f:
            for at in range(s * per, min(samples, (s + 1) * per), _CHUNK):
                f.write(_headers(at, min(_CHUNK, min(samples, (s + 1) * per) - at)).tobytes())
            f.write(bytes(1024))
        paths.append(path)
    _core.build_index([os.fspath(p) for p in paths], [p.name for p in paths],
                      os.fspath(index), "error", 0)
    for p in paths:  # the shards are not read again: keep only their sizes' worth of index
        p.unlink()
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--shards", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    path = make_index(args.dir, args.samples, args.shards)
    ShardIndex.open(path, check=False)  # in the page cache
    reopen, forget = [], []
    ix = ShardIndex.open(path, check=False)
    for r in range(args.rounds):
        t = time.perf_counter()
        ShardIndex.open(path, check=False)
        reopen.append(time.perf_counter() - t)
        t = time.perf_counter()
        ix._native.forget_shard(r % args.shards)
        forget.append(time.perf_counter() - t)
    size = path.stat().st_size
    print(f"index: {len(ix):,} samples, {size / 2**20:.0f} MiB")
    print(f"reopen per shard change (before): median {statistics.median(reopen) * 1e3:.1f} ms")
    print(f"forget_shard per shard change (after): median {statistics.median(forget) * 1e6:.1f} us")
    print(f"ratio: {statistics.median(reopen) / statistics.median(forget):,.0f}x")


if __name__ == "__main__":
    main()
