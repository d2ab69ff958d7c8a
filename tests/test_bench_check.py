"""The I/O regression check (benchmarks/bench_check.py, scripts/bench-check.sh): ratios of
fastload to its peer from pytest-benchmark JSON, compared with a recorded baseline. A
planted slowdown is caught and named; noise within the recorded spread is not."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kit.tools import missing, require_module

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def _load() -> ModuleType:
    path = BENCH / "bench_check.py"
    if not path.exists():
        missing("no benchmarks/ beside the tests (an installed test run)")
    spec = importlib.util.spec_from_file_location("bench_check", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_check"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


bc = _load()
TREE = next(c for c in bc.CASES if c.name == "tree-warm")
TAR = next(c for c in bc.CASES if c.name == "extract-tar-warm")
COMMIT = "0123456789abcdef0123"


def _bench(module: str, name: str, median: float, scale: str = "small") -> dict[str, Any]:
    """One entry as pytest-benchmark writes it to --benchmark-json."""
    return {
        "group": "g",
        "name": name,
        "fullname": f"benchmarks/{module}::{name}",
        "params": {},
        "extra_info": {"scale": scale},
        "stats": {"median": median, "min": median * 0.9, "mean": median, "rounds": 1},
    }


def _run(tree: tuple[float, float], tar: tuple[float, float] | None = None) -> dict[str, Any]:
    """A recorded run: (fastload seconds, peer seconds) for tree-warm and extract-tar-warm."""
    out = [
        _bench(TREE.module, TREE.fastload[0], tree[0]),
        _bench(TREE.module, TREE.peer, tree[1]),
    ]
    if tar:
        out += [_bench(TAR.module, TAR.fastload[0], tar[0]), _bench(TAR.module, TAR.peer, tar[1])]
    return {"machine_info": {"node": "n", "cpu": {"count": 2}}, "benchmarks": out}


def _baseline(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """Five runs: tree-warm's ratio between 1.9 and 2.1 (peer 2 s, fastload about 1 s),
    extract-tar-warm's 1.0 to 1.1."""
    runs = [
        _run((1.0, 2.0), (1.0, 1.05)),
        _run((1.0, 1.9), (1.0, 1.0)),
        _run((1.0, 2.1), (1.0, 1.1)),
        _run((1.0, 2.0), (1.0, 1.05)),
        _run((1.0, 1.95), (1.0, 1.02)),
    ]
    base = bc.make_baseline(bc.collect(runs), commit=COMMIT, machine=bc.machine(runs[0]),
                            scale="small", runs=len(runs))  # fmt: skip
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(base))
    return path, base


def test_ratio_is_peer_over_fastload_with_the_first_fastload_variant_that_ran() -> None:
    data = _run((0.5, 2.0))
    assert bc.ratios(data) == {"tree-warm": 4.0}
    # Where io_uring is not allowed, the uring case skips and the pread one counts.
    pread = {"benchmarks": [_bench(TREE.module, TREE.fastload[1], 0.25),
                            _bench(TREE.module, TREE.peer, 1.0)]}  # fmt: skip
    assert bc.ratios(pread) == {"tree-warm": 4.0}
    # A case whose peer did not run (not installed) has no ratio.
    assert bc.ratios({"benchmarks": [_bench(TREE.module, TREE.fastload[0], 1.0)]}) == {}


def test_baseline_records_median_spread_commit_and_machine(tmp_path: Path) -> None:
    _, base = _baseline(tmp_path)
    tree = base["cases"]["tree-warm"]
    assert (tree["ratio"], tree["low"], tree["high"]) == (2.0, 1.9, 2.1)
    assert len(tree["ratios"]) == 5
    assert base["commit"] == COMMIT and base["runs"] == 5 and base["version"] == 1
    assert base["machine"]["cores"] == 2


def test_a_planted_30_percent_slowdown_is_caught_and_named(tmp_path: Path) -> None:
    _, base = _baseline(tmp_path)
    # fastload 30% slower on the tree, the peer unchanged: ratio 2.0 -> 1.54.
    now = bc.collect([_run((1.3, 2.0), (1.0, 1.05))])
    rows = bc.compare(base, now)
    by = {r.case: r for r in rows}
    assert by["tree-warm"].regressed and not by["extract-tar-warm"].regressed
    msgs = bc.failures(rows, base)
    assert len(msgs) == 1
    msg = msgs[0]
    assert msg.startswith("tree-warm: ratio 1.54")
    assert "baseline 2.00" in msg and "spread 1.90-2.10" in msg and COMMIT[:10] in msg


def test_an_entry_recorded_on_its_own_is_named_by_its_own_commit_and_runs(
    tmp_path: Path,
) -> None:
    _, base = _baseline(tmp_path)
    base["cases"]["tree-warm"].update({"commit": "fedcba9876543210", "runs": 9})
    msg = bc.failures(bc.compare(base, bc.collect([_run((1.3, 2.0))])), base)[0]
    assert "over 9 runs at commit fedcba9876" in msg and COMMIT[:10] not in msg


