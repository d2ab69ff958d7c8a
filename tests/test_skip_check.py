"""tests/kit/skips.py, the check scripts/test.sh runs over every pass's JUnit XML: skips
of every kind (in a test, at a module's top, by a mark, a native test's exit 77) are
counted with their reasons, and under CI=true one that the allow-list does not name fails
the run; the list itself (tests/allowed-skips.txt) reads and says why for every line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kit import skips

CASES = '''
import pytest

def test_runs():
    pass

def test_inside():
    pytest.skip("no frobnicator here")

@pytest.mark.skipif(True, reason="by a mark")
def test_marked():
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False
'''
MODULE = 'import pytest\npytest.importorskip("fastload_no_such_module")\n'
CTEST = """<?xml version="1.0" encoding="UTF-8"?>
<testsuite name="(empty)" tests="2" skipped="1">
  <testcase name="engine_test" classname="engine_test" status="notrun">
    <skipped message="SKIP_RETURN_CODE=77"/>
  </testcase>
  <testcase name="tar_test" classname="tar_test" status="run"/>
</testsuite>
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    d = tmp_path_factory.mktemp("skips")
    (d / "test_cases.py").write_text(CASES)
    (d / "test_module.py").write_text(MODULE)
    xml = d / "pytest.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={xml}", "-o", "addopts=", str(d)],
                       cwd=d, capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    (d / "ctest.xml").write_text(CTEST)
    return [xml, d / "ctest.xml"]


def test_every_kind_of_skip_with_its_reason(reports: list[Path]) -> None:
    found = sorted((s.test, s.reason) for s in skips.read(reports))
    assert found == [
        ("engine_test::engine_test", "native test engine_test exited 77 (skipped)"),
        ("test_cases::test_inside", "no frobnicator here"),
        ("test_cases::test_marked", "by a mark"),
        ("test_module", "could not import 'fastload_no_such_module': "
                        "No module named 'fastload_no_such_module'"),
    ]  # fmt: skip


def _check(reports: list[Path], allowed: Path, ci: str) -> subprocess.CompletedProcess[str]:
    env = {"CI": ci, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, skips.__file__, *map(str, reports),
                           "--allowed", str(allowed)],
                          capture_output=True, text=True, env=env, check=False)  # fmt: skip


def test_a_skip_not_on_the_list_fails_under_ci(reports: list[Path], tmp_path: Path) -> None:
    allowed = tmp_path / "allowed.txt"
    allowed.write_text("# frobnicators are never here\n^no frobnicator\n\n"
                       "# by design\n^by a mark$\n")  # fmt: skip
    r = _check(reports, allowed, "true")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith("4 skipped, 4 reasons; 2 not on")
    assert "NOT ALLOWED    1 x native test engine_test exited 77" in r.stdout
    assert "NOT ALLOWED    1 x could not import 'fastload_no_such_module'" in r.stdout
    assert "   1 x no frobnicator here  (e.g. test_cases::test_inside)" in r.stdout
    assert "NOT ALLOWED    1 x no frobnicator" not in r.stdout
    # By hand (no CI) the same run only prints.
    assert _check(reports, allowed, "").returncode == 0
    allowed.write_text(allowed.read_text() + "\n# these too\nexited 77\nfastload_no_such\n")
    assert _check(reports, allowed, "true").returncode == 0


def test_a_pass_without_a_report_fails(reports: list[Path], tmp_path: Path) -> None:
    r = _check([*reports, tmp_path / "absent.xml"], skips.ALLOWED, "")
    assert r.returncode == 2
    assert "absent.xml" in r.stderr


def test_every_allowed_skip_says_why(tmp_path: Path) -> None:
    listed = skips.load_allowed()
    assert listed and all(a.why for a in listed)
    bare = tmp_path / "bare.txt"
    bare.write_text("# why\n^a$\n\n^b$\n")
    with pytest.raises(ValueError, match=r"bare.txt:4: '\^b\$' has no comment above it"):
        skips.load_allowed(bare)
