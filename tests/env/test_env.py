"""Environment detection (fastload.env): each cluster simulated with real directories, a
host name and variables; the configuration file and the variables that override paths;
the detector registry and its entry points; ``fastload env``."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload
import fastload.env.registry as registry
from fastload.cli import main
from fastload.env import Context, Detector, Environment, detect, environments, expand

MILA_HOST = "cn-a001.server.mila.quebec"


# Variables that steer environment detection (FASTLOAD_ENGINE and the like are kept).
ENV_VARS = {
    "CC_CLUSTER", "SCRATCH", "FASTLOAD_ENV", "FASTLOAD_CONFIG", "FASTLOAD_TMPDIR",
    "FASTLOAD_CACHE", "FASTLOAD_SCRATCH", "FASTLOAD_DATASET_ROOTS", "FASTLOAD_CPUS",
    "FASTLOAD_HTTP",
}


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No FASTLOAD_*/SLURM_* variable or configuration file of the machine running the
    tests leaks in."""
    for var in list(os.environ):
        if var.startswith("SLURM_") or var in ENV_VARS:
            monkeypatch.delenv(var)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-config"))


@pytest.fixture
def restore_registry() -> Iterator[None]:
    saved = dict(registry._registry)
    loaded = registry._entry_points_loaded
    yield
    registry._registry.clear()
    registry._registry.update(saved)
    registry._entry_points_loaded = loaded


def base_environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    home = tmp_path / "home" / "bob"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "USER": "bob",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(tmp_path / "no-config"),
        "TMPDIR": str(tmp_path / "tmp"),
    }
    env.update(extra)
    return env


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fastload.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------
# Each environment
# --------------------------------------------------------------------------------------


def test_mila_with_a_fake_network_datasets(tmp_path: Path) -> None:
    """Mila, as a site would configure a copy of it: /network/datasets under a temporary
    root, given through the configuration file."""
    datasets = tmp_path / "network" / "datasets"
    datasets.mkdir(parents=True)
    tmpdir = tmp_path / "slurm_tmpdir"
    tmpdir.mkdir()
    scratch = tmp_path / "network" / "scratch" / "b" / "bob"
    scratch.mkdir(parents=True)
    cfg = write_config(tmp_path, f"""
        [environments.mila]
        dataset_roots = ["{datasets}"]
    """)
    environ = base_environ(
        tmp_path,
        FASTLOAD_CONFIG=str(cfg),
        SLURM_JOB_ID="4242",
        SLURM_TMPDIR=str(tmpdir),
        SLURM_CPUS_ON_NODE="6",
        SCRATCH=str(scratch),
    )
    env = detect(environ, MILA_HOST, cpu_count=64)
    assert env.name == "mila" and env.cluster == "mila"
    assert env.tmpdir == tmpdir
    assert env.scratch == scratch
    assert env.cache == scratch / ".cache" / "fastload"
    assert env.dataset_roots == (datasets,)
    assert env.cpus == 6  # SLURM_CPUS_ON_NODE, not the machine's count
    assert env.user == "bob" and env.hostname == MILA_HOST
    assert env.config_path == cfg


def test_mila_defaults(tmp_path: Path) -> None:
    environ = base_environ(tmp_path)
    seen: list[Path] = []

    def exists(p: Path) -> bool:
        seen.append(p)
        return p == Path("/network/datasets")

    env = detect(environ, "login-2.login.server.mila.quebec", exists=exists, cpu_count=3)
    assert env.name == "mila"
    assert env.dataset_roots == (Path("/network/datasets"),)
    assert Path("/network/datasets") in seen
    assert env.scratch == Path("/network/scratch/b/bob")
    assert env.tmpdir == tmp_path / "tmp" / "fastload-bob"  # no SLURM_TMPDIR: login node
    assert env.cpus == 3
    gone = detect(environ, MILA_HOST, exists=lambda p: False)
    assert gone.dataset_roots == ()


