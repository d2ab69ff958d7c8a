"""Trees of millions of tiny files for test_bench_many.py (issue 38), and the child
process each measured step runs in, so its peak RSS (``ru_maxrss``) is its own.

``python _many.py stage|verify SRC DST`` runs one fastload step and prints one JSON line:
``{"seconds": ..., "maxrss_kib": ..., "files": ...}``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

FILE_BYTES = 512
PER_DIR = 1000


def build_tree(root: Path, n: int, file_bytes: int = FILE_BYTES, per_dir: int = PER_DIR) -> Path:
    """``n`` files of ``file_bytes`` bytes in folders of ``per_dir`` under ``root``
    (built once: a finished tree has a ``.done`` marker beside it)."""
    marker = root.with_name(root.name + ".done")
    if marker.exists():
        return root
    payload = bytes(range(256)) * (file_bytes // 256 + 1)
    for d in range(-(-n // per_dir)):
        folder = root / f"d{d:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        base = d * per_dir
        for i in range(min(per_dir, n - base)):
            k = base + i
            # Each file differs (its number first), so a digest mix-up would show.
            data = (b"%012d" % k + payload)[:file_bytes]
            fd = os.open(folder / f"f{k:09d}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
    marker.touch()
    return root


def measure(step: str, src: str, dst: str) -> dict[str, float]:
    import fastload

    t0 = time.monotonic()
    if step == "stage":
        files = fastload.stage(src, dst).files
    elif step == "verify":
        result = fastload.verify(dst)
        if not result.ok:
            raise SystemExit(f"verify of {dst} failed: {result}")
        files = result.files
    else:
        raise SystemExit(f"unknown step {step!r}: expected stage or verify")
    seconds = time.monotonic() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "maxrss_kib": rss, "files": files}


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], sys.argv[3])))
