"""What `import fastload` and a local stage import: only what they use. Every job step,
training script and DataLoader worker imports fastload; the object stores (asyncio, ssl,
obstore), the version lookup (importlib.metadata), probe, env, the archive pipeline, torch
and numpy are imported where a path needs them, never with the package (issue 33).

Each check runs in a fresh interpreter and looks at the modules it imported (what was in
``sys.modules`` before is left out: a site hook's imports are not fastload's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fastload

# Imported by neither `import fastload` nor a local tree's stage, API or CLI.
NEVER_FOR_A_LOCAL_STAGE = (
    "asyncio", "ssl", "socket", "email", "importlib.metadata", "zipfile",
    "concurrent.futures", "logging", "statistics", "configparser", "tomllib",
    "obstore", "numpy", "torch", "tqdm",
    "fastload.sources.objstore", "fastload.sources.settings", "fastload.staging.remote",
    "fastload.staging.fetch", "fastload.staging.archive", "fastload.staging.readers",
    "fastload.staging.stream", "fastload.staging.fanout", "fastload.probing",
    "fastload.env", "fastload.cache", "fastload.index", "fastload.data",
    "fastload.packing",
)  # fmt: skip
# Nor by `import fastload` alone: the package imports its exceptions, nothing else.
NEVER_FOR_THE_IMPORT = (*NEVER_FOR_A_LOCAL_STAGE, "fastload.staging", "fastload._core")

_PRELUDE = """
import json, sys
_before = set(sys.modules)
"""
_REPORT = """
print(json.dumps(sorted(set(sys.modules) - _before)))
"""


def _run(code: str, **env: str) -> set[str]:
    """The modules ``code`` imported in a fresh interpreter."""
    package_root = str(Path(fastload.__file__).resolve().parents[1])
    environ = {**os.environ, **env}
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, environ.get("PYTHONPATH")) if p
    )
    script = _PRELUDE + textwrap.dedent(code) + _REPORT
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environ,
        timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def _reached(imported: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imported for n in names if m == n or m.startswith(n + "."))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"a" * 100)
    (src / "sub" / "b.bin").write_bytes(os.urandom(5000))
    (src / "sub" / "c").write_bytes(b"")
    return src


def _same(src: Path, dst: Path) -> None:
    for p in src.rglob("*"):
        if p.is_file():
            assert (dst / p.relative_to(src)).read_bytes() == p.read_bytes(), p


def test_import_fastload_imports_only_the_exceptions() -> None:
    imported = _run("import fastload")
    assert "fastload" in imported and "fastload.errors" in imported
    assert _reached(imported, NEVER_FOR_THE_IMPORT) == []


def test_a_local_stage_imports_no_object_store_version_or_archive(
    tree: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "dst"
    imported = _run(f"""
        import fastload
        r = fastload.stage({str(tree)!r}, {str(dst)!r}, progress=False)
        assert r.files == 3, r
        assert fastload.verify({str(dst)!r}).ok
    """)
    _same(tree, dst)
    assert "fastload.staging.tree" in imported
    assert _reached(imported, NEVER_FOR_A_LOCAL_STAGE) == []


def test_the_stage_command_on_a_local_tree_imports_as_little(
    tree: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "dst"
    imported = _run(f"""
        import runpy
        sys.argv = ["fastload", "stage", "--no-progress", {str(tree)!r}, {str(dst)!r}]
        try:
            runpy.run_module("fastload", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert not e.code, e.code
    """)
    _same(tree, dst)
    assert "fastload.cli" in imported
    assert _reached(imported, NEVER_FOR_A_LOCAL_STAGE) == []


def test_the_lazy_names_still_resolve(tmp_path: Path) -> None:
    """Every public name not needing torch or numpy, the parts as attributes, the
    version, and the object stores behind their schemes, each imported on first use;
    the configuration file's [storage] tables still reach the object stores' settings."""
    config = tmp_path / "config.toml"
    config.write_text('[storage.s3]\nendpoint_url = "http://127.0.0.1:9"\n', encoding="utf-8")
    imported = _run("""
        import fastload
        from fastload.sources import is_store_url, schemes
        from fastload.sources.base import site_options
        assert is_store_url("s3://bucket/key") and "gs" in schemes()
        assert "fastload.sources.objstore" not in sys.modules
        assert site_options("s3") == {"endpoint_url": "http://127.0.0.1:9"}
        heavy = {"Mix", "Monitor", "PackResult", "PackedBatch", "ShardIndexDataset",
                 "ShardIterableDataset", "ShardWriter", "Stream", "collate",
                 "decode_images", "monitor", "pack", "pack_dataset", "register_encoder",
                 "to_device"}
        for name in sorted(set(fastload.__all__) - heavy):
            assert getattr(fastload, name) is not None, name
        from fastload import __version__, probe, resolve, stage
        assert __version__ == fastload.__version__ and isinstance(__version__, str)
        assert fastload.probe is probe and fastload.resolve is fastload.env.resolve
        assert fastload.stage is fastload.staging.stage is stage
        assert fastload.sources.ObjectStore.__name__ == "ObjectStore"
        from pathlib import Path
        assert fastload.staging.archive_compression(Path("/nonexistent.tar")) is None
        try:
            fastload.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError("fastload.no_such_name")
    """, FASTLOAD_CONFIG=str(config))
    for name in ("fastload.sources.objstore", "fastload.probing", "fastload.env",
                 "importlib.metadata"):  # fmt: skip
        assert name in imported


def test_the_object_stores_import_asyncio_only_for_small_objects() -> None:
    """A prefix of big objects, an archive in a store, the shard cache: no event loop,
    so no asyncio (SmallGets imports it where it has a small object to fetch)."""
    imported = _run("""
        import fastload.cache, fastload.sources.objstore, fastload.staging.remote
    """)
    assert "fastload.staging.fetch" in imported
    assert _reached(imported, ("asyncio", "importlib.metadata", "email")) == []
