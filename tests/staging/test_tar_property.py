"""Property (issue 21): any list of members (names long or unicode, sizes 0 to a few
blocks, directories, symlinks, hard links, modes, times), written by Python's tarfile in
each format and by GNU tar, is extracted by fastload to the tree GNU tar extracts.

Kept to a few seconds: a modest number of examples, each written by six writers.
"""

from __future__ import annotations

import os
import random
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastload
from kit import tars

pytestmark = pytest.mark.native

_CHARS = [*"abcxyz019_-. ", "\u00e9", "\u65e5", "\u00df", "\U0001f642"]
COMPONENT = st.one_of(
    st.text(alphabet=st.sampled_from(_CHARS), min_size=1, max_size=30),
    st.integers(90, 200).map(lambda n: "L" * n),  # over ustar's 100-byte name field
).filter(lambda c: c not in (".", ".."))
KIND = st.sampled_from(["file", "file", "file", "dir", "symlink", "hardlink"])
SIZE = st.one_of(st.sampled_from([0, 1, 511, 512, 513, 1024, 1025]), st.integers(0, 5000))
MEMBER = st.tuples(
    KIND,
    st.lists(COMPONENT, min_size=1, max_size=3),
    SIZE,
    st.sampled_from([0o644, 0o600, 0o755, 0o700, 0o444]),
    st.integers(0, 2**33 - 1),  # past ustar's 8 GiB of seconds, within GNU's base-256
    st.integers(0, 1 << 30),
)


def build(root: Path, members: list[tuple[Any, ...]]) -> int:
    """Makes the members under ``root``; returns how many were made (a path that clashes
    with an earlier one is left out)."""
    root.mkdir()
    files: list[str] = []
    times: dict[str, int] = {}
    made = 0
    for kind, parts, size, mode, mtime, seed in members:
        rel = "/".join(parts)
        p = root / rel
        if os.path.lexists(p) or any(
            (root / q).is_symlink() or (os.path.lexists(root / q) and not (root / q).is_dir())
            for q in ("/".join(parts[:i]) for i in range(1, len(parts)))
        ):
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if kind == "dir":
            p.mkdir()
            p.chmod(mode | 0o700)
        elif kind == "symlink":
            target = files[seed % len(files)] if files and seed % 3 else "missing/target"
            os.symlink(os.path.relpath(target, os.path.dirname(rel) or "."), p)
            made += 1
            continue
        elif kind == "hardlink" and files:
            os.link(root / files[seed % len(files)], p)
        else:
            p.write_bytes(random.Random(seed).randbytes(size))
            p.chmod(mode)
            files.append(rel)
        times[rel] = mtime
        made += 1
    # Times last, deepest first (making entries changes their directories' times).
    for rel in sorted(times, key=lambda r: -r.count("/")):
        os.utime(root / rel, (times[rel], times[rel]))
    return made


def writers(src: Path, out: Path) -> list[Path]:
    """The archives of ``src`` each writer could make (ustar cannot hold every name or
    time: a writer that refuses is left out)."""
    made = []
    for name in tars.PY_FORMATS:
        a = out / f"py-{name}.tar"
        try:
            tars.py_create(src, a, name)
        except ValueError:
            continue  # "name too long", "timestamp out of range" (ustar)
        made.append(a)
    for fmt in ("gnu", "posix", "ustar"):
        a = out / f"gnu-{fmt}.tar"
        p = subprocess.run([tars.need_gnu_tar(), f"--format={fmt}", "--sort=name", "-C",
                            str(src), "-cf", str(a), "."], capture_output=True, check=False)
        if p.returncode == 0:
            made.append(a)
        else:
            assert fmt == "ustar", p.stderr  # gnu and posix hold every name and time
    return made


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(MEMBER, min_size=1, max_size=10))
def test_random_members_extract_as_gnu_tar_does(members: list[tuple[Any, ...]]) -> None:
    with tempfile.TemporaryDirectory(prefix="fastload-prop-") as tmp:
        base = Path(tmp)
        if not build(base / "src", members):
            return
        archives = writers(base / "src", base)
        assert len(archives) >= 4
        for a in archives:
            ref = tars.gnu_extract(a, base / f"{a.stem}-ref")
            fastload.stage(a, base / f"{a.stem}-ours")
            tars.assert_extracts_like_gnu_tar(a, ref, base / f"{a.stem}-ours")
