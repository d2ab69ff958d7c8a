"""fastload's exceptions.

They subclass the built-in exceptions a caller would catch anyway: a missing source is a
``FileNotFoundError`` (and a :class:`StageError`), a full disk an ``OSError`` with
``errno.ENOSPC``, a malformed archive a ``ValueError``. Native errors are turned into these
once, at the boundary, by :func:`from_native`, keeping errno, operation and path.
"""

from __future__ import annotations

import errno as _errno
import sys
from typing import Any

__all__ = [
    "ChecksumMismatchError",
    "FastloadError",
    "IndexFormatError",
    "NotEnoughSpaceError",
    "SourceChangedError",
    "StageError",
    "TarFormatError",
    "UnsafeArchiveError",
    "UnsupportedFileError",
    "from_native",
]


class FastloadError(Exception):
    """Base class of every error fastload raises on purpose."""


class StageError(OSError, FastloadError):
    """Staging failed on a path; ``errno`` and ``filename`` say why and where."""

    def __str__(self) -> str:
        if len(self.args) >= 2 and isinstance(self.args[1], str):
            return self.args[1]
        return super().__str__()

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by its class's name (not the one stage_error() combines with a
        # built-in, made at run time), so that an error raised in a DataLoader worker, a
        # pool process or a stager serving readers reaches the caller as itself: one of
        # this module's, or of the module that raises it (ZipFormatError, FanoutError).
        base = next(c for c in type(self).__mro__ if _named(c) and c not in _combined.values())
        return (_rebuilt, (base, self.errno, str(self), self.filename), self.__dict__ or None)


def _named(cls: type) -> bool:
    """Whether ``cls`` is a StageError found again by its module and name (unpickled)."""
    module = sys.modules.get(cls.__module__)
    return issubclass(cls, StageError) and getattr(module, cls.__qualname__, None) is cls


class NotEnoughSpaceError(StageError):
    """The destination's file system has less free space than the data needs."""

    def __init__(self, message: str, *, path: str, needed: int, free: int) -> None:
        super().__init__(_errno.ENOSPC, message)
        self.filename = path
        self.needed = needed
        self.free = free

    def __reduce__(self) -> tuple[Any, ...]:
        return (_no_space, (str(self), self.filename, self.needed, self.free))


class SourceChangedError(StageError):
    """A source file changed (size or content) while it was being staged."""


class UnsupportedFileError(StageError):
    """A device, FIFO, socket, or symlink leaving the tree, which staging refuses."""


class UnsafeArchiveError(StageError):
    """An archive member would be written outside the destination."""


class ChecksumMismatchError(StageError):
    """The data does not match the checksum it was published with."""


class TarFormatError(ValueError, FastloadError):
    """A tar archive is malformed or uses a feature fastload does not support."""


class IndexFormatError(ValueError, FastloadError):
    """A shard index is corrupt, of an unknown version, or stale."""


# errno -> the built-in OSError subclass Python itself would raise for it.
_BUILTIN_FOR_ERRNO: dict[int, type[OSError]] = {
    _errno.ENOENT: FileNotFoundError,
    _errno.EACCES: PermissionError,
    _errno.EPERM: PermissionError,
    _errno.EEXIST: FileExistsError,
    _errno.EISDIR: IsADirectoryError,
    _errno.ENOTDIR: NotADirectoryError,
}
_combined: dict[tuple[type[StageError], type[OSError]], type[StageError]] = {}


def _class_for(base: type[StageError], err: int) -> type[StageError]:
    builtin = _BUILTIN_FOR_ERRNO.get(err)
    return base if builtin is None else _combine(base, builtin)


def _combine(base: type[StageError], builtin: type[OSError]) -> type[StageError]:
    """``base`` and ``builtin`` in one class, made once, named in this module: the class
    itself pickles by name (a DataLoader worker sends its exception's type), and a
    process that has not made it yet makes it on that name's look-up (``__getattr__``)."""
    key = (base, builtin)
    if key not in _combined:
        name = builtin.__name__.replace("Error", "") + base.__name__
        cls = type(name, (base, builtin), {"__module__": __name__, "__qualname__": name})
        _combined[key] = globals()[name] = cls
    return _combined[key]


def __getattr__(name: str) -> type[StageError]:
    for builtin in set(_BUILTIN_FOR_ERRNO.values()):
        prefix = builtin.__name__.replace("Error", "")
        base = globals().get(name[len(prefix):]) if name.startswith(prefix) else None
        if isinstance(base, type) and issubclass(base, StageError) \
                and base not in _combined.values():  # fmt: skip
            return _combine(base, builtin)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stage_error(
    err: int,
    message: str,
    path: str | None = None,
    base: type[StageError] = StageError,
) -> StageError:
    """Builds a StageError (or a subclass) that is also the built-in for ``err``; a
    plain one of ENOSPC is a NotEnoughSpaceError (a write found the disk full)."""
    if err == _errno.ENOSPC and base is StageError:
        return NotEnoughSpaceError(message, path=path or "", needed=0, free=0)
    exc = _class_for(base, err)(err, message)
    exc.filename = path
    return exc


def _rebuilt(base: type[StageError], err: int | None, message: str,
             path: str | None) -> StageError:
    if err is None:
        exc = base(message)
        exc.filename = path
        return exc
    return stage_error(err, message, path, base)


def _no_space(message: str, path: str, needed: int, free: int) -> NotEnoughSpaceError:
    return NotEnoughSpaceError(message, path=path, needed=needed, free=free)


_KINDS: dict[str, type[StageError]] = {
    "os": StageError,
    "source_changed": SourceChangedError,
    "unsupported": UnsupportedFileError,
    "unsafe": UnsafeArchiveError,
}


def from_native(kind: str, err: int, op: str, path: str, message: str) -> Exception:
    """Called by the native module to turn a C++ error into the right exception."""
    if kind == "format":
        exc = TarFormatError(message)
        exc.path = path  # type: ignore[attr-defined]
        return exc
    if kind == "index_format":
        iexc = IndexFormatError(message)
        iexc.path = path  # type: ignore[attr-defined]
        return iexc
    if kind == "no_space" or (kind == "os" and err == _errno.ENOSPC):  # a write found it full
        return NotEnoughSpaceError(message, path=path, needed=0, free=0)
    if err <= 0:
        err = _errno.EINVAL if kind in ("unsupported", "unsafe") else _errno.EIO
    return stage_error(err, message, path or None, _KINDS.get(kind, StageError))
