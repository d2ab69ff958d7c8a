"""Catches I/O regressions: a fixed quick subset of the benchmarks, each fastload case
beside its peer in the same run, compared as **ratios** with a committed baseline.

    python benchmarks/bench_check.py run [--runs 3] [--scale small|full]   # check
    python benchmarks/bench_check.py update [N]                            # new baseline
    python benchmarks/bench_check.py compare run1.json [run2.json ...]     # recorded runs

(``scripts/bench-check.sh`` wraps it.) A case's ratio is peer time / fastload time (the
speed-up; above 1, fastload is faster), the median time of each over its rounds. Absolute
times change with the machine and its load; a ratio of two tools timed in the same run,
one after the other, survives a noisy shared machine far better.

``benchmarks/baseline.json`` holds, per case, the median ratio over N runs and its spread
(lowest and highest), with the commit it was recorded at and the machine. The check fails,
naming the case, the baseline and new ratio and the baseline's commit, when the new ratio
(the median over this check's runs) falls below the baseline's lowest ratio less a margin
(``--margin``, default 10%). Absolute times are kept in pytest-benchmark's own storage
(``.benchmarks/``, ``--benchmark-autosave``), and ``--compare-saved`` shows them against the
last saved run of this machine (``--benchmark-compare``).

Exit status: 0 ok (or ``--report-only``), 1 a ratio below its spread, 2 a benchmark failed
(an exception, a wrong result: always a failure, with ``--report-only`` too) or, with
``--require-all`` (the default with ``CI`` set), a case of the subset did not run on both
sides (a skipped peer, a missing mount: a check that measured nothing is not a pass),
3 usage.

Imports nothing of the benchmarks' own (stdlib only), so it runs in any interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASELINE = HERE / "baseline.json"
BASELINE_VERSION = 1
DEFAULT_MARGIN = 0.10


@dataclasses.dataclass(frozen=True)
class Case:
    """One ratio: a fastload benchmark and its peer's, from the same parametrisation.

    ``fastload`` lists test ids in order of preference: the first one that ran counts
    (``fastload-uring`` skips where io_uring is not allowed; ``fastload-pread`` then).
    ``peer_first``: the peer's test runs before fastload's (a case where fastload reads
    what the peer has just read)."""

    name: str
    module: str
    fastload: tuple[str, ...]
    peer: str
    peer_first: bool = False

    def ids(self) -> list[str]:
        return [self.peer, *self.fastload] if self.peer_first else [*self.fastload, self.peer]

    def node_ids(self) -> list[str]:
        return [f"benchmarks/{self.module}::{t}" for t in self.ids()]


_TREE = ("test_tree[warm-fastload-uring]", "test_tree[warm-fastload-pread]")

CASES: tuple[Case, ...] = (
    Case("tree-warm", "test_bench_stage.py", _TREE, "test_tree[warm-cp]"),
    # Through FUSE, "auto" picks the thread pool (pread): the engine a user gets there.
    Case(
        "netsim-tree",
        "test_bench_stage.py",
        ("test_netsim_tree[fastload-pread]",),
        "test_netsim_tree[cp]",
    ),
    # Issue 33: 1,500 files at 2 ms per request, fastload ("auto") reading the mount right
    # after cp -r read it (the drop from 18.7x to 8.1x that the small netsim tree missed).
    Case(
        "netsim-second-reader",
        "test_bench_stage.py",
        ("test_netsim_second_reader[fastload-auto]",),
        "test_netsim_second_reader[cp]",
        peer_first=True,
    ),
    Case(
        "extract-tar-warm",
        "test_bench_extract.py",
        ("test_extract_tar[warm-fastload-uring]", "test_extract_tar[warm-fastload-pread]"),
        "test_extract_tar[warm-tar]",
    ),
    Case(
        "extract-gzip-warm",
        "test_bench_extract.py",
        ("test_extract_gzip[warm-fastload-uring]", "test_extract_gzip[warm-fastload-pread]"),
        "test_extract_gzip[warm-tar-z]",
    ),
    Case(
        "random-3kb",
        "test_bench_index.py",
        ("test_random_access[3kb-fastload-mmap]",),
        "test_random_access[3kb-wids]",
    ),
    Case(
        "stream-3kb",
        "test_bench_iterable.py",
        ("test_stream_epoch[3kb-fastload]",),
        "test_stream_epoch[3kb-webdataset]",
    ),
    Case(
        "handover-3kb",
        "test_bench_collate.py",
        ("test_handover_epoch[3kb-fastload-packed]",),
        "test_handover_epoch[3kb-wids]",
    ),
    # Object stores (benchmarks/test_bench_s3.py, a SeaweedFS server on loopback): the
    # straight (0ms) variants, whose ratio is the client's own work, not the proxy's.
    Case(
        "s3-small-0ms",
        "test_bench_s3.py",
        ("test_small_objects[0ms-fastload]",),
        "test_small_objects[0ms-s3transfer-default]",
    ),
    Case(
        "s3-tar-0ms",
        "test_bench_s3.py",
        ("test_tar_object[0ms-fastload]",),
        "test_tar_object[0ms-s5cmd-cat-tar]",
    ),
)


# --- ratios from pytest-benchmark's JSON -------------------------------------------------


def _times(data: Mapping[str, Any], stat: str = "median") -> dict[str, float]:
    """Test id (``test_x[param]`` with its module file) -> the statistic, in seconds."""
    out: dict[str, float] = {}
    for b in data.get("benchmarks", []):
        full = str(b.get("fullname", b["name"]))
        module = full.split("::")[0].rsplit("/", 1)[-1]
        out[f"{module}::{b['name']}"] = float(b["stats"][stat])
    return out


def ratios(data: Mapping[str, Any], cases: Sequence[Case] = CASES) -> dict[str, float]:
    """Case name -> peer time / fastload time, for the cases whose two sides both ran."""
    times = _times(data)
    out: dict[str, float] = {}
    for c in cases:
        ours = next((times[k] for t in c.fastload if (k := f"{c.module}::{t}") in times), None)
        peer = times.get(f"{c.module}::{c.peer}")
        if ours and peer:
            out[c.name] = peer / ours
    return out


def collect(
    runs: Iterable[Mapping[str, Any]], cases: Sequence[Case] = CASES
) -> dict[str, list[float]]:
    """Case name -> its ratio in each run that has it."""
    out: dict[str, list[float]] = {}
    for data in runs:
        for name, r in ratios(data, cases).items():
            out.setdefault(name, []).append(r)
    return out


# --- the baseline ------------------------------------------------------------------------


def make_baseline(
    per_case: Mapping[str, list[float]],
    *,
    commit: str,
    machine: Mapping[str, Any],
    scale: str,
    runs: int,
    note: str = "",
    margin: float = DEFAULT_MARGIN,
) -> dict[str, Any]:
    cases = {
        name: {
            "ratio": round(statistics.median(rs), 4),
            "low": round(min(rs), 4),
            "high": round(max(rs), 4),
            "ratios": [round(r, 4) for r in rs],
        }
        for name, rs in sorted(per_case.items())
    }
    return {
        "version": BASELINE_VERSION,
        "commit": commit,
        "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "scale": scale,
        "runs": runs,
        "margin": margin,
        "ratio": "peer time / fastload time (median of each over its rounds); higher is better",
        "machine": dict(machine),
        "note": note,
        "cases": cases,
    }


def load_baseline(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("version") != BASELINE_VERSION:
        raise ValueError(
            f"{path}: baseline version {data.get('version')!r}, this check reads "
            f"{BASELINE_VERSION} (record a new one with --update)"
        )
    return data


@dataclasses.dataclass(frozen=True)
class Row:
    case: str
    new: float | None
    """Median ratio of this check's runs (None: the case did not run here)."""
    runs: int
    old: float | None
    low: float | None
    high: float | None
    floor: float | None
    """Below this, a regression: the baseline's lowest ratio less the margin."""

    @property
    def regressed(self) -> bool:
        return self.new is not None and self.floor is not None and self.new < self.floor

    def status(self) -> str:
        if self.new is None:
            return "did not run"
        if self.old is None:
            return "no baseline"
        return "SLOWER" if self.regressed else "ok"


