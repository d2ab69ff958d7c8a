"""Fan-out of a zip (a :class:`~fastload.staging.zipsource.ZipSource`): node 0 reads the
central directory once and sends the listing with its members; every node plans its
destination against it; the members no node holds are dealt between the nodes in
contiguous runs of the archive balanced by their compressed bytes, and each node
extracts its run from the store with the zip pipeline (ranged reads, decoding on a
pool, the journal); then the extracted files are exchanged as a tree's are (tree.py:
each is read from the disk of the node that holds it), so the store serves the zip
about once in total."""

from __future__ import annotations

import contextlib
import dataclasses
from array import array
from typing import Any

from ..destination import Destination
from ..job import progress_callback
from ..result import StageResult
from .common import Bits
from .exchange import Exchange
from .tree import exchange, finish_plan, listed_and_planned


def deal_members(members: list[Any], rows: list[int], nodes: int) -> list[list[int]]:
    """``rows`` (of ``members``) in the archive's order, cut into ``nodes`` contiguous
    runs of about equal compressed bytes: node k's share. The same on every node."""
    rows = sorted(rows, key=lambda i: members[i].offset)
    total = sum(members[i].csize for i in rows)
    target = total / nodes
    shares: list[list[int]] = [[] for _ in range(nodes)]
    k, load = 0, 0
    for i in rows:
        size = members[i].csize
        if k < nodes - 1 and shares[k] and load + size / 2 > target * (k + 1):
            k += 1
        shares[k].append(i)
        load += size
    return shares


def _with(bits: Bits, rows: list[int], add: bool) -> Bits:
    got = int.from_bytes(bits.data, "little")
    mask = int.from_bytes(Bits.of(rows, bits.n).data, "little")
    got = got | mask if add else got & ~mask
    return Bits(got.to_bytes(len(bits.data), "little"), bits.n)


def fan_zip(x: Exchange, source: Any, dest: Destination, scope: str = "") -> StageResult:
    """``source`` (a zip) extracted on every node, the store read about once (under
    ``dest``'s lock; see the module's description). ``scope`` keeps its sync points
    apart from other stages' over the same exchange (a tree's inner zips)."""
    req = dest.req
    if req.checksum is not None and x.node == 0:
        source._check_checksum(req.checksum)  # the whole archive read once, by node 0
    run_req = dataclasses.replace(req, checksum=None)
    plan, need, have, round_bytes = listed_and_planned(x, source, dest, run_req,
                                                       source.shared_listing, scope)  # fmt: skip
    nfiles = len(plan.files)
    held = Bits.union(have, nfiles)
    unheld = [i for i in Bits.union(need, nfiles) if i not in held]
    shares = deal_members(source.members, unheld, x.nodes)
    for k, share in enumerate(shares):
        need[k] = _with(need[k], share, add=False)
        have[k] = _with(have[k], share, add=True)
    mine = shares[x.node]

    def extract_mine() -> tuple[int, int, int]:
        """This node's share, from the store, into its destination (journalled)."""
        files = bytes_ = 0
        if mine:
            total = sum(plan.files.size[i] for i in mine)
            on_progress, bar = progress_callback(req.progress, f"unzip {source.label}",
                                                 total, 0)  # fmt: skip
            report = _share_progress(on_progress, plan.done.total_bytes, len(plan.done),
                                     total, len(mine))  # fmt: skip
            flusher = dest.begin(plan.done)
            part = dataclasses.replace(plan, todo=array("q", sorted(mine)))
            try:
                _, files, bytes_ = source.transfer(run_req, dest, part, plan.done, flusher,
                                                   report)  # fmt: skip
                flusher.close()
            finally:
                with contextlib.suppress(Exception):
                    flusher.close()
                dest.journal.close()
                if bar is not None:
                    bar.close()
        x.sync(f"{scope}extracted")
        return files, bytes_, source.read_bytes

    try:
        return exchange(x, source, dest, plan, need, have, round_bytes,
                        before=extract_mine if any(shares) else None,
                        finish=lambda: finish_plan(dest, source, plan, run_req))  # fmt: skip
    finally:
        if not source.skip_inner:  # (zipnested.py reads the inner archives after)
            source.data.close()


def _share_progress(on_progress: Any, base_bytes: int, base_files: int, total: int,
                    count: int) -> Any:  # fmt: skip
    """The zip pipeline's progress (counted over the whole archive, from what was done
    before) as this node's share's."""
    if on_progress is None:
        return None

    def report(done: int, _total: int, files: int, _files_total: int) -> None:
        on_progress(done - base_bytes, total, files - base_files, count)

    return report