def test_the_issue_33_drop_is_caught_by_the_committed_second_reader_entry() -> None:
    """Issue 33's drop (18.7x to 8.1x cp -r: fastload 2.3 times slower, cp unchanged)
    against the committed netsim-second-reader entry fails the check; its own median
    does not."""
    base = bc.load_baseline(BENCH / "baseline.json")
    case = next(c for c in bc.CASES if c.name == "netsim-second-reader")
    entry = base["cases"][case.name]
    assert entry["runs"] >= 5 and len(entry["ratios"]) == entry["runs"]

    def run(fastload_s: float) -> dict[str, Any]:
        cp_s = 12.0
        return {"benchmarks": [_bench(case.module, case.fastload[0], fastload_s),
                               _bench(case.module, case.peer, cp_s)]}  # fmt: skip

    at_median = bc.collect([run(12.0 / entry["ratio"])])
    assert not bc.failures(bc.compare(base, at_median), base)
    dropped = bc.collect([run(2.3 * 12.0 / entry["ratio"])])
    msgs = bc.failures(bc.compare(base, dropped), base)
    assert [m.split(":")[0] for m in msgs] == ["netsim-second-reader"]


def test_noise_within_the_spread_and_margin_is_not_a_regression(tmp_path: Path) -> None:
    _, base = _baseline(tmp_path)
    for tree, tar in [
        ((1.0, 1.9), (1.0, 1.0)),  # the lowest ratios recorded
        ((1.08, 1.9), (1.05, 1.0)),  # 5% below them: within the 10% margin
        ((0.5, 2.0), (0.5, 1.0)),  # faster is never a regression
    ]:
        rows = bc.compare(base, bc.collect([_run(tree, tar)]))
        assert bc.failures(rows, base) == [], (tree, tar)
    # The margin is the knob: with none, 5% below the spread fails.
    rows = bc.compare(base, bc.collect([_run((1.08, 1.9))]), margin=0.0)
    assert [r.case for r in rows if r.regressed] == ["tree-warm"]


def test_the_median_of_several_runs_is_compared(tmp_path: Path) -> None:
    _, base = _baseline(tmp_path)
    # One bad run among three does not fail; two do.
    one_bad = [_run((1.0, 2.0)), _run((1.5, 2.0)), _run((1.0, 1.95))]
    assert bc.failures(bc.compare(base, bc.collect(one_bad)), base) == []
    two_bad = [_run((1.0, 2.0)), _run((1.5, 2.0)), _run((1.4, 1.95))]
    assert len(bc.failures(bc.compare(base, bc.collect(two_bad)), base)) == 1


def test_compare_command_fails_on_a_regression_and_reports_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = _baseline(tmp_path)
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(_run((1.3, 2.0), (1.0, 1.05))))
    assert bc.main(["compare", str(slow), "--baseline", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "| tree-warm | 1.54 | 1 | 2.00 | 1.90-2.10 | 1.71 | SLOWER |" in out
    assert "| extract-tar-warm | 1.05 | 1 | 1.05 |" in out
    assert "REGRESSION: tree-warm: ratio 1.54" in err and COMMIT[:10] in err
    assert bc.main(["compare", str(slow), "--baseline", str(path), "--report-only"]) == 0
    assert "timing (not failing, --report-only): tree-warm" in capsys.readouterr().err
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(_run((1.0, 2.0), (1.0, 1.05))))
    assert bc.main(["compare", str(ok), "--baseline", str(path)]) == 0


def test_a_baseline_of_another_version_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"version": 99, "cases": {}}))
    with pytest.raises(ValueError, match=r"version 99.*--update"):
        bc.load_baseline(path)


def test_a_failing_benchmark_run_fails_even_when_reporting_only(tmp_path: Path) -> None:
    """A run whose pytest fails (here: an interpreter that cannot run it) is exit 2,
    whatever the timing flags say."""
    false = subprocess.run(["sh", "-c", "command -v false"], capture_output=True, text=True)
    rc = bc.main(["run", "--report-only", "--python", false.stdout.strip() or "/bin/false",
                  "--baseline", str(tmp_path / "none.json"), "--keep", str(tmp_path)])  # fmt: skip
    assert rc == 2


def _fake_python(tmp_path: Path, runs: list[dict[str, Any]]) -> Path:
    """An "interpreter" for ``run --python``: writes the given run as pytest-benchmark's
    JSON to its --benchmark-json argument and exits 0, as a pytest run whose other cases
    were skipped does."""
    (tmp_path / "run.json").write_text(json.dumps(runs[0]))
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\nfor a; do case "$a" in --benchmark-json=*) '
                    f'cp {tmp_path / "run.json"} "${{a#*=}}";; esac; done\n')  # fmt: skip
    fake.chmod(0o755)
    return fake


