"""``fastload probe``: what the storage at a path does, measured in seconds, and what
fastload will do about it.

Reads only. Per-request latency of stat, open and a small read (each on a file not
touched before, so neither the attribute cache nor the page cache answers); the
throughput of one sequential stream; the rate of whole small requests (open, read 64 KiB,
close; a ranged GET for an object store) at 1, 2, 4, ... 64 in flight, and the fewest in
flight that reach nearly the best rate; whether io_uring is allowed in this process; the
free space and file system type of the node-local destination. The plan (engine, files
in flight, stripe size) comes from the staging code itself (``copy_options``,
``resolve_engine``), not from a copy of its rules.

Each measurement is reported as it is made (``on_event``: a :class:`ProbeEvent`; the
command line prints their lines to stderr). Objects and files smaller than a read are
read whole (``min(size, read)`` bytes); empty objects are listed but never read.

The ``--json`` schema (:data:`SCHEMA_VERSION`), ``ProbeResult.to_dict()``::

    version                 2 (1 had no plan.reason)
    path, kind, fs_type     what was probed: kind "local", "network" or "object"
    files_sampled           files (objects) listed, empty ones included
    latency_ms              {stat, open, read}: lower quartiles, null where not measured
    throughput_mb_per_s     {single_stream, parallel}
    parallel_requests_per_s the top rate of the in-flight steps
    best_in_flight          the fewest in flight within 10% of that rate (null: none ran)
    in_flight_steps         [{in_flight, requests_per_s, mb_per_s}] in the order run
    io_uring                whether io_uring is allowed in this process
    destination             {path, fs_type, free_bytes, network}
    plan                    {engine, in_flight, threads, stripe_size, reason}: what
                            stage() does here by default; reason is null when
                            in_flight is best_in_flight, else why they differ and the
                            flag that follows the measurement (--workers N)
    seconds                 time spent
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import statistics
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping

from . import _core
from ._util import human
from .env import current
from .errors import stage_error
from .sources import is_store_url, store_for
from .staging.engine import network_fs, resolve_engine
from .staging.job import DEFAULT_STRIPE, copy_options
from .staging.remote import DEFAULT_OBJECTS_IN_FLIGHT

SCHEMA_VERSION = 2  # 2: plan.reason
IN_FLIGHT_STEPS = (1, 2, 4, 8, 16, 32, 64)
REQUEST_BYTES = 64 << 10
NEAR_BEST = 0.9  # the best in flight: the fewest reaching this share of the top rate
MAX_SAMPLE = 256  # files (or objects) listed at most

# statfs(2) magic numbers, for the names in the report: the native table
# (cpp/io/fs.cpp), which staging's choice of I/O backend reads too.
_FS_NAMES = {magic: name for magic, (name, _) in _core.file_systems().items()}


@dataclasses.dataclass(frozen=True)
class InFlightStep:
    in_flight: int
    requests_per_s: float
    mb_per_s: float


@dataclasses.dataclass(frozen=True)
class ProbeEvent:
    """One measurement, reported as it is made (``probe(on_event=...)``).

    ``kind``: ``"start"`` (before anything is read), ``"sample"`` (files or objects
    listed), ``"latency"``, ``"stream"`` (one sequential stream), ``"in_flight"`` (one
    step, in the order of :data:`IN_FLIGHT_STEPS`); ``line`` says it in words;
    ``values`` holds the numbers (the same names as the result's fields)."""

    kind: str
    line: str
    values: Mapping[str, Any] = dataclasses.field(default_factory=dict)


OnEvent = Callable[[ProbeEvent], None]


def _ignore(event: ProbeEvent) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class Destination:
    path: Path
    fs_type: str
    free_bytes: int
    network: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``stage()`` would do with this source: its defaults, resolved here.
    ``reason``: ``None`` where ``in_flight`` is the measured best, else why not and the
    flag that follows the measurement."""

    engine: str
    in_flight: int
    threads: int
    stripe_size: int
    reason: str | None = None


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe` measured. ``to_dict()`` is the ``--json`` schema (``version``)."""

    path: str
    kind: str  # "local", "network" or "object"
    fs_type: str
    files_sampled: int
    stat_ms: float | None
    open_ms: float | None
    read_ms: float | None
    single_stream_mb_per_s: float | None
    parallel_mb_per_s: float | None
    parallel_requests_per_s: float | None
    best_in_flight: int | None
    steps: tuple[InFlightStep, ...]
    io_uring: bool
    destination: Destination
    plan: Plan
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION,
            "path": self.path,
            "kind": self.kind,
            "fs_type": self.fs_type,
            "files_sampled": self.files_sampled,
            "latency_ms": {"stat": self.stat_ms, "open": self.open_ms, "read": self.read_ms},
            "throughput_mb_per_s": {
                "single_stream": self.single_stream_mb_per_s,
                "parallel": self.parallel_mb_per_s,
            },
            "parallel_requests_per_s": self.parallel_requests_per_s,
            "best_in_flight": self.best_in_flight,
            "in_flight_steps": [dataclasses.asdict(s) for s in self.steps],
            "io_uring": self.io_uring,
            "destination": {
                "path": str(self.destination.path),
                "fs_type": self.destination.fs_type,
                "free_bytes": self.destination.free_bytes,
                "network": self.destination.network,
            },
            "plan": dataclasses.asdict(self.plan),
            "seconds": self.seconds,
        }


