"""What ``fastload env`` prints: the environment, this process's place in the world,
the paths, each with whether it exists and how much room it has, what resolve() does
with data larger than ``tmpdir`` (``on_full``), and where it put the data it resolved
(the placements recorded under ``tmpdir``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .base import Environment
from .config import config_path
from .placement import placements
from .registry import detect, environments
from .world import world

__all__ = ["env_command", "report"]


def _free(path: Path) -> int | None:
    """Free bytes on the file system that holds ``path`` (or its nearest parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _path_info(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    return {"path": str(path), "exists": path.exists(), "free": _free(path)}


def report(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Everything ``fastload env`` shows, as plain data."""
    env_map: Mapping[str, str] = os.environ if environ is None else environ
    env: Environment = detect(env_map)
    cfg, explicit = config_path(env_map)
    forced = env_map.get("FASTLOAD_ENV") or env.config.get("environment")
    nodes: tuple[int, int] | None = None
    try:
        me = world(env_map)
        w: dict[str, Any] | str = {
            k: getattr(me, k) for k in ("rank", "world_size", "local_rank", "source")
        }
        nodes = (me.node, me.num_nodes)
    except ValueError as e:
        w = f"error: {e}"
    in_config = "cpus" in env.config.get("paths", {}) or "cpus" in env.config.get(
        "environments", {}
    ).get(env.name, {})
    cpus_from = (
        "FASTLOAD_CPUS" if env_map.get("FASTLOAD_CPUS")
        else "config" if in_config
        else "SLURM_CPUS_ON_NODE" if env_map.get("SLURM_CPUS_ON_NODE")
        else "affinity"
    )
    env_cfg = env.config.get("environments", {}).get(env.name, {})
    on_full_from = (
        "FASTLOAD_ON_FULL" if env_map.get("FASTLOAD_ON_FULL")
        else "config" if "on_full" in env.config.get("paths", {}) or "on_full" in env_cfg
        else "default"
    )
    try:
        placed = [p.as_dict() for p in placements(env.tmpdir)]
    except OSError:
        placed = []
    return {
        "environment": env.name,
        "chosen_by": "FASTLOAD_ENV" if env_map.get("FASTLOAD_ENV")
        else "config" if forced else "detection",
        "cluster": env.cluster,
        "node": {
            "hostname": env.hostname,
            "node_id": env_map.get("SLURM_NODEID"),
            "job_id": env_map.get("SLURM_JOB_ID"),
            # SLURM's name of this node (several may share a host in a test cluster).
            "name": env_map.get("SLURMD_NODENAME"),
            "node": None if nodes is None else nodes[0],
            "num_nodes": None if nodes is None else nodes[1],
        },
        "world": w,
        "tmpdir": _path_info(env.tmpdir),
        "cache": _path_info(env.cache),
        "scratch": _path_info(env.scratch),
        "dataset_roots": [_path_info(p) for p in env.dataset_roots],
        "cpus": env.cpus,
        "cpus_from": cpus_from,
        "user": env.user,
        "on_full": env.on_full,
        "on_full_from": on_full_from,
        "placements": placed,
        "config": {
            "path": str(env.config_path or cfg),
            "read": env.config_path is not None,
            "explicit": explicit,
        },
        "detectors": list(environments()),
    }


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{x:.1f} {unit}" if unit != "B" else f"{int(x)} B"
        x /= 1024
    return f"{n} B"  # pragma: no cover


def _line(info: Mapping[str, Any] | None) -> str:
    if info is None:
        return "(none)"
    state = f"{_human(info['free'])} free" if info["exists"] else "not there yet"
    return f"{info['path']}  ({state})"


# Where world() found the rank, as the variables (or the module) it read.
_WORLD_SOURCES = {
    "dist": "torch.distributed",
    "torchrun": "RANK and WORLD_SIZE",
    "slurm": "SLURM_PROCID and SLURM_NTASKS",
}


def format_report(r: Mapping[str, Any]) -> str:
    node = r["node"]
    where = node["hostname"]
    if node["name"] and node["name"] != node["hostname"]:
        where += f" ({node['name']})"
    where += f", node {node['node_id']}" if node["node_id"] else ""
    if node["job_id"]:
        where += f", job {node['job_id']}"
    if node["num_nodes"] and node["num_nodes"] > 1:
        where += f", {node['num_nodes']} nodes"
    w = r["world"]
    if isinstance(w, str):
        world_line = w
    elif w["source"] == "single":
        world_line = (
            "one process (rank 0 of 1): no torch.distributed, RANK/WORLD_SIZE or "
            "SLURM_PROCID/SLURM_NTASKS names other ranks"
        )
    else:
        world_line = (
            f"rank {w['rank']} of {w['world_size']}, local rank {w['local_rank']} "
            f"(from {_WORLD_SOURCES.get(w['source'], w['source'])})"
        )
    name = r["environment"]
    if r["cluster"] not in (None, name):
        name += f" ({r['cluster']})"
    roots = r["dataset_roots"]
    order = ", ".join(r["detectors"])
    lines = [
        f"environment    {name}   [by {r['chosen_by']}; tried in order: {order}]",
        f"node           {where}",
        f"world          {world_line}",
        f"cpus           {r['cpus']}   [{r['cpus_from']}]",
        f"tmpdir         {_line(r['tmpdir'])}",
        f"cache          {_line(r['cache'])}",
        f"scratch        {_line(r['scratch'])}",
        f"dataset roots  {_line(roots[0]) if roots else '(none)'}",
        *(f"               {_line(p)}" for p in roots[1:]),
        f"config         {r['config']['path']}  "
        f"({'read' if r['config']['read'] else 'not found'})",
        f"on full        {r['on_full']}   [{r['on_full_from']}]",
    ]
    placed = r.get("placements") or []
    lines += [
        f"{'placed' if i == 0 else '':15}{_placed(p)}" for i, p in enumerate(placed)
    ]
    return "\n".join(lines)


_WHERE = {"local": "staged to node-local disk", "in_place": "read in place",
          "cache": "in the cache"}  # fmt: skip


def _placed(p: Mapping[str, Any]) -> str:
    """A placement resolve() recorded, in a line: where the data is read from, and why."""
    how = _WHERE.get(p["where"], p["where"])
    room = f"{_human(p['needed'])} needed, {_human(p['free'])} free on node-local disk"
    if p["where"] == "local":
        return f"{p['target']}  ({how}: {room})"
    return f"{p['target']} -> {p['path']}  ({how}: {room}; {p['source']})"


def env_command(as_json: bool = False) -> int:
    """``fastload env``: prints the report; returns the exit status."""
    r = report()
    print(json.dumps(r, indent=2) if as_json else format_report(r))
    return 0