@pytest.mark.parametrize(
    "host, is_mila",
    [
        ("cn-a001.server.mila.quebec", True),
        ("CN-G012.SERVER.MILA.QUEBEC.", True),
        ("server.mila.quebec.example.com", False),
        ("notserver.mila.quebec", False),
        ("cn-a001", False),
    ],
)
def test_mila_host_names(tmp_path: Path, host: str, is_mila: bool) -> None:
    env = detect(base_environ(tmp_path), host, exists=lambda p: False)
    assert (env.name == "mila") is is_mila


def test_drac(tmp_path: Path) -> None:
    environ = base_environ(
        tmp_path,
        CC_CLUSTER="narval",
        SLURM_JOB_ID="77",
        SLURM_TMPDIR=str(tmp_path / "localscratch"),
        SLURM_CPUS_ON_NODE="12",
        SCRATCH=str(tmp_path / "scratch" / "bob"),
    )
    env = detect(environ, "nc10101.narval.calcul.quebec")
    assert env.name == "drac" and env.cluster == "narval"
    assert env.tmpdir == tmp_path / "localscratch"
    assert env.scratch == tmp_path / "scratch" / "bob"
    assert env.cache == tmp_path / "scratch" / "bob" / ".cache" / "fastload"
    assert env.dataset_roots == ()  # no curated mirror in this home
    assert env.cpus == 12

    curated = Path(environ["HOME"]) / "projects" / "rrg-bengioy-ad" / "data" / "curated"
    curated.mkdir(parents=True)
    env = detect(environ, "nc10101.narval.calcul.quebec")
    assert env.dataset_roots == (curated,)


def test_slurm_with_and_without_slurm_tmpdir(tmp_path: Path) -> None:
    environ = base_environ(tmp_path, SLURM_JOB_ID="9", SLURM_CPUS_ON_NODE="4(x2)")
    env = detect(environ, "node17.example.org")
    assert env.name == "slurm"
    assert env.tmpdir == tmp_path / "tmp" / "fastload-bob"
    assert env.cache == Path(environ["HOME"]) / ".cache" / "fastload"
    assert env.scratch is None and env.dataset_roots == ()
    assert env.cpus == 4

    env = detect({**environ, "SLURM_TMPDIR": str(tmp_path / "job")}, "node17.example.org")
    assert env.tmpdir == tmp_path / "job"

    # A site whose SLURM sets no local directory configures one.
    cfg = write_config(tmp_path, """
        [environments.slurm]
        tmpdir = "/local/ssd/{user}/$SLURM_JOB_ID"
    """)
    env = detect({**environ, "FASTLOAD_CONFIG": str(cfg)}, "node17.example.org")
    assert env.tmpdir == Path("/local/ssd/bob/9")