def fs_name(path: str | os.PathLike[str]) -> str:
    """The file system type of ``path`` by name (``0x...`` when not known here)."""
    try:
        magic = _core.fs_type(os.fspath(path))
    except OSError:
        return "unknown"
    return _FS_NAMES.get(magic, f"0x{magic:x}")


def _existing(path: Path) -> Path:
    """``path``, or its nearest existing parent (a destination not made yet)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def destination(dest: str | os.PathLike[str] | None = None) -> Destination:
    """The node-local destination: ``dest``, else this environment's tmpdir."""
    path = Path(dest) if dest is not None else current().tmpdir
    there = _existing(path)
    st = os.statvfs(there)
    return Destination(
        path, fs_name(there), st.f_bavail * st.f_frsize, bool(network_fs(there))
    )


def _latency_ms(xs: list[float]) -> float | None:
    """The lower quartile, in ms: what the storage takes. The median of a busy machine
    also counts the wait for a CPU after the reply."""
    if not xs:
        return None
    q = statistics.quantiles(xs, n=4, method="inclusive")[0] if len(xs) > 1 else xs[0]
    return round(q * 1e3, 3)


def _sample_files(root: Path, deadline: float) -> list[Path]:
    """Up to MAX_SAMPLE regular files under ``root``, breadth first, without stat()."""
    if not root.is_dir():
        return [root]
    out: list[Path] = []
    todo = deque([root])
    while todo and len(out) < MAX_SAMPLE and time.monotonic() < deadline:
        d = todo.popleft()
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        todo.append(Path(e.path))
                    elif e.is_file(follow_symlinks=False):
                        out.append(Path(e.path))
                        if len(out) >= MAX_SAMPLE:
                            break
        except OSError:
            continue
    return out


def _steps(request: Any, seconds_per_step: float, emit: OnEvent) -> list[InFlightStep]:
    """The rate of ``request()`` (returns bytes read) at each number in flight, each
    step reported as it ends. Every step runs: a directory's lookups may be served one
    at a time, so a few in flight can gain nothing where many still do."""
    out: list[InFlightStep] = []
    for n in IN_FLIGHT_STEPS:
        counts = [0] * n
        sizes = [0] * n
        errors: list[BaseException] = []
        stop = time.monotonic() + seconds_per_step

        def loop(
            i: int,
            stop: float = stop,
            counts: list[int] = counts,
            sizes: list[int] = sizes,
            errors: list[BaseException] = errors,
        ) -> None:
            try:
                while time.monotonic() < stop:
                    sizes[i] += request()
                    counts[i] += 1
            except BaseException as e:  # re-raised in the caller
                errors.append(e)

        t0 = time.monotonic()
        threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.monotonic() - t0
        if errors:
            raise errors[0]
        rate = sum(counts) / dt
        step = InFlightStep(n, round(rate, 1), round(sum(sizes) / dt / 1e6, 2))
        out.append(step)
        emit(ProbeEvent(
            "in_flight",
            f"{n:>2} in flight: {step.requests_per_s:,.0f} requests/s, "
            f"{_mbs(step.mb_per_s)}",
            dataclasses.asdict(step),
        ))
    return out


