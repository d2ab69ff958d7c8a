"""A stage() call's options, checked once (:class:`StageRequest`), and the interface every
kind of source implements (:class:`Source`)."""

from __future__ import annotations

import dataclasses
import errno
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .._util import parse_checksum
from ..errors import stage_error
from .job import DEFAULT_STRIPE, Patterns, Progress

if TYPE_CHECKING:
    from .destination import Destination
    from .result import StageResult


def patterns(p: Patterns) -> tuple[str, ...]:
    if p is None:
        return ()
    if isinstance(p, (str, os.PathLike)):
        return (os.fspath(p),)
    return tuple(os.fspath(x) for x in p)


@dataclasses.dataclass(frozen=True)
class StageRequest:
    """What stage() was asked, validated: everything but the source and the destination.
    Made by :meth:`make` (which raises ``ValueError`` naming a bad option)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    engine: str = "auto"
    progress: Progress = None
    workers: int | None = None
    stripe: int = DEFAULT_STRIPE
    on_special: Literal["error", "skip"] = "error"
    check_source: bool | Literal["strict"] = True
    unpack: bool | Literal["auto", "nested"] = "auto"
    checksum: tuple[str, str] | None = None
    sync: bool = False
    storage_options: Mapping[str, Any] | None = None
    fanout: Any = False
    allow_empty: bool = False
    stats: bool = False
    zip_options: Any = None  # zipformat.ZipLimits: a zip's limits and names' code page
    t0: float = dataclasses.field(default_factory=time.monotonic)

    @classmethod
    def make(
        cls,
        *,
        include: Patterns = None,
        exclude: Patterns = None,
        checksum: str | None = None,
        stripe_size: int | None = None,
        **kw: Any,
    ) -> StageRequest:
        unpack = kw.get("unpack", "auto")
        if unpack not in (True, False, "auto", "nested"):
            raise ValueError(f"unpack must be True, False, 'auto' or 'nested', not {unpack!r}")
        on_special = kw.get("on_special", "error")
        if on_special not in ("error", "skip"):
            raise ValueError(f"on_special must be 'error' or 'skip', not {on_special!r}")
        if kw.get("check_source", True) not in (True, False, "strict"):
            raise ValueError(
                f"check_source must be True, False or 'strict', not {kw['check_source']!r}"
            )
        if kw.get("zip_options") is not None:
            from .zipformat import ZipLimits

            kw["zip_options"] = ZipLimits.of(kw["zip_options"])
        stripe = int(stripe_size or DEFAULT_STRIPE)
        if not 4096 <= stripe <= 1 << 30 or stripe % 4096:
            raise ValueError(
                f"stripe_size must be a multiple of 4096 between 4 KiB and 1 GiB, not {stripe}"
            )
        return cls(
            include=patterns(include),
            exclude=patterns(exclude),
            checksum=parse_checksum(checksum),
            stripe=stripe,
            **kw,
        )

    @property
    def nested(self) -> bool:
        return self.unpack == "nested"

    @property
    def unpack_option(self) -> bool | str:
        """How an archive source records ``unpack`` in its manifest options."""
        return "nested" if self.nested else True

    def nothing_selected(self, where: str) -> OSError:
        """The error for a selection that takes nothing from ``where`` (as GNU tar's
        "Not found in archive"); ``allow_empty`` makes it a stage of nothing."""
        what = (
            "the include pattern" + ("s " if len(self.include) > 1 else " ")
            + ", ".join(repr(p) for p in self.include) + " matched nothing"
            if self.include
            else "everything is excluded"
        )
        return stage_error(
            errno.ENOENT,
            f"{what} in '{where}'; pass allow_empty=True (--allow-empty) to stage nothing",
            where,
        )

    def selection(self) -> dict[str, Any]:
        """The subset options every source records in its manifest."""
        return {"include": list(self.include), "exclude": list(self.exclude)}


class Source(Protocol):
    """Where a stage's bytes come from: a local tree or file (tree.LocalTree), a prefix or
    object of a store (remote.ObjectPrefix), an archive extracted as it is read
    (archive.Archive: a local file, an object, a stream). stage() opens the destination,
    takes its lock and calls :meth:`run`; fan-out (fanout/) plans with the same source."""

    name: str
    """The source as the manifest records it (an absolute path or a URL)."""
    options: dict[str, Any]
    """The options that make two stages of this source the same request (in the manifest)."""
    label: str
    """A short name for progress bars."""

    def run(self, req: StageRequest, dest: Destination, listing: Any = None) -> StageResult:
        """Stages into ``dest`` under its lock (held by the caller); ``listing``: what a
        fan-out's node 0 listed, to use instead of listing again."""
        ...


def is_stream(src: object) -> bool:
    """Whether stage()'s ``src`` is a stream: ``"-"`` (stdin), a file descriptor, or a
    binary file object."""
    return (
        (isinstance(src, str) and src == "-")
        or (isinstance(src, int) and not isinstance(src, bool))
        or callable(getattr(src, "readinto", None))
        or callable(getattr(src, "read", None))
    )
