"""A mix described in a TOML file (``fastload mix plan FILE.toml``), and its epoch plan as
text or JSON.

The file::

    seed = 0                    # optional, as for Mix: samples_per_epoch, batching,
    samples_per_epoch = 1000    # batch_size, drop_last, shuffle, shuffle_block,
    world_size = 2              # cache_dir, cache_limit; world_size and num_workers
    num_workers = 3             # (default 1 and 0) are the plan's readers

    [[streams]]
    name = "web"
    source = "web/index.fidx"   # a path relative to the file, a glob, or an s3:// URL
    proportion = 0.7            # or choose = N, or repeat = X
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..env.config import read_toml
from .mix import Stream
from .mixed import Mix

__all__ = ["format_plan", "load_mix", "plan_of"]

_MIX_KEYS = {"seed", "samples_per_epoch", "batching", "batch_size", "drop_last", "shuffle",
             "shuffle_block", "cache_dir", "cache_limit"}  # fmt: skip
_READERS = {"world_size", "num_workers"}
_STREAM_KEYS = {"name", "source", "proportion", "choose", "repeat"}


def load_mix(path: str | os.PathLike[str]) -> tuple[Mix, int, int]:
    """The Mix a TOML file describes, and its ``world_size`` and ``num_workers``."""
    p = Path(path)
    conf = read_toml(p)
    unknown = set(conf) - _MIX_KEYS - _READERS - {"streams"}
    if unknown:
        raise ValueError(f"{p}: unknown key {sorted(unknown)[0]!r} (known: "
                         f"{', '.join(sorted(_MIX_KEYS | _READERS | {'streams'}))})")  # fmt: skip
    raw = conf.get("streams")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{p}: no [[streams]] (each with a source)")
    streams = []
    for i, s in enumerate(raw):
        bad = set(s) - _STREAM_KEYS
        if bad or "source" not in s:
            what = f"unknown key {sorted(bad)[0]!r}" if bad else "no source"
            raise ValueError(f"{p}: stream {i + 1}: {what}")
        source = str(s["source"])
        if "://" not in source and not os.path.isabs(source):
            source = str(p.parent / source)
        streams.append(Stream(source, proportion=s.get("proportion"), choose=s.get("choose"),
                              repeat=s.get("repeat"), name=s.get("name")))  # fmt: skip
    kw = {k: v for k, v in conf.items() if k in _MIX_KEYS}
    world_size, workers = conf.get("world_size", 1), conf.get("num_workers", 0)
    for key, v, low in (("world_size", world_size, 1), ("num_workers", workers, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{p}: {key} must be an integer >= {low}, not {v!r}")
    return Mix(streams, **kw), world_size, workers


def plan_of(ds: Mix, world_size: int, num_workers: int) -> dict[str, Any]:
    """The next epoch's plan: samples per stream in all, per rank and per worker."""
    layout = ds.layout(world_size, num_workers)
    ranks = []
    for row in layout:
        total = {n: sum(w[n] for w in row) for n in ds.names}
        ranks.append({"streams": total, "workers": row})
    return {"epoch": ds.epoch, "batching": ds.batching, "batch_size": ds.batch_size,
            "world_size": world_size, "num_workers": num_workers, "streams": ds.takes,
            "ranks": ranks}  # fmt: skip


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a table."""
    takes: dict[str, int] = plan["streams"]
    total = sum(takes.values())
    width = max(len(n) for n in takes) + 2
    batches = f", batches of {plan['batch_size']}" if plan["batch_size"] else ""
    lines = [
        f"epoch {plan['epoch']}: {total} samples ({plan['batching']}{batches}), "
        f"{plan['world_size']} ranks x {max(1, plan['num_workers'])} readers each",
        f"{'stream':<{width}}{'samples':>10}{'share':>9}",
    ]
    for n, t in takes.items():
        lines.append(f"{n:<{width}}{t:>10}{100 * t / max(1, total):>8.1f}%")
    for r, rank in enumerate(plan["ranks"]):
        lines.append(f"rank {r}: " + _row(rank["streams"]))
        for w, counts in enumerate(rank["workers"]):
            lines.append(f"  worker {w}: " + _row(counts))
    return "\n".join(lines)


def _row(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {c}" for n, c in counts.items()) + f" ({sum(counts.values())})"