def _best(steps: list[InFlightStep]) -> int | None:
    if not steps:
        return None
    top = max(s.requests_per_s for s in steps)
    return next(s.in_flight for s in steps if s.requests_per_s >= NEAR_BEST * top)


def _emit_sample(emit: OnEvent, n: int, what: str, empty: int = 0) -> None:
    extra = f" ({empty} empty, not read)" if empty else ""
    emit(ProbeEvent("sample", f"{n} {what} sampled{extra}",
                    {"files_sampled": n, "empty": empty}))


def _emit_latency(emit: OnEvent, stat: float | None, open_: float | None,
                  read: float | None) -> None:
    emit(ProbeEvent(
        "latency", f"latency: stat {_ms(stat)}, open {_ms(open_)}, read {_ms(read)}",
        {"stat_ms": stat, "open_ms": open_, "read_ms": read},
    ))


def _emit_stream(emit: OnEvent, single: float | None) -> None:
    emit(ProbeEvent("stream", f"one stream: {_mbs(single)}",
                    {"single_stream_mb_per_s": single}))


def _probe_files(root: Path, seconds: float, emit: OnEvent) -> dict[str, Any]:
    t_end = time.monotonic() + seconds
    files = _sample_files(root, time.monotonic() + max(1.0, seconds * 0.1))
    if not files:
        raise stage_error(
            errno.ENOENT,
            f"'{root}' has no readable file to probe: give a directory holding the data",
            str(root),
        )
    _emit_sample(emit, len(files), "files")
    # Latencies: each file stat()ed, opened and read once, first touch each time.
    stat_t: list[float] = []
    open_t: list[float] = []
    read_t: list[float] = []
    sizes: dict[Path, int] = {}
    lat_end = time.monotonic() + seconds * 0.15
    for f in files[:32]:
        t0 = time.perf_counter()
        try:
            st = os.stat(f)
            t1 = time.perf_counter()
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        t2 = time.perf_counter()
        try:
            os.pread(fd, 4096, 0)
            t3 = time.perf_counter()
        finally:
            os.close(fd)
        sizes[f] = st.st_size
        stat_t.append(t1 - t0)
        open_t.append(t2 - t1)
        if st.st_size > 0:
            read_t.append(t3 - t2)
        if time.monotonic() > lat_end and len(stat_t) >= 3:
            break
    _emit_latency(emit, _latency_ms(stat_t), _latency_ms(open_t), _latency_ms(read_t))
    # One stream: the biggest file seen, 1 MiB reads, for a share of the time.
    single = None
    if sizes:
        big = max(sizes, key=lambda p: sizes[p])
        stop = time.monotonic() + seconds * 0.15
        n = 0
        t0 = time.perf_counter()
        with open(big, "rb", buffering=0) as fh:
            while time.monotonic() < stop and n < 1 << 30:
                b = fh.read(1 << 20)
                if not b:
                    break
                n += len(b)
        dt = time.perf_counter() - t0
        single = round(n / dt / 1e6, 2) if dt > 0 and n else None
    _emit_stream(emit, single)
    # Whole small requests in flight: open, read 64 KiB somewhere, close.
    rng = random.Random(0)
    pick = list(files)
    lock = threading.Lock()
    cursor = [0]

    def request() -> int:
        with lock:
            f = pick[cursor[0] % len(pick)]
            cursor[0] += 1
            off = rng.randrange(0, max(1, sizes.get(f, 0) - REQUEST_BYTES) + 1) & ~4095
        fd = os.open(f, os.O_RDONLY)
        try:
            return len(os.pread(fd, REQUEST_BYTES, off))
        finally:
            os.close(fd)

    left = max(0.5, t_end - time.monotonic())
    steps = _steps(request, left / len(IN_FLIGHT_STEPS), emit)
    return {
        "files_sampled": len(files),
        "stat_ms": _latency_ms(stat_t),
        "open_ms": _latency_ms(open_t),
        "read_ms": _latency_ms(read_t),
        "single": single,
        "steps": steps,
    }