def compare(
    baseline: Mapping[str, Any],
    current: Mapping[str, list[float]],
    *,
    margin: float | None = None,
    cases: Sequence[Case] = CASES,
) -> list[Row]:
    m = float(baseline.get("margin", DEFAULT_MARGIN) if margin is None else margin)
    base = baseline.get("cases", {})
    names = [c.name for c in cases] + sorted(set(base) - {c.name for c in cases})
    rows = []
    for name in names:
        rs = current.get(name) or []
        b = base.get(name)
        rows.append(
            Row(
                case=name,
                new=statistics.median(rs) if rs else None,
                runs=len(rs),
                old=float(b["ratio"]) if b else None,
                low=float(b["low"]) if b else None,
                high=float(b["high"]) if b else None,
                floor=float(b["low"]) * (1 - m) if b else None,
            )
        )
    return rows


def failures(rows: Iterable[Row], baseline: Mapping[str, Any]) -> list[str]:
    """A line per regressed case, naming the commit and runs its entry was recorded at
    (an entry recorded on its own says so with ``commit`` and ``runs`` keys of its own)."""
    out = []
    for r in rows:
        if not r.regressed:
            continue
        entry = baseline.get("cases", {}).get(r.case, {})
        commit = str(entry.get("commit", baseline.get("commit", "?")))[:10]
        runs = entry.get("runs", baseline.get("runs", "?"))
        out.append(
            f"{r.case}: ratio {r.new:.2f} (peer/fastload), baseline {r.old:.2f} "
            f"(spread {r.low:.2f}-{r.high:.2f} over {runs} runs at commit "
            f"{commit}): below {r.floor:.2f}, fastload is slower against its peer than it was"
        )
    return out


