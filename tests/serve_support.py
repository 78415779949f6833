"""Shared helpers for the serve tests: a planted site tree, a server subprocess, raw clients.

Everything talks to loopback only. Servers run as `python -m serve --root <tmp> --port 0` with a
temporary K3SERVE_STATE, and announce their port on stderr; the helpers read it from there.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events

REPO = Path(__file__).resolve().parent.parent
SECRET = "K3-SECRET-7f3a9c-never-served"  # planted outside the site; no response may contain it
FINGERPRINTED_CSS = "/assets/css/site.0123456789.css"
BIG_SIZE = 3 * 1024 * 1024  # larger than the body cache's per-file limit: streamed from its fd
FINAL_H2_EVENTS = (h2.events.StreamEnded, h2.events.StreamReset, h2.events.ConnectionTerminated)
READY = re.compile(r"serve: https://\[?([0-9a-f.:]+)\]?:(\d+)/")


def require_tool(name: str) -> str:
    """The path of a tool the bootstrap installs; a missing one fails the test, never skips it."""
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name!r} is not installed: run `bash tests/bootstrap.sh`")
    return path


# --- the site tree -----------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    root: Path  # the served folder (public/ of the test)
    secret: Path  # beside it, never reachable


def write_with_sidecar(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    Path(f"{path}.gz").write_bytes(gzip.compress(data, mtime=0))


def make_site(base: Path, label: str = "A") -> Site:
    """A small published site under base/public with every kind of file the server meets.

    `label` is written into every page, so two builds (A and B) are told apart byte for byte.
    """
    root = base / "public"
    root.mkdir(parents=True)
    page = f"<!doctype html><title>{label}</title><p>build {label}</p>\n".encode()
    write_with_sidecar(root / "index.html", page * 20)
    write_with_sidecar(root / "404.html", f"<!doctype html><p>missing ({label})</p>\n".encode())
    write_with_sidecar(root / FINGERPRINTED_CSS.lstrip("/"), b"body{color:#123}\n" * 40)
    write_with_sidecar(root / "innovations" / "kda" / "index.html", page)
    (root / "census.json").write_text(f'{{"build": "{label}"}}\n')
    (root / "notes.txt").write_text(f"plain text {label}\n")
    (root / "archive.gz").write_bytes(gzip.compress(b"a real gzip resource\n", mtime=0))
    (root / "empty-folder").mkdir()
    (root / "unicode é.txt").write_text("unicode name\n")
    (root / "big.bin").write_bytes(bytes([ord(label[0])]) * BIG_SIZE)
    secret = base / "secret.txt"
    secret.write_text(SECRET + "\n")
    _plant_traps(root, secret)
    return Site(root, secret)


def _plant_traps(root: Path, secret: Path) -> None:
    """Things that are inside the tree but must never be served."""
    (root / ".env").write_text(SECRET + "\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text(SECRET + "\n")
    (root / "link-out.txt").symlink_to(secret)  # a symlink leading outside
    (root / "dir-out").symlink_to(secret.parent)  # a symlinked folder leading outside
    (root / "link-in.txt").symlink_to(root / "notes.txt")  # a symlink inside: still refused
    os.mkfifo(root / "fifo")  # opening it blocking would hang a worker


# --- the server process ------------------------------------------------------------------


@dataclass
class Server:
    """A running `python -m serve`; `stop()` ends it and returns its stderr."""

    process: subprocess.Popen[bytes]
    port: int
    state: Path
    stderr_path: Path
    redirect_port: int | None = None
    ca: Path = field(init=False)

    def __post_init__(self) -> None:
        self.ca = self.state / "ca.pem"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 20) -> tuple[int, str]:
        if self.process.poll() is None:
            self.process.send_signal(signum)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            stacks = self.dump_stacks()
            self.process.kill()
            self.process.wait()
            raise AssertionError(
                f"server ignored signal {signum} for {timeout}s; its processes' stacks:\n{stacks}"
            ) from None
        return code, self.stderr()

    def dump_stacks(self) -> str:
        """SIGUSR1 to the server and its workers (faulthandler prints each Python stack)."""
        pid = self.process.pid
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            children = []
        for p in [pid, *map(int, children)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGUSR1)
        time.sleep(1)
        return self.stderr()[-6000:]


def start_server(
    root: Path, state: Path, *args: str, workers: int = 1, log: Path | None = None
) -> Server:
    """Start the server on a free port and wait until it completes a TLS handshake."""
    log = log or state.parent / f"serve-{time.monotonic_ns()}.log"
    env = {**os.environ, "K3SERVE_STATE": str(state), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "serve", "--root", str(root), "--port", "0"]
    command += ["--workers", str(workers), *args]
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=sink)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        match = READY.search(log.read_text(errors="replace"))
        if match:
            redirect = re.search(r"http://\S+?:(\d+)/ redirects", log.read_text())
            server = Server(process, int(match.group(2)), state, log)
            server.redirect_port = int(redirect.group(1)) if redirect else None
            _wait_for_handshake(server, deadline)
            return server
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{log.read_text()}")
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"server did not announce itself:\n{log.read_text()}")


def _wait_for_handshake(server: Server, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with tls_connect(server, alpn=("http/1.1",)):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"server never completed a handshake:\n{server.stderr()}")


@contextmanager
def running_server(root: Path, state: Path, *args: str, workers: int = 1) -> Iterator[Server]:
    server = start_server(root, state, *args, workers=workers)
    try:
        yield server
    finally:
        server.stop()


# --- clients -------------------------------------------------------------------------------


def client_context(ca: Path, alpn: tuple[str, ...] = ("http/1.1",)) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(list(alpn))
    return context


@contextmanager
def tls_connect(
    server: Server, alpn: tuple[str, ...] = ("http/1.1",), timeout: float = 10
) -> Iterator[ssl.SSLSocket]:
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    try:
        sock = client_context(server.ca, alpn).wrap_socket(raw, server_hostname="localhost")
    except BaseException:
        raw.close()
        raise
    with sock:
        yield sock


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names; repeated fields joined with ", "
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


def raw_request(server: Server, head: bytes, timeout: float = 10) -> Reply:
    """Send exact request bytes over TLS (HTTP/1.1) and read one response."""
    with tls_connect(server, timeout=timeout) as sock:
        sock.sendall(head)
        return read_reply(sock, head.split(b" ", 1)[0] == b"HEAD")


def get(
    server: Server, path: str | bytes, method: str = "GET", headers: dict[str, str] | None = None
) -> Reply:
    target = path if isinstance(path, bytes) else path.encode("utf-8")
    lines = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: localhost"]
    lines += [f"{k}: {v}".encode("latin-1") for k, v in (headers or {}).items()]
    lines += [b"Connection: close", b"", b""]
    return raw_request(server, b"\r\n".join(lines))


def read_reply(sock: ssl.SSLSocket, head_only: bool) -> Reply:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a full response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    status = int(status_line.split(" ")[1])
    length = 0 if head_only or status in (204, 304) else int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Reply(status, headers, body)


def h2_request(
    server: Server,
    path: bytes,
    method: bytes = b"GET",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> Reply:
    """One HTTP/2 request with exact :path bytes, through the h2 library (hypercorn's own)."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    status, response_headers, body = 0, {}, b""
    with tls_connect(server, alpn=("h2",)) as sock:
        assert sock.selected_alpn_protocol() == "h2"
        connection.initiate_connection()
        request = [(b":method", method), (b":path", path), (b":scheme", b"https")]
        request += [(b":authority", b"localhost"), *(headers or [])]
        connection.send_headers(1, request, end_stream=True)
        sock.sendall(connection.data_to_send())
        done = False
        while not done:
            data = sock.recv(65536)
            if not data:
                break
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    fields = dict(event.headers)
                    status = int(fields.pop(b":status"))
                    response_headers = {k.decode(): v.decode() for k, v in fields.items()}
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, FINAL_H2_EVENTS):
                    done = True
            sock.sendall(connection.data_to_send())
    return Reply(status, response_headers, body)


