"""Millions of tiny files (issue 38): fastload against ``cp -r`` on trees of 512-byte files
in folders of 1,000. Each step runs in its own child process (``_many.py``), so its peak
RSS is its own (``wait4``'s ``ru_maxrss``).

Reported per case (``extra_info``): the copy's time and files/s, the peak RSS of the
copying process, the re-stage of the unchanged tree (fastload) and the read-back:
``fastload.verify`` against ``find | xargs cat`` (the floor of reading every file).

Sizes: ``--bench-scale small`` (CI: a 2,000-file tree, so the file never rots; not in
the regression check's timed subset) or ``full``: 1M and 3M files, or the counts in
``FASTLOAD_BENCH_MANY`` (comma-separated, e.g. ``300000,1000000``). The trees are built
once under the repository's ignored ``build/bench-many/`` (``FASTLOAD_BENCH_MANY_DIR``
elsewhere); each needs about 4 KiB of disk per file for the source and as much per copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from _harness import Scale, remove_tree, settle_deletions, syncfs
from _many import build_tree

HERE = Path(__file__).resolve().parent
TIME = "/usr/bin/time"  # GNU time: the peak RSS of the command alone
WORK = Path(os.environ.get("FASTLOAD_BENCH_MANY_DIR") or HERE.parent / "build" / "bench-many")


def _counts(scale: str) -> list[int]:
    if scale == "small":
        return [2_000]
    env = os.environ.get("FASTLOAD_BENCH_MANY")
    return [int(c) for c in env.split(",")] if env else [1_000_000, 3_000_000]


def _child(cmd: list[str], **kw: Any) -> tuple[float, int, bytes]:
    """Runs ``cmd`` under ``/usr/bin/time``; its wall time, peak RSS in KiB and stdout.
    (Not the ``ru_maxrss`` of a child of this process: a forked child starts with this
    process's high-water mark, which exec keeps.) Raises if it fails."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as rec:
        t0 = time.monotonic()
        out = subprocess.run([TIME, "-f", "%M", "-o", rec.name, *cmd], check=True,
                             stdout=subprocess.PIPE, **kw).stdout  # fmt: skip
        seconds = time.monotonic() - t0
        rss = int(rec.read().split()[-1])
    return seconds, rss, out


def _fastload_step(step: str, src: Path, dst: Path) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    seconds, rss, out = _child([sys.executable, str(HERE / "_many.py"), step, str(src),
                                str(dst)], env=env)  # fmt: skip
    assert out.strip().startswith(b"{"), out
    return seconds, rss


def _base_rss() -> int:
    """Peak RSS (KiB) of a stage of 100 files: the fixed part (the interpreter, the copy
    engine's buffers), which the per-file cost is measured above."""
    src, dst = build_tree(WORK / "src-100", 100), WORK / "dst-base-100"
    remove_tree(dst)
    remove_tree(dst.parent / f".{dst.name}.fastload")
    return _fastload_step("stage", src, dst)[1]


def _count_files(root: Path) -> int:
    out = subprocess.run(["find", str(root), "-type", "f"], check=True, capture_output=True)
    return out.stdout.count(b"\n")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "files" in metafunc.fixturenames:
        metafunc.parametrize("files", _counts(metafunc.config.getoption("--bench-scale")))


@pytest.mark.parametrize("tool", ["fastload", "cp"])
def test_many_files(benchmark: Any, scale: Scale, tool: str, files: int) -> None:
    if not all(shutil.which(t) for t in ("find", "cp", "xargs", TIME)):
        pytest.fail(f"find, cp, xargs and {TIME} are needed (findutils, coreutils, time)")
    n = files
    src = build_tree(WORK / f"src-{n}", n)
    dst = WORK / f"dst-{tool}-{n}"
    remove_tree(dst)
    state = dst.parent / f".{dst.name}.fastload"
    remove_tree(state)
    if scale.name != "small":
        settle_deletions()  # ext4 without a journal: not within a minute of a big rm -r
    syncfs(WORK)
    info: dict[str, Any] = {"tool": tool, "files": n, "bytes": 512 * n, "scale": scale.name}
    result: dict[str, float] = {}

    def copy() -> None:
        if tool == "fastload":
            result["seconds"], result["rss"] = _fastload_step("stage", src, dst)
        else:
            result["seconds"], result["rss"], _ = _child(["cp", "-r", str(src), str(dst)])

    benchmark.group = f"many-{n}"
    benchmark.pedantic(copy, rounds=1, iterations=1, warmup_rounds=0)
    assert _count_files(dst) == n
    info["stage_s"] = round(result["seconds"], 2)
    info["files_per_s"] = round(n / result["seconds"])
    info["peak_rss_mib"] = round(result["rss"] / 1024, 1)
    if tool == "fastload":
        base = _base_rss()
        info["base_rss_mib"] = round(base / 1024, 1)
        info["bytes_per_file_above_base"] = round((result["rss"] - base) * 1024 / n)
        info["restage_s"], rss = _fastload_step("stage", src, dst)
        info["restage_rss_mib"] = round(rss / 1024, 1)
        info["verify_s"], rss = _fastload_step("verify", src, dst)
        info["verify_rss_mib"] = round(rss / 1024, 1)
    else:
        seconds, _, _ = _child(["sh", "-c", 'find "$1" -type f -print0 | xargs -0 cat >/dev/null',
                                "sh", str(dst)])  # fmt: skip
        info["verify_s"] = round(seconds, 2)  # find | xargs cat: reading every file back
    info = {k: round(v, 2) if isinstance(v, float) else v for k, v in info.items()}
    benchmark.extra_info.update(info)
    print(f"\nmany-files {info}")
    remove_tree(dst)
    remove_tree(state)