def not_run(rows: Iterable[Row], cases: Sequence[Case] = CASES) -> list[str]:
    """The expected cases (the subset's, whose module exists) that have no ratio."""
    expected = {c.name for c in cases if (HERE / c.module).exists()}
    return [r.case for r in rows if r.new is None and r.case in expected]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render(rows: Sequence[Row], baseline: Mapping[str, Any] | None) -> str:
    head = ["case", "ratio now", "runs", "baseline", "spread", "floor", ""]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        spread = "-" if r.low is None else f"{r.low:.2f}-{r.high:.2f}"
        cells = [r.case, _f(r.new), str(r.runs), _f(r.old), spread, _f(r.floor), r.status()]
        lines.append("| " + " | ".join(cells) + " |")
    if baseline:
        lines.append(
            f"\nratio = peer time / fastload time (higher is better); baseline commit "
            f"{str(baseline.get('commit', '?'))[:10]}, {baseline.get('runs', '?')} runs at "
            f"scale {baseline.get('scale', '?')}, recorded {baseline.get('recorded', '?')}"
        )
    return "\n".join(lines)


# --- running the subset ------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        r = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return r.stdout.strip()


def commit_id() -> str:
    c = _git("rev-parse", "HEAD")
    if c != "unknown" and _git("status", "--porcelain", "--untracked-files=no"):
        c += "-dirty"
    return c


def machine(data: Mapping[str, Any] | None) -> dict[str, Any]:
    mi = (data or {}).get("machine_info", {})
    cpu = mi.get("cpu", {})
    return {
        "node": mi.get("node", platform.node()),
        "cpu": cpu.get("brand_raw", mi.get("processor", platform.processor())),
        "cores": cpu.get("count", os.cpu_count()),
        "system": f"{mi.get('system', platform.system())} {mi.get('release', platform.release())}",
        "python": mi.get("python_version", platform.python_version()),
    }


def subset_nodes(cases: Sequence[Case] = CASES) -> list[str]:
    """The pytest node ids of the subset (relative to the repository), leaving out the
    cases of a module that does not exist."""
    return [n for c in cases if (HERE / c.module).exists() for n in c.node_ids()]


def run_subset(
    out: Path,
    *,
    scale: str,
    python: str = sys.executable,
    cases: Sequence[Case] = CASES,
    autosave: bool = True,
    compare_saved: bool = False,
    extra: Sequence[str] = (),
) -> tuple[int, dict[str, Any] | None]:
    """One pytest run of the subset into ``out`` (pytest-benchmark JSON): (exit status,
    the JSON or None). Cases of a module that does not exist are left out."""
    # (the destinations of passing cases removed: nothing left in the temporary folder)
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-o", "tmp_path_retention_policy=failed", *subset_nodes(cases),
           f"--benchmark-json={out}", "--benchmark-columns=median,min,rounds"]  # fmt: skip
    if autosave:
        cmd.append("--benchmark-autosave")
    if compare_saved:
        cmd.append("--benchmark-compare")
    env = {**os.environ, "FASTLOAD_BENCH_SCALE": scale}
    out.unlink(missing_ok=True)  # a kept file of an earlier run must not stand in for this one
    rc = subprocess.run([*cmd, *extra], cwd=REPO, env=env, check=False).returncode
    data = json.loads(out.read_text()) if out.exists() else None
    return rc, data