def test_a_case_that_did_not_run_fails_when_all_are_required(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51: a run where only tree-warm measured both sides (every other case's peer
    or fastload side skipped) passed, having checked one case of ten. With
    --require-all (CI's default) it fails naming the others; by hand it reports."""
    path, _ = _baseline(tmp_path)
    fake = _fake_python(tmp_path, [_run((1.0, 2.0))])
    argv = ["run", "--runs", "1", "--python", str(fake), "--baseline", str(path),
            "--no-autosave"]  # fmt: skip
    monkeypatch.delenv("CI", raising=False)
    assert bc.main(argv) == 0
    assert "| extract-tar-warm | - | 0 |" in capsys.readouterr().out
    assert bc.main([*argv, "--require-all"]) == 2
    err = capsys.readouterr().err
    expected = {c.name for c in bc.CASES} - {"tree-warm"}
    assert {line.split()[1] for line in err.splitlines() if "did not run" in line} == expected
    monkeypatch.setenv("CI", "true")
    assert bc.main(argv) == 2
    assert bc.main([*argv, "--no-require-all"]) == 0
    capsys.readouterr()
    # Every case measured: a pass under CI too.
    full = {"benchmarks": [_bench(c.module, c.fastload[0], 1.0) for c in bc.CASES]
                          + [_bench(c.module, c.peer, 2.0) for c in bc.CASES]}
    assert bc.main(["run", "--runs", "1", "--python", str(_fake_python(tmp_path, [full])),
                    "--baseline", str(path), "--no-autosave"]) == 0  # fmt: skip


def test_ratios_from_a_real_pytest_benchmark_run(tmp_path: Path) -> None:
    """The JSON pytest-benchmark itself writes (its fullname and name) is what ratios() reads."""
    require_module("pytest_benchmark")
    mod = tmp_path / TREE.module
    mod.write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("tool", ["fastload-uring", "cp"])
        @pytest.mark.parametrize("cache", ["warm"])
        def test_tree(benchmark, cache, tool):
            benchmark.pedantic(sum, args=(range(1000),), rounds=2, iterations=1)
    """))
    out = tmp_path / "run.json"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(mod),
         f"--benchmark-json={out}", "-o", "addopts=", "--rootdir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    times = {b["name"]: b["stats"]["median"] for b in data["benchmarks"]}
    expect = times["test_tree[warm-cp]"] / times["test_tree[warm-fastload-uring]"]
    assert bc.ratios(data) == {"tree-warm": pytest.approx(expect)}


def test_a_peer_first_case_runs_its_peer_before_fastload(tmp_path: Path) -> None:
    """netsim-second-reader times fastload on the mount cp -r has just read: the subset
    names the peer's node first and pytest runs the nodes in that order."""
    case = next(c for c in bc.CASES if c.name == "netsim-second-reader")
    assert case.peer_first and case.ids() == [case.peer, *case.fastload]
    nodes = case.node_ids()
    assert nodes.index(f"benchmarks/{case.module}::{case.peer}") == 0
    assert bc.subset_nodes([case]) == nodes
    # The order reaches the run: a module whose tests log themselves, given in that order.
    # (the parametrisation lists fastload first, as test_bench_stage.py does not)
    order = tmp_path / "order.txt"
    mod = tmp_path / "test_order.py"
    mod.write_text(textwrap.dedent(f"""
        import pytest

        @pytest.mark.parametrize("tool", ["fastload-auto", "cp"])
        def test_case(tool):
            with open({str(order)!r}, "a") as f:
                f.write(tool + "\\n")
    """))
    peer_first = bc.Case("x", "test_order.py", ("test_case[fastload-auto]",), "test_case[cp]",
                         peer_first=True)  # fmt: skip
    ids = [f"{mod}::{t}" for t in peer_first.ids()]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ids,
         "-o", "addopts=", "--rootdir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert order.read_text().split() == ["cp", "fastload-auto"]
    # Without peer_first, fastload's node comes first, as for every other case.
    assert bc.Case("y", "m.py", ("f",), "p").ids() == ["f", "p"]


def test_every_case_names_benchmarks_that_pytest_collects(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A renamed benchmark or parameter would silently drop out of the check (and out of
    CI's deselection): every node id of the subset must be collected."""
    require_module("pytest_benchmark")
    assert bc.main(["nodes"]) == 0
    nodes = capsys.readouterr().out.split()
    assert nodes == bc.subset_nodes() and len(nodes) >= 2 * len(bc.CASES) - 2
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *nodes],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    collected = {line for line in r.stdout.splitlines() if "::" in line}
    assert collected == set(nodes)


def test_the_committed_baseline_is_readable_and_covers_the_cases() -> None:
    path = BENCH / "baseline.json"
    if not path.exists():
        missing("no baseline recorded yet")
    base = bc.load_baseline(path)
    assert base["commit"] and base["machine"] and base["runs"] >= 2
    names = {c.name for c in bc.CASES}
    assert set(base["cases"]) <= names
    for case in base["cases"].values():
        assert case["low"] <= case["ratio"] <= case["high"]
