"""Turns a pytest-benchmark JSON file into the Markdown tables of benchmarks/RESULTS.md.

    pytest benchmarks --bench-scale full --benchmark-json=bench.json
    python benchmarks/report.py bench.json [more.json ...] > benchmarks/RESULTS.md
    python benchmarks/report.py --combine median pass1.json pass2.json pass3.json

With ``--combine median``, the files are passes of the same cases run one after the
other (rounds interleaved across tools on a shared machine): each case's figure is the
median over the passes of its statistic, and its rounds are summed.

One table per group: each tool's time, throughput (from the ``bytes`` and ``files`` in
``extra_info``), and, for each fastload variant, the ratio to every peer in the group:
fastload time / peer time (below 1 is better) and the speed-up (peer time / fastload time).
Where a case records the payload it delivered (``payload_bytes``: the handover groups), a
"payload GB/s" column shows it per second of the same statistic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

STATS = ("median", "min", "mean")


def _is_fastload(tool: str) -> bool:
    return tool.lower().startswith("fastload")


def _fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _fmt_gbps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _row_for(b: dict[str, Any], stat: str) -> dict[str, Any]:
    info = b.get("extra_info", {})
    seconds = float(b["stats"][stat])
    nbytes, files = info.get("bytes"), info.get("files")
    return {
        "tool": str(info.get("tool") or b["name"]),
        "name": b["name"],
        "seconds": seconds,
        "rounds": b["stats"].get("rounds"),
        "mbps": nbytes / seconds / 1e6 if nbytes and seconds > 0 else None,
        "files_s": files / seconds if files and files > 1 and seconds > 0 else None,
        "payload_gbps": (
            info["payload_bytes"] / seconds / 1e9
            if info.get("payload_bytes") and seconds > 0
            else None
        ),
        "engine": info.get("engine"),
        "bytes": nbytes,
        "files": files,
    }


def group_rows(data: dict[str, Any], stat: str) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for b in data.get("benchmarks", []):
        groups[b.get("group") or "(no group)"].append(_row_for(b, stat))
    for rows in groups.values():
        rows.sort(key=lambda r: r["seconds"])
    return dict(sorted(groups.items()))


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def render_group(name: str, rows: list[dict[str, Any]], stat: str) -> list[str]:
    first = rows[0]
    size = ""
    if first["bytes"]:
        size = f" — {first['files']:,} file(s), {first['bytes'] / 2**20:,.1f} MiB"
    lines = [f"### {name}{size}", ""]
    payload = any(r["payload_gbps"] is not None for r in rows)
    lines += _table(
        [
            "tool",
            f"{stat} time",
            "MB/s",
            "files/s",
            *(["payload GB/s"] if payload else []),
            "rounds",
        ],
        (
            [
                f"**{r['tool']}**" if _is_fastload(r["tool"]) else r["tool"],
                _fmt_seconds(r["seconds"]),
                _fmt_rate(r["mbps"]),
                _fmt_rate(r["files_s"]),
                *([_fmt_gbps(r["payload_gbps"])] if payload else []),
                str(r["rounds"] or "-"),
            ]
            for r in rows
        ),
    )
    ours = [r for r in rows if _is_fastload(r["tool"])]
    peers = [r for r in rows if not _is_fastload(r["tool"])]
    if ours and peers:
        lines += ["", "fastload time / peer time (speed-up):", ""]
        lines += _table(
            ["", *[p["tool"] for p in peers]],
            (
                [f"**{o['tool']}**"]
                + [
                    f"{o['seconds'] / p['seconds']:.2f} ({p['seconds'] / o['seconds']:.1f}x)"
                    for p in peers
                ]
                for o in ours
            ),
        )
    lines.append("")
    return lines


def render(data: dict[str, Any], stat: str = "median") -> str:
    mi = data.get("machine_info", {})
    cpu = mi.get("cpu", {})
    commit = data.get("commit_info", {})
    lines = ["## Results", ""]
    facts = [
        f"date {data.get('datetime', '?')}",
        f"CPU {cpu.get('brand_raw', mi.get('processor', '?'))} x{cpu.get('count', '?')}",
        f"{mi.get('system', '?')} {mi.get('release', '')}".strip(),
        f"Python {mi.get('python_version', '?')}",
    ]
    if commit.get("id"):
        facts.append(f"commit {str(commit['id'])[:10]}{' (dirty)' if commit.get('dirty') else ''}")
    scales = {b.get("extra_info", {}).get("scale") for b in data.get("benchmarks", [])} - {None}
    if scales:
        facts.append("scale " + ", ".join(sorted(scales)))
    syncs = {b.get("extra_info", {}).get("sync") for b in data.get("benchmarks", [])} - {None}
    if syncs == {True}:
        facts.append("copies timed until on disk (syncfs)")
    elif syncs == {False}:
        facts.append("copies timed without a final sync (page cache)")
    lines += ["; ".join(facts) + ".", ""]
    groups = group_rows(data, stat)
    if not groups:
        lines.append("No benchmarks in this file (was it written with --benchmark-disable?).")
    for name, rows in groups.items():
        lines += render_group(name, rows, stat)
    return "\n".join(lines).rstrip() + "\n"


def merge(files: list[dict[str, Any]], combine: str = "last") -> dict[str, Any]:
    """One run out of several JSON files (e.g. groups run separately): later files win
    for a benchmark of the same full name (``combine="last"``), or each statistic is the
    median over the files that hold it (``combine="median"``: passes of the same cases);
    machine and commit facts from the last."""
    merged: dict[str, Any] = dict(files[-1])
    by_name: dict[str, list[Any]] = defaultdict(list)
    for data in files:
        for b in data.get("benchmarks", []):
            by_name[b.get("fullname", b["name"])].append(b)
    out = []
    for runs in by_name.values():
        if combine == "last" or len(runs) == 1:
            out.append(runs[-1])
            continue
        b = dict(runs[-1])
        stats = dict(b["stats"])
        for stat in STATS:
            stats[stat] = statistics.median(float(r["stats"][stat]) for r in runs)
        stats["rounds"] = sum(int(r["stats"].get("rounds") or 0) for r in runs)
        b["stats"] = stats
        out.append(b)
    merged["benchmarks"] = out
    return merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("json", type=Path, nargs="+", help="file(s) written by pytest --benchmark-json")
    ap.add_argument("--stat", choices=STATS, default="median", help="statistic to compare")
    ap.add_argument(
        "--combine",
        choices=("last", "median"),
        default="last",
        help="a case in several files: the last file's figures, or the median over them",
    )
    args = ap.parse_args(argv)
    loaded = []
    for path in args.json:
        try:
            loaded.append(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            print(f"report.py: cannot read {path}: {e}", file=sys.stderr)
            return 2
    sys.stdout.write(render(merge(loaded, args.combine), args.stat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