def _load_all(paths: Sequence[Path]) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in paths]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--baseline", type=Path, default=BASELINE)
    common.add_argument("--margin", type=float, default=None,
                        help=f"below the baseline's lowest ratio by more than this fraction "
                        f"fails (default: the baseline's, else {DEFAULT_MARGIN})")  # fmt: skip
    common.add_argument("--report-only", action="store_true",
                        default=bool(os.environ.get("FASTLOAD_BENCH_REPORT_ONLY")),
                        help="print the table, never fail on timing (a failing benchmark "
                        "still fails); also FASTLOAD_BENCH_REPORT_ONLY=1")  # fmt: skip
    running = argparse.ArgumentParser(add_help=False)
    running.add_argument("--scale", default=os.environ.get("FASTLOAD_BENCH_SCALE", "small"))
    running.add_argument("--python", default=sys.executable, help="interpreter for pytest")
    running.add_argument("--keep", type=Path, default=None, help="keep each run's JSON here")
    running.add_argument("--no-autosave", dest="autosave", action="store_false",
                         help="do not keep the absolute times in .benchmarks/")  # fmt: skip
    running.add_argument("--compare-saved", action="store_true",
                         help="pytest-benchmark: show absolute times against the last "
                         "saved run of this machine (--benchmark-compare)")  # fmt: skip
    p_run = sub.add_parser("run", parents=[common, running], help="run the subset and check")
    p_run.add_argument("--require-all", action=argparse.BooleanOptionalAction, default=in_ci(),
                       help="a case of the subset that did not run on both sides is a "
                       "failure (exit 2; the default with CI set)")  # fmt: skip
    p_run.add_argument(
        "--runs",
        type=int,
        default=3,
        help="runs of the subset; their median ratio is checked (default 3: at the small "
        "size one round per case, so a single run is one sample)",
    )
    p_up = sub.add_parser("update", parents=[common, running], help="record a new baseline")
    p_up.add_argument("runs", type=int, nargs="?", default=5)
    p_up.add_argument("--note", default="")
    p_cmp = sub.add_parser("compare", parents=[common], help="check recorded JSON files")
    p_cmp.add_argument("json", type=Path, nargs="+")
    sub.add_parser("nodes", help="print the subset's pytest node ids, one a line (CI runs "
                   "the other benchmarks without timing, deselecting these)")  # fmt: skip
    args = ap.parse_args(argv)

    if args.cmd == "nodes":
        print("\n".join(subset_nodes()))
        return 0

    if args.cmd == "compare":
        runs = _load_all(args.json)
    else:
        n = args.runs
        if n < 1:
            print("bench_check: runs must be at least 1", file=sys.stderr)
            return 3
        with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
            keep = args.keep or Path(tmp)
            keep.mkdir(parents=True, exist_ok=True)
            runs = []
            for i in range(n):
                print(f"\n== bench-check run {i + 1}/{n} (scale {args.scale})", flush=True)
                rc, data = run_subset(
                    keep / f"run{i + 1}.json",
                    scale=args.scale,
                    python=args.python,
                    autosave=args.autosave,
                    compare_saved=args.compare_saved,
                )
                if rc not in (0, 5) or data is None:
                    print(f"bench_check: the benchmarks failed (pytest exit {rc}): a failure, "
                          "not a timing", file=sys.stderr)  # fmt: skip
                    return 2
                runs.append(data)
    current = collect(runs)

    if args.cmd == "update":
        if not current:
            print("bench_check: no case ran both sides; nothing to record", file=sys.stderr)
            return 2
        base = make_baseline(
            current,
            commit=commit_id(),
            machine=machine(runs[-1] if runs else None),
            scale=args.scale,
            runs=len(runs),
            note=args.note,
            margin=DEFAULT_MARGIN if args.margin is None else args.margin,
        )
        args.baseline.write_text(json.dumps(base, indent=2) + "\n")
        print(render(compare(base, current), base))
        print(f"\nrecorded {args.baseline} ({len(current)} cases, {len(runs)} runs)")
        return 0

    try:
        base = load_baseline(args.baseline)
    except (OSError, ValueError) as e:
        print(f"bench_check: no usable baseline ({e}); showing ratios only", file=sys.stderr)
        base = {"cases": {}}
    rows = compare(base, current, margin=args.margin)
    print(render(rows, base if base.get("commit") else None))
    if base.get("scale") and runs:
        scales = {
            b.get("extra_info", {}).get("scale") for d in runs for b in d.get("benchmarks", [])
        } - {None}
        if scales - {base["scale"]}:
            print(
                f"note: the baseline is at scale {base['scale']}, this run at "
                f"{', '.join(sorted(scales))}: ratios differ by size"
            )
    absent = not_run(rows) if args.cmd == "run" and args.require_all else []
    for name in absent:
        print(f"bench_check: {name} did not run (its fastload or its peer side was skipped or "
              "deselected): a check that measured nothing is not a pass", file=sys.stderr)
    bad = failures(rows, base)
    for msg in bad:
        print(("timing (not failing, --report-only): " if args.report_only else "REGRESSION: ")
              + msg, file=sys.stderr)  # fmt: skip
    if absent:
        return 2
    return 1 if bad and not args.report_only else 0


if __name__ == "__main__":
    sys.exit(main())
