"""The skips of a run, read from its JUnit XML files (pytest's ``--junitxml``, ctest's
``--output-junit``), printed with their reasons and checked against the allow-list
(tests/allowed-skips.txt): under ``CI=true`` a skip the list does not name fails the run,
so a green CI run cannot be one that left out what this machine kind has.

    python tests/kit/skips.py build/junit/*.xml          # print; exit 1 under CI on others

Stdlib only: scripts/test.sh runs it with any interpreter, after every pass.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path

ALLOWED = Path(__file__).resolve().parents[1] / "allowed-skips.txt"


@dataclasses.dataclass(frozen=True)
class Skip:
    test: str
    reason: str
    source: str
    """The XML file it was read from."""


@dataclasses.dataclass(frozen=True)
class Allowed:
    pattern: re.Pattern[str]
    why: str


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _reason(case: ET.Element, skipped: ET.Element) -> str:
    message = skipped.get("message", "")
    if message == "collection skipped":
        # A module-level skip: pytest's text is the repr of (path, line, "Skipped: why").
        text = (skipped.text or "").strip()
        try:
            _, _, why = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError):
            return text
        return str(why).removeprefix("Skipped: ")
    if message.startswith("SKIP_RETURN_CODE="):
        # ctest: the native test exited 77 (the kernel lacks a feature it needs).
        return f"native test {case.get('name')} exited {message.split('=', 1)[1]} (skipped)"
    return message.removeprefix("Skipped: ")


def read(paths: Iterable[Path]) -> list[Skip]:
    out: list[Skip] = []
    for path in paths:
        root = ET.parse(path).getroot()
        for case in root.iter("testcase"):
            for skipped in case.findall("skipped"):
                if skipped.get("type") == "pytest.xfail":
                    continue
                test = "::".join(p for p in (case.get("classname"), case.get("name")) if p)
                out.append(Skip(test, _reason(case, skipped), str(path)))
    return out


def load_allowed(path: Path = ALLOWED) -> list[Allowed]:
    """Each pattern line must follow a comment saying why that skip is allowed."""
    out: list[Allowed] = []
    why: list[str] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            why = []
        elif line.startswith("#"):
            why.append(line.lstrip("#").strip())
        else:
            if not why:
                raise ValueError(f"{path}:{n}: {line!r} has no comment above it saying why")
            out.append(Allowed(re.compile(line), " ".join(why)))
    return out


def unexpected(skips: Sequence[Skip], allowed: Sequence[Allowed]) -> list[Skip]:
    return [s for s in skips if not any(a.pattern.search(s.reason) for a in allowed)]


def report(skips: Sequence[Skip], allowed: Sequence[Allowed], name: str = ALLOWED.name) -> str:
    by_reason: dict[str, list[Skip]] = {}
    for s in skips:
        by_reason.setdefault(s.reason, []).append(s)
    bad = {s.reason for s in unexpected(skips, allowed)}
    lines = [f"{len(skips)} skipped, {len(by_reason)} reasons"
             f"{f'; {len(bad)} not on {name}' if bad else ''}:"]  # fmt: skip
    for reason, group in sorted(by_reason.items(), key=lambda kv: (kv[0] not in bad, kv[0])):
        mark = "NOT ALLOWED " if reason in bad else ""
        lines.append(f"  {mark}{len(group):4d} x {reason}  (e.g. {group[0].test})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("xml", type=Path, nargs="+", help="JUnit XML files (missing ones fail)")
    ap.add_argument("--allowed", type=Path, default=ALLOWED)
    args = ap.parse_args(argv)
    absent = [p for p in args.xml if not p.exists()]
    if absent:
        print(f"skips: no report at {', '.join(map(str, absent))} (a pass did not run?)",
              file=sys.stderr)  # fmt: skip
        return 2
    skips = read(args.xml)
    allowed = load_allowed(args.allowed)
    print(report(skips, allowed, str(args.allowed)))
    bad = unexpected(skips, allowed)
    if bad and in_ci():
        print(f"skips: {len(bad)} skipped where this machine kind has what they need "
              f"(CI=true); make it available, or add a reasoned line to {args.allowed}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
