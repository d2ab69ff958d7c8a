"""The README's picture of fastload.monitor: two short runs traced, drawn as timelines
in one SVG (no plotting library needed).

- healthy: 2 workers, a cheap transform, a 20 ms step: the loop hardly waits;
- stalled: the same with a 6 ms-per-sample transform: the workers cannot keep up, the
  loop waits (red), and the summary names the transform.

Usage: python scripts/monitor_picture.py [OUT.svg]  (default docs/monitor.svg)
"""

from __future__ import annotations

import html
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

import fastload

STEPS = 24
COLORS = {"wait for batch": "#d62728", "step": "#2ca02c", "read": "#1f77b4",
          "transform": "#ff7f0e", "collate": "#9467bd"}  # fmt: skip


def cheap(sample: Any) -> Any:
    return sample


def slow(sample: Any) -> Any:
    time.sleep(0.006)
    return sample


def keep(batch: Any) -> Any:
    return batch


def traced(index: Path, transform: Any, trace: Path) -> tuple[list[dict[str, Any]], str]:
    ds = fastload.ShardIndexDataset(index, transform=transform)
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=keep, shuffle=True)
    m = fastload.monitor(loader, trace=trace, trace_steps=STEPS)
    for i, _ in enumerate(m):
        time.sleep(0.020)
        if i + 1 == STEPS:
            break
    line = m.summary()
    m.close()
    return json.loads(trace.read_text())["traceEvents"], line


def lanes(events: list[dict[str, Any]]) -> tuple[dict[str, list[tuple[str, float, float]]], float]:
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}  # fmt: skip
    out: dict[str, list[tuple[str, float, float]]] = {}
    spans = [e for e in events if e["ph"] == "X" and e["name"] in COLORS]
    t0 = min(e["ts"] for e in spans)
    for e in spans:
        lane = "loop" if names.get(e["pid"]) == "main process" else names.get(e["pid"], "?")
        out.setdefault(lane, []).append((e["name"], e["ts"] - t0, e["dur"]))
    return out, max(ts + d for spans_ in out.values() for _, ts, d in spans_)


def draw(runs: list[tuple[str, list[dict[str, Any]], str]], out: Path) -> None:
    width, left, lane_h, gap = 900, 90, 18, 6
    parts: list[str] = []
    y = 10
    scale_end = max(lanes(ev)[1] for _, ev, _ in runs)
    px = (width - left - 10) / scale_end
    for title, events, line in runs:
        parts.append(f'<text x="4" y="{y + 12}" font-weight="bold">{html.escape(title)}</text>')
        parts.append(f'<text x="{left}" y="{y + 12}" font-size="11">{html.escape(line)}</text>')
        y += 20
        by_lane, _ = lanes(events)
        for lane in ["loop", *sorted(k for k in by_lane if k != "loop")]:
            parts.append(f'<text x="4" y="{y + 13}" font-size="11">{html.escape(lane)}</text>')
            for name, ts, dur in by_lane.get(lane, []):
                parts.append(
                    f'<rect x="{left + ts * px:.1f}" y="{y}" width="{max(dur * px, 0.5):.1f}" '
                    f'height="{lane_h}" fill="{COLORS[name]}"><title>{name}</title></rect>'
                )
            y += lane_h + gap
        y += 12
    x = left
    for name, color in COLORS.items():
        parts.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{color}"/>')
        parts.append(f'<text x="{x + 14}" y="{y + 10}" font-size="11">{name}</text>')
        x += 130
    parts.append(f'<text x="{left}" y="{y + 28}" font-size="11">time: {scale_end / 1e3:.0f} ms '
                 "across; rows: the training loop, then each DataLoader worker</text>")
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 40}" '
           f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>'
           + "".join(parts) + "</svg>\n")  # fmt: skip
    out.write_text(svg)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/monitor.svg")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        samples = ({"__key__": f"s{i:05d}", "bin": bytes([i % 256]) * 3000} for i in range(2000))
        fastload.pack(samples, root / "shards", pattern="train-{:04d}.tar", max_count=500)
        index = root / "shards" / "index.fidx"
        runs = []
        for title, transform in (("healthy", cheap), ("stalled", slow)):
            events, line = traced(index, transform, root / f"{title}.json")
            runs.append((title, events, line))
            print(f"{title}: {line}")
        draw(runs, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
