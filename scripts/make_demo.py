"""Writes the demo dataset: an ImageNet-shaped tree of small files plus two large files.

    python scripts/make_demo.py OUT [--files 4000] [--large-mib 512]

Deterministic (seeded); sizes log-normal around 100 KB, like JPEGs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np


def make(out: Path, files: int, large_mib: int, classes: int = 40, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(100_000), 0.6, files), 2_000, 4_000_000).astype(int)
    pool = rng.integers(0, 256, int(sizes.max()) + 4096, dtype=np.uint8).tobytes()
    train = out / "train"
    for i, size in enumerate(sizes):
        d = train / f"n{i % classes:08d}"
        d.mkdir(parents=True, exist_ok=True)
        start = (i * 7919) % 4096
        (d / f"img_{i:07d}.JPEG").write_bytes(pool[start : start + int(size)])
    big = out / "features"
    big.mkdir(parents=True, exist_ok=True)
    block = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
    for k in range(2):
        with open(big / f"part-{k}.npy", "wb") as f:
            for j in range(max(1, large_mib // 8)):
                block[:8] = np.frombuffer(np.int64(k * 1_000_000 + j).tobytes(), dtype=np.uint8)
                f.write(block.tobytes())
    (out / "README.txt").write_text("fastload demo dataset\n")
    os.utime(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--files", type=int, default=4000)
    ap.add_argument("--large-mib", type=int, default=512)
    a = ap.parse_args()
    if (a.out / "README.txt").exists():
        print(f"{a.out}: demo dataset already there")
    else:
        make(a.out, a.files, a.large_mib)
        print(f"{a.out}: wrote {a.files} small files and 2 x {a.large_mib} MiB")
