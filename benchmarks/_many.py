"""Trees of millions of tiny files for test_bench_many.py (issue 38), and the child
process each measured step runs in, so its peak RSS (``ru_maxrss``) is its own.

``python _many.py stage|verify SRC DST`` runs one fastload step and prints one JSON line:
``{"seconds": ..., "cpu_seconds": ..., "maxrss_kib": ..., "files": ...}`` (CPU: the
process's, its start included). With ``FASTLOAD_MANY_PHASES=1`` the
line also has ``phases``: for each step of a stage (listing, planning, copying, the
manifest's table, the commit), the peak RSS (KiB) within it (``VmHWM``, reset through
``/proc/self/clear_refs`` as it begins) and the RSS after it, in the order they ran: where
the memory per file is held.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _watch_phases(out: list[tuple[str, int, int]]) -> None:
    """Wraps the steps of a stage (none of them calls another) so each records its name,
    its peak RSS and the RSS after it in ``out``."""
    from fastload.staging import destination, done, tree

    def wrap(owner: Any, name: str, label: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kw: Any) -> Any:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            try:
                return fn(*args, **kw)
            finally:
                out.append((label, _status_kib("VmHWM"), _status_kib("VmRSS")))

        setattr(owner, name, timed)

    for owner, name, label in (
        (tree.LocalTree, "listing", "listing"),
        (tree.LocalTree, "_plan", "planning"),
        (destination.Destination, "drop_stale", "drop stale"),
        (tree.LocalTree, "transfer", "copy (a batch)"),
        (tree.LocalTree, "finish", "links, dir times"),
        (done.Done, "table", "manifest table"),
        (destination.Destination, "commit", "commit"),
    ):
        wrap(owner, name, label)


def measure(step: str, src: str, dst: str) -> dict[str, Any]:
    import fastload

    phases: list[tuple[str, int, int]] = []
    if os.environ.get("FASTLOAD_MANY_PHASES") == "1":
        _watch_phases(phases)

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
    use = resource.getrusage(resource.RUSAGE_SELF)  # every thread's CPU, since start
    out: dict[str, Any] = {"seconds": seconds, "cpu_seconds": use.ru_utime + use.ru_stime,
                           "maxrss_kib": use.ru_maxrss, "files": files}  # fmt: skip
    if phases:
        out["phases"] = phases
    return out


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2], sys.argv[3])))