def _probe_objects(url: str, seconds: float, storage_options: dict[str, Any] | None,
                   emit: OnEvent) -> dict[str, Any]:
    t_end = time.monotonic() + seconds
    store = store_for(url, storage_options)
    try:
        objects = store.list()[:MAX_SAMPLE]
    except OSError:
        objects = []
    if not objects:
        objects = [store.head("")]  # the URL names one object
        keys = [""]
    else:
        keys = [o.key for o in objects]
    sizes = {k: o.size for k, o in zip(keys, objects, strict=True)}
    # Empty objects are listed and HEADed, never read: a range of nothing is no request.
    readable = [k for k in keys if sizes[k] > 0]
    _emit_sample(emit, len(keys), "objects", len(keys) - len(readable))
    head_t: list[float] = []
    read_t: list[float] = []
    buf = memoryview(bytearray(4096))
    lat_end = time.monotonic() + seconds * 0.15
    for k in keys[:32]:
        t0 = time.perf_counter()
        store.head(k)
        t1 = time.perf_counter()
        if sizes[k]:  # the first bytes, no more than the object has
            store.read_into(k, 0, buf[:min(sizes[k], len(buf))], None)
            read_t.append(time.perf_counter() - t1)
        head_t.append(t1 - t0)
        if time.monotonic() > lat_end and len(head_t) >= 3:
            break
    _emit_latency(emit, _latency_ms(head_t), None, _latency_ms(read_t))
    single = None
    if readable:
        big = max(readable, key=lambda k: sizes[k])
        stop = time.monotonic() + seconds * 0.15
        n = 0
        t0 = time.perf_counter()
        for chunk in store.stream(big):
            n += len(chunk)
            if time.monotonic() > stop:
                break
        dt = time.perf_counter() - t0
        single = round(n / dt / 1e6, 2) if dt > 0 and n else None
    _emit_stream(emit, single)
    rng = random.Random(0)
    lock = threading.Lock()
    cursor = [0]

    def request() -> int:
        """A ranged GET of REQUEST_BYTES, or of the whole object where it is smaller,
        never past its end."""
        with lock:
            k = readable[cursor[0] % len(readable)]
            cursor[0] += 1
            want = min(REQUEST_BYTES, sizes[k])
            off = rng.randrange(0, sizes[k] - want + 1)
        return store.read_into(k, off, memoryview(bytearray(want)), None)

    steps: list[InFlightStep] = []
    if readable:
        left = max(0.5, t_end - time.monotonic())
        steps = _steps(request, left / len(IN_FLIGHT_STEPS), emit)
    return {
        "files_sampled": len(keys),
        "stat_ms": _latency_ms(head_t),
        "open_ms": None,
        "read_ms": _latency_ms(read_t),
        "single": single,
        "steps": steps,
    }


def _reason(plan: Plan, best: int | None, steps: list[InFlightStep]) -> str | None:
    """Why ``plan.in_flight`` (stage()'s default) is not the measured best; None where
    it is."""
    if best == plan.in_flight:
        return None
    if best is None:
        return (f"stage() keeps {plan.in_flight} in flight by default: nothing was "
                "measured in flight (no object here has any bytes to read)")
    rates = {s.in_flight: s.requests_per_s for s in steps}
    top = max(rates.values())
    at = rates.get(plan.in_flight)
    if best > plan.in_flight:
        return (f"stage() keeps {plan.in_flight} in flight by default; this storage "
                f"gained up to {best} in flight: pass --workers {best}")
    share = f" ({plan.in_flight}: {at / top:.0%})" if at else ""
    return (f"stage() keeps {plan.in_flight} in flight by default, for storage slower "
            f"than this; here {best} reached {NEAR_BEST:.0%} of the top rate{share}: "
            f"pass --workers {best} to follow the measurement")