def curl(server: Server, path: str, *args: str) -> subprocess.CompletedProcess[str]:
    """curl over loopback, trusting the server's local CA."""
    url = f"https://localhost:{server.port}{path}"
    command = [require_tool("curl"), "-sS", "--cacert", str(server.ca), *args, url]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def s_client(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    """`openssl s_client` against the server: one handshake, then EOF on stdin.

    After an h2 handshake the server's binary SETTINGS frame may reach stdout, so the
    output is decoded with replacement rather than strictly.
    """
    command = [require_tool("openssl"), "s_client", "-connect", f"127.0.0.1:{server.port}"]
    command += ["-servername", "localhost", "-CAfile", str(server.ca), *args]
    return subprocess.run(
        command,
        input="",
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        timeout=30,
        check=False,
    )


def start_paused_download(
    server: Server, path: bytes = b"/big.bin", head: bytes = b""
) -> tuple[ssl.SSLSocket, bytes]:
    """A GET through a 16 KiB receive window, paused after the first bytes (big.bin: 3 MiB)."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    raw.connect(("127.0.0.1", server.port))
    sock = client_context(server.ca).wrap_socket(raw, server_hostname="localhost")
    sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: localhost\r\n" + head + b"\r\n")
    first = sock.recv(4096)
    assert first.startswith(b"HTTP/1.1 200")
    return sock, first


def seconds_until_closed(sock: socket.socket, trickle: bytes | None, limit: float) -> float:
    """Send `trickle` one byte every 0.2 s (or nothing) until the server closes; elapsed time."""
    start = time.monotonic()
    sock.settimeout(0.2)
    position = 0
    while time.monotonic() - start < limit:
        if trickle is not None:
            try:
                sock.sendall(trickle[position % len(trickle) : position % len(trickle) + 1])
                position += 1
            except OSError:
                return time.monotonic() - start
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
    raise AssertionError(f"connection still open after {limit:.1f}s")