def test_local(tmp_path: Path) -> None:
    environ = base_environ(tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg-cache"))
    env = detect(environ, "laptop", cpu_count=5)
    assert env.name == "local"
    assert env.cache == tmp_path / "xdg-cache" / "fastload"
    assert env.tmpdir == tmp_path / "xdg-cache" / "fastload" / "data"
    assert env.scratch is None and env.dataset_roots == ()
    assert env.cpus == 5
    env = detect(base_environ(tmp_path), "laptop")
    assert env.cache == tmp_path / "home" / "bob" / ".cache" / "fastload"


def test_detectors_are_tried_in_order(tmp_path: Path) -> None:
    everything = base_environ(tmp_path, CC_CLUSTER="cedar", SLURM_JOB_ID="1")
    assert detect(everything, MILA_HOST).name == "mila"
    assert detect(everything, "cdr1.int.cedar.computecanada.ca").name == "drac"
    del everything["CC_CLUSTER"]
    assert detect(everything, "n1").name == "slurm"
    del everything["SLURM_JOB_ID"]
    assert detect(everything, "n1").name == "local"
    assert list(environments())[:2] == ["mila", "drac"]
    assert list(environments())[-2:] == ["slurm", "local"]


def test_detection_is_pure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the arguments count: this process's own variables do not leak in."""
    monkeypatch.setenv("FASTLOAD_TMPDIR", "/should/not/be/used")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    environ = base_environ(tmp_path)
    a = detect(environ, "laptop", cpu_count=2)
    b = detect(dict(environ), "laptop", cpu_count=2)
    assert a == b and a.name == "local"
    assert a.tmpdir != Path("/should/not/be/used")


# --------------------------------------------------------------------------------------
# Forcing an environment, overriding paths
# --------------------------------------------------------------------------------------


def test_fastload_env_forces_one(tmp_path: Path) -> None:
    environ = base_environ(tmp_path, FASTLOAD_ENV="slurm", SLURM_TMPDIR=str(tmp_path / "t"))
    env = detect(environ, MILA_HOST)
    assert env.name == "slurm" and env.tmpdir == tmp_path / "t"
    # A forced detector builds its environment even where it would not match.
    env = detect(base_environ(tmp_path, FASTLOAD_ENV="mila"), "laptop", exists=lambda p: True)
    assert env.name == "mila" and env.dataset_roots == (Path("/network/datasets"),)
    with pytest.raises(ValueError, match=r"FASTLOAD_ENV='nowhere'.*mila, drac, slurm, local"):
        detect(base_environ(tmp_path, FASTLOAD_ENV="nowhere"), "laptop")
    cfg = write_config(tmp_path, 'environment = "local"\n')
    assert detect(base_environ(tmp_path, FASTLOAD_CONFIG=str(cfg)), MILA_HOST).name == "local"


def test_config_then_variables_override_paths(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, """
        [paths]
        cache = "{scratch}/cache-from-paths"
        scratch = "/big/{user}"
        tmpdir = "/from/paths"
        cpus = 3

        [environments.slurm]
        tmpdir = "/from/slurm/section/{user}"
        dataset_roots = ["/data/a", "~/data/b", "$SCRATCH/c"]

        [environments.local]
        tmpdir = "/never/used"
    """)
    environ = base_environ(
        tmp_path, FASTLOAD_CONFIG=str(cfg), SLURM_JOB_ID="3", SCRATCH="/gpfs/bob"
    )
    env = detect(environ, "n1")
    assert env.name == "slurm"
    assert env.scratch == Path("/big/bob")
    assert env.cache == Path("/big/bob/cache-from-paths")  # {scratch} after its override
    assert env.tmpdir == Path("/from/slurm/section/bob")  # the section beats [paths]
    home = environ["HOME"]
    assert env.dataset_roots == (Path("/data/a"), Path(home) / "data/b", Path("/gpfs/bob/c"))
    assert env.cpus == 3

    environ.update(
        FASTLOAD_TMPDIR="/var/{user}",
        FASTLOAD_CACHE=str(tmp_path / "c"),
        FASTLOAD_SCRATCH="/s",
        FASTLOAD_DATASET_ROOTS=f"/r1{os.pathsep}/r2",
        FASTLOAD_CPUS="7",
    )
    env = detect(environ, "n1")
    assert (env.tmpdir, env.cache, env.scratch) == (Path("/var/bob"), tmp_path / "c", Path("/s"))
    assert env.dataset_roots == (Path("/r1"), Path("/r2"))
    assert env.cpus == 7


def test_bad_overrides(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\{scratch\}, which has no value here"):
        detect(base_environ(tmp_path, FASTLOAD_TMPDIR="{scratch}/x"), "laptop")
    with pytest.raises(ValueError, match=r"unknown field \{nope\}"):
        detect(base_environ(tmp_path, FASTLOAD_CACHE="/x/{nope}"), "laptop")
    with pytest.raises(ValueError, match=r"\$UNSET_VAR_FOR_TEST"):
        detect(base_environ(tmp_path, FASTLOAD_CACHE="$UNSET_VAR_FOR_TEST/x"), "laptop")
    with pytest.raises(ValueError, match="FASTLOAD_CPUS"):
        detect(base_environ(tmp_path, FASTLOAD_CPUS="many"), "laptop")


def test_expand() -> None:
    fields = {"user": "bob", "scratch": "/s", "name": "imagenet"}
    environ = {"HOME": "/home/bob", "JOB": "12"}
    assert expand("{scratch}/{name}-$JOB-${JOB}", fields, environ) == "/s/imagenet-12-12"
    assert expand("~/x/{{literal}}", fields, environ) == "/home/bob/x/{literal}"
    assert expand("/a~b", fields, environ) == "/a~b"
    with pytest.raises(ValueError, match="unknown field"):
        expand("{name!r}", fields, environ)


@pytest.mark.parametrize(
    "text, message",
    [
        ("tmpdir = '/x'\n", "unknown key 'tmpdir'"),
        ("[paths]\ntmpdri = '/x'\n", "unknown key 'tmpdri' in \\[paths\\]"),
        ("[paths]\ncpus = 0\n", "cpus must be a positive integer"),
        ("[environments.slurm]\ndataset_roots = '/x'\n", "dataset_roots must be a list"),
        ("[paths\n", "not valid TOML"),
        ("environment = 3\n", "environment must be a name"),
    ],
)
def test_config_errors_name_the_file(tmp_path: Path, text: str, message: str) -> None:
    cfg = write_config(tmp_path, text)
    with pytest.raises(ValueError, match=message) as info:
        detect(base_environ(tmp_path, FASTLOAD_CONFIG=str(cfg)), "laptop")
    assert str(cfg) in str(info.value)


def test_config_file_locations(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(FileNotFoundError, match="FASTLOAD_CONFIG"):
        detect(base_environ(tmp_path, FASTLOAD_CONFIG=str(missing)), "laptop")
    # The default file is optional, and read where XDG_CONFIG_HOME (or ~/.config) says.
    environ = base_environ(tmp_path)
    assert detect(environ, "laptop").config_path is None
    xdg = tmp_path / "xdg"
    (xdg / "fastload").mkdir(parents=True)
    (xdg / "fastload" / "config.toml").write_text('[paths]\ntmpdir = "/xdg"\n')
    env = detect({**environ, "XDG_CONFIG_HOME": str(xdg)}, "laptop")
    assert env.tmpdir == Path("/xdg") and env.config_path == xdg / "fastload" / "config.toml"
    home_cfg = Path(environ["HOME"]) / ".config" / "fastload" / "config.toml"
    home_cfg.parent.mkdir(parents=True)
    home_cfg.write_text('[paths]\ntmpdir = "/home-config"\n')
    no_xdg = {k: v for k, v in environ.items() if k != "XDG_CONFIG_HOME"}
    assert detect(no_xdg, "laptop").tmpdir == Path("/home-config")


# --------------------------------------------------------------------------------------
# The registry and its entry points
# --------------------------------------------------------------------------------------


def _site_detector(name: str = "site") -> Detector:
    def matches(ctx: Context) -> bool:
        return ctx.get("SITE_CLUSTER") is not None

    def build(ctx: Context) -> Environment:
        return Environment(
            name=name,
            tmpdir=Path("/site/tmp"),
            cache=Path("/site/cache"),
            scratch=None,
            dataset_roots=ctx.existing([Path("/site/data")]),
            cpus=1,
            user=ctx.user,
            hostname=ctx.hostname,
        )

    return Detector(name, matches, build, "a site")


def test_registry_view_is_read_only(restore_registry: None) -> None:
    view = environments()
    with pytest.raises(TypeError):
        view["x"] = _site_detector("x")  # type: ignore[index]
    assert set(view) >= {"mila", "drac", "slurm", "local"}


def test_register_environment(restore_registry: None, tmp_path: Path) -> None:
    fastload.env.register_environment(_site_detector())
    assert list(environments()).index("site") == list(environments()).index("slurm") - 1
    environ = base_environ(tmp_path, SITE_CLUSTER="1", SLURM_JOB_ID="5")
    env = detect(environ, "n1", exists=lambda p: True)
    assert env.name == "site" and env.dataset_roots == (Path("/site/data"),)
    assert env.tmpdir == Path("/site/tmp")
    # Overrides apply to plug-ins too.
    env = detect({**environ, "FASTLOAD_TMPDIR": "/o"}, "n1")
    assert env.tmpdir == Path("/o")
    with pytest.raises(ValueError, match="already registered"):
        fastload.env.register_environment(_site_detector())
    fastload.env.register_environment(_site_detector(), replace=True)
    with pytest.raises(ValueError, match="before='nope'"):
        fastload.env.register_environment(_site_detector("other"), before="nope")
    with pytest.raises(TypeError):
        fastload.env.register_environment(object())  # type: ignore[arg-type]
    fastload.env.register_environment(_site_detector("last"), before=None)
    assert list(environments())[-1] == "last"


def _install_plugin(root: Path, entry_points: str, module: str, code: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(code), encoding="utf-8")
    info = root / "fastload_site_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fastload-site-plugin\nVersion: 0.1\n", encoding="utf-8"
    )
    (info / "entry_points.txt").write_text(
        "[fastload.environments]\n" + entry_points, encoding="utf-8"
    )


PLUGIN = """
    from pathlib import Path
    from fastload.env import Detector, Environment

    def _build(ctx):
        return Environment(name="ignored", tmpdir=Path("/plug/tmp"), cache=Path("/plug/c"),
                           scratch=None, dataset_roots=(), cpus=2)

    DETECTOR = Detector("plug", lambda ctx: ctx.get("PLUG") == "1", _build)

    def make():
        return DETECTOR
"""


def test_entry_point_plugins(
    restore_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site-packages"
    _install_plugin(
        site,
        "plug = fl_test_plugin:DETECTOR\nplug2 = fl_test_plugin:make\n",
        "fl_test_plugin",
        PLUGIN,
    )
    monkeypatch.syspath_prepend(str(site))
    registry._load_entry_points(force=True)
    names = list(environments())
    assert {"plug", "plug2"} <= set(names)
    assert names.index("plug") < names.index("slurm")
    env = detect(base_environ(tmp_path, PLUG="1", SLURM_JOB_ID="1"), "n1")
    assert env.name == "plug" and env.tmpdir == Path("/plug/tmp")  # named after the entry
    env = detect(base_environ(tmp_path, FASTLOAD_ENV="plug2"), "n1")
    assert env.name == "plug2"
    monkeypatch.delitem(sys.modules, "fl_test_plugin", raising=False)


def test_broken_entry_point_is_skipped_with_a_warning(
    restore_registry: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site-packages"
    _install_plugin(site, "broken = fl_test_broken:NOT_THERE\n", "fl_test_broken", "X = 1\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.warns(RuntimeWarning, match="skipping environment plug-in 'broken'"):
        registry._load_entry_points(force=True)
    assert "broken" not in environments()
    assert detect(base_environ(tmp_path), "laptop").name == "local"
    monkeypatch.delitem(sys.modules, "fl_test_broken", raising=False)


# --------------------------------------------------------------------------------------
# fastload env
# --------------------------------------------------------------------------------------


def test_cli_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    roots = tmp_path / "datasets"
    roots.mkdir()
    for key, value in base_environ(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "16")
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path))
    monkeypatch.setenv("FASTLOAD_DATASET_ROOTS", str(roots))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "slurm" in out
    assert "rank 5 of 8, local rank 1" in out
    assert "node 2, job 31" in out
    assert f"tmpdir         {tmp_path}" in out
    assert str(roots) in out
    assert "16" in out and "SLURM_CPUS_ON_NODE" in out

    assert main(["env", "--json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert data["environment"] == "slurm"
    assert data["world"] == {"rank": 5, "world_size": 8, "local_rank": 1, "source": "slurm"}
    assert data["tmpdir"]["path"] == str(tmp_path) and data["tmpdir"]["exists"] is True
    assert data["dataset_roots"][0]["path"] == str(roots)
    assert data["cpus"] == 16
    assert data["config"]["read"] is False


def test_cli_env_bad_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(tmp_path, "[paths\n")
    monkeypatch.setenv("FASTLOAD_CONFIG", str(cfg))
    assert main(["env"]) == 1
    assert "not valid TOML" in capsys.readouterr().err
