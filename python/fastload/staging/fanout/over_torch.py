"""The exchange over torch.distributed: a gloo group of the leaders (TCP, no GPU needed),
the control plane in a TCPStore served by node 0. torch is imported only here."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any


class _Work:
    def __init__(self, work: Any) -> None:
        self._work = work

    def done(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self) -> None:
        self._work.wait()


class TorchTransport:
    """The leaders' gloo ``group`` (None: the default group) for :class:`Exchange`."""

    plane: int | None = 0  # node 0 serves the store
    lingers = False
    max_nap = 0.02  # gloo progresses on its own threads

    def __init__(self, dist: Any, group: Any, timeout: float) -> None:
        import torch

        self._torch, self._dist, self._group = torch, dist, group
        self.node = int(dist.get_rank(group))
        self.nodes = int(dist.get_world_size(group))
        self.lingers = self.node == 0  # it serves the store: it stays until they heard
        self._timeout = timeout
        self._store: Any = None
        self._beat: Any = None

    def _tensor(self, buf: memoryview) -> Any:
        return self._torch.frombuffer(buf, dtype=self._torch.uint8)

    def all_gather(self, send: memoryview, recv: memoryview) -> _Work:
        n = send.nbytes
        out = list(self._tensor(recv).view(self.nodes, n).unbind(0))
        work = self._dist.all_gather(out, self._tensor(send), group=self._group, async_op=True)
        return _Work(work)

    def broadcast(self, buf: memoryview) -> _Work:
        t = self._tensor(buf)
        return _Work(self._dist.broadcast(t, group_src=0, group=self._group, async_op=True))

    # --- the control plane: a TCPStore served by node 0 -------------------------

    def start(self, broadcast_object: Callable[[list[Any]], None]) -> None:
        dist = self._dist
        store_timeout = datetime.timedelta(seconds=max(5.0, min(self._timeout, 30.0)))
        if self.node == 0:
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            store = dist.TCPStore(
                host, 0, None, True, timeout=store_timeout, wait_for_workers=False
            )
            where: list[Any] = [(host, store.port)]
        else:
            where = [None]
        broadcast_object(where)
        host, port = where[0]
        if self.node != 0:
            store = dist.TCPStore(host, port, None, False, timeout=store_timeout)
        self._store = store
        # The heartbeat thread talks to the store over a connection of its own.
        self._beat = dist.TCPStore(host, port, None, False, timeout=store_timeout)

    def beat(self) -> None:
        self._beat.add(f"hb/{self.node}", 1)

    def say(self, status: str) -> None:
        self._store.set(f"st/{self.node}", status)

    def mark(self, name: str) -> None:
        self._store.set(f"sync/{name}/{self.node}", "1")

    def missing(self, name: str, nodes: set[int]) -> set[int]:
        return {i for i in nodes if not self._store.check([f"sync/{name}/{i}"])}

    def peers(self) -> tuple[dict[int, int], dict[int, str]]:
        beats = {i: int(self._store.add(f"hb/{i}", 0)) for i in range(self.nodes)}
        said = {}
        for i in range(self.nodes):
            if i != self.node and self._store.check([f"st/{i}"]):
                said[i] = self._store.get(f"st/{i}").decode("utf-8", "replace")
        return beats, said

    def next_round(self) -> None:
        self._store.add(f"rd/{self.node}", 1)

    def rounds(self) -> dict[int, int]:
        return {i: int(self._store.add(f"rd/{i}", 0)) for i in range(self.nodes) if i != self.node}

    def close(self, ok: bool) -> None:
        if ok:
            self._dist.destroy_process_group(self._group)


class TorchWorld:
    """Every process of the job, over torch.distributed's ``group`` (None: the default
    group, made here from torchrun's or SLURM's variables if ``created``)."""

    def __init__(self, dist: Any, group: Any, created: bool, timeout: float) -> None:
        self._dist, self._group, self._created = dist, group, created
        self._timeout = timeout
        self.size = int(dist.get_world_size(group))
        self.rank = int(dist.get_rank(group))

    def all_gather_object(self, obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.size
        self._dist.all_gather_object(everyone, obj, self._group)
        return everyone

    def barrier(self) -> None:
        self._dist.barrier(self._group)

    def leaders(self, order: list[int], member: bool) -> TorchTransport | None:
        """The group of the ranks ``order`` (a collective: every process calls it); its
        transport where this process is a ``member``."""
        dist, group = self._dist, self._group
        # Global ranks of the leaders (new_group wants ranks of the default group).
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in order]
        # The group's own timeout is the round timeout: work of unequal length happens
        # between rounds (Exchange.sync), so no process waits longer on a peer that is
        # gone.
        sub = dist.new_group(
            ranks, backend="gloo", timeout=datetime.timedelta(seconds=self._timeout)
        )
        return TorchTransport(dist, sub, self._timeout) if member else None

    def close(self) -> None:
        if self._created:
            self._dist.destroy_process_group()