def probe(
    path: str | os.PathLike[str],
    *,
    dest: str | os.PathLike[str] | None = None,
    seconds: float = 20.0,
    storage_options: dict[str, Any] | None = None,
    on_event: OnEvent | None = None,
) -> ProbeResult:
    """Measures the storage at ``path`` (a file, a directory, or an ``s3://`` URL) for
    about ``seconds``, reading only, and says what :func:`fastload.stage` will do there.

    ``dest`` is the node-local destination to describe (default: the environment's
    tmpdir). Nothing is written anywhere. ``on_event`` is called with a
    :class:`ProbeEvent` for each measurement as it is made (``fastload probe`` prints
    their lines on stderr)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, not {seconds}")
    emit = on_event or _ignore
    t0 = time.monotonic()
    loc = os.fspath(path)
    start = ProbeEvent("start", f"probing {loc} for about {seconds:g} s, reading only",
                       {"path": loc, "seconds": seconds})
    if is_store_url(loc):
        emit(start)
        m = _probe_objects(loc, seconds, storage_options, emit)
        kind, fs = "object", loc.split(":", 1)[0]
        plan = Plan("object-store", DEFAULT_OBJECTS_IN_FLIGHT, DEFAULT_OBJECTS_IN_FLIGHT,
                    DEFAULT_STRIPE)
    else:
        src = Path(loc).absolute()
        if not src.exists():
            raise stage_error(
                errno.ENOENT,
                f"no such file or directory: '{src}' (give the directory, file or "
                "s3:// URL that holds the data)",
                str(src),
            )
        emit(start)
        m = _probe_files(src, seconds, emit)
        kind = "network" if network_fs(src) else "local"
        fs = fs_name(src)
        where = src if src.is_dir() else src.parent
        # stage() measures the open latency the same way (engine.request_latency).
        open_s = None if m["open_ms"] is None else m["open_ms"] / 1e3
        opts = copy_options("auto", None, DEFAULT_STRIPE, where, open_s)
        # The rule stage() runs (FASTLOAD_ENGINE included), asked before any job runs.
        engine = resolve_engine(opts.engine, where)
        plan = Plan(engine, opts.files_in_flight, opts.threads, opts.stripe_size)
    steps: list[InFlightStep] = m["steps"]
    top = max(steps, key=lambda s: s.requests_per_s) if steps else None
    best = _best(steps)
    plan = dataclasses.replace(plan, reason=_reason(plan, best, steps))
    return ProbeResult(
        path=loc,
        kind=kind,
        fs_type=fs,
        files_sampled=m["files_sampled"],
        stat_ms=m["stat_ms"],
        open_ms=m["open_ms"],
        read_ms=m["read_ms"],
        single_stream_mb_per_s=m["single"],
        parallel_mb_per_s=top.mb_per_s if top else None,
        parallel_requests_per_s=top.requests_per_s if top else None,
        best_in_flight=best,
        steps=tuple(steps),
        io_uring=bool(_core.uring_available()),
        destination=destination(dest),
        plan=plan,
        seconds=round(time.monotonic() - t0, 2),
    )


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g} ms"


def _mbs(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f} MB/s"


def format_table(r: ProbeResult) -> str:
    """The short human report of ``fastload probe``."""
    d = r.destination
    curve = "  ".join(f"{s.in_flight}:{s.requests_per_s:,.0f}/s" for s in r.steps)
    rows = [
        f"{r.path}: {r.kind} storage ({r.fs_type}), {r.files_sampled} files sampled, "
        f"{r.seconds:.1f} s",
        f"  latency       stat {_ms(r.stat_ms)}   open {_ms(r.open_ms)}   "
        f"read {_ms(r.read_ms)}",
        f"  throughput    one stream {_mbs(r.single_stream_mb_per_s)}   "
        f"in parallel {_mbs(r.parallel_mb_per_s)}",
        f"  in flight     best {r.best_in_flight}   ({curve})",
        f"  io_uring      {'allowed' if r.io_uring else 'not allowed here'}",
        f"  destination   {d.path} ({d.fs_type}{', network!' if d.network else ''}), "
        f"{human(d.free_bytes)} free",
        f"  fastload will use engine {r.plan.engine}, {r.plan.in_flight} files in flight "
        f"({r.plan.threads} threads), stripes of {human(r.plan.stripe_size)}",
    ]
    if r.plan.reason:
        rows.append(f"  why           {r.plan.reason}")
    if d.network:
        rows.append("  warning: the destination is not node-local")
    return "\n".join(rows)
