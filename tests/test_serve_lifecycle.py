"""The server's life: start-up checks, build-first, --watch's child, graceful signals, and
atomic site swaps (in-flight requests finish on the old build, new ones see the new build)."""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest
from conftest import build_module
from serve_support import (
    BIG_SIZE,
    REPO,
    Server,
    get,
    make_site,
    read_reply,
    seconds_until_closed,
    start_paused_download,
    start_server,
    tls_connect,
)

from serve import connection
from serve.__main__ import ensure_site
from serve.server import BUILDING_MARK, StartupError, build_child


def run_cli(*args: str, state: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "K3SERVE_STATE": str(state)}
    return subprocess.run(
        [sys.executable, "-m", "serve", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# --- start-up: fail loudly, in one line, naming the problem ------------------------------------


def test_missing_root_fails_naming_it(tmp_path: Path) -> None:
    result = run_cli("--root", str(tmp_path / "nowhere"), "--port", "0", state=tmp_path / "s")
    assert result.returncode == 1
    assert f"site root {tmp_path / 'nowhere'} does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_certificate_fails_naming_it(tmp_path: Path) -> None:
    site = make_site(tmp_path)
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate\n")
    args = ("--root", str(site.root), "--port", "0", "--cert", str(cert), "--key", str(cert))
    result = run_cli(*args, state=tmp_path / "s")
    assert result.returncode == 1
    assert f"cannot load certificate {cert}" in result.stderr
    assert "Traceback" not in result.stderr


def test_port_in_use_fails_naming_it(tmp_path: Path) -> None:
    site = make_site(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for workers in ("1", "2"):
            args = ("--root", str(site.root), "--port", str(port), "--workers", workers)
            result = run_cli(*args, state=tmp_path / "s")
            assert result.returncode == 1, workers
            assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
            assert "Traceback" not in result.stderr


def _stub_project(tmp_path: Path, script: str) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "build.py").write_text(script)
    return project


def test_missing_site_is_built_first_and_served_from_its_first_page(tmp_path: Path) -> None:
    project = _stub_project(
        tmp_path,
        # Published whole, by one rename, as build.py publishes: the server may look at any time.
        "import os, pathlib, sys, time\nstage = pathlib.Path('stage')\nstage.mkdir()\n"
        "pathlib.Path('argv').write_text(' '.join(sys.argv[1:]))\n"
        "(stage / '.building').write_text('')\n(stage / 'index.html').write_text('x')\n"
        "os.rename(stage, 'public')\ntime.sleep(600)\n",
    )
    public = project / "public"
    assert ensure_site(public, project) is True
    with build_child(project, public, first=True, watch=False, extra=["--jobs=1"]):
        # served as soon as the first page is there, while the build goes on
        assert (public / "index.html").read_text() == "x"
        assert (project / "argv").read_text() == "--building-page --jobs=1"
        assert ensure_site(public, project) is True  # a building page is not a site yet
    (public / ".building").unlink()
    assert ensure_site(public, project) is False


def test_a_build_that_publishes_nothing_is_a_clear_error(tmp_path: Path) -> None:
    project = _stub_project(tmp_path, "import sys\nsys.exit(3)\n")
    failed = pytest.raises(
        StartupError, match=r"build\.py exited with status 3 before publishing a page"
    )
    with failed, build_child(project, project / "public", first=True, watch=False):
        pass


def test_explicit_root_is_never_built(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="does not exist"):
        ensure_site(tmp_path / "elsewhere", None)


def test_watch_runs_build_watch_and_stops_it(tmp_path: Path) -> None:
    project = _stub_project(
        tmp_path,
        "import sys, time, pathlib\npathlib.Path('argv').write_text(' '.join(sys.argv[1:]))\n"
        "time.sleep(600)\n",
    )
    # only the children this test starts: a test before it may leave its own (multiprocessing's
    # resource tracker, which a Dask LocalCluster starts, lives as long as this process)
    before = set(_children(os.getpid()))
    with build_child(project, project / "public", first=False, watch=True):
        argv = project / "argv"
        deadline = time.monotonic() + 20
        # the stub creates the file, then writes it: an empty file is not its answer yet
        while not (argv.exists() and argv.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert argv.read_text() == "--watch"
        children = [pid for pid in _children(os.getpid()) if pid not in before]
        assert children
    for pid in children:
        assert not _alive(pid), "build.py --watch outlived the server"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


# --- graceful shutdown ---------------------------------------------------------------------


def _finish_download(sock: socket.socket, first: bytes) -> bytes:
    data = first
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data.partition(b"\r\n\r\n")[2]) >= BIG_SIZE:
            break
    sock.close()
    return data.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_finishes_in_flight_and_exits_cleanly(
    tmp_path: Path, signum: int, workers: int
) -> None:
    site = make_site(tmp_path)
    server = start_server(site.root, tmp_path / "state", workers=workers)
    assert get(server, "/").status == 200
    sock, first = start_paused_download(server)
    server.process.send_signal(signum)
    time.sleep(0.5)  # the server is now draining; the download is still in flight
    try:
        body = _finish_download(sock, first)
    except OSError as error:
        raise AssertionError(f"download: {error!r}; server log:\n{server.stop()[1]}") from error
    code, stderr = server.stop(signum)
    # Every message carries the server's log: this test has failed rarely under load, and a
    # bare assertion would not say why.
    assert len(body) == BIG_SIZE, f"{len(body)} of {BIG_SIZE} bytes; server log:\n{stderr}"
    assert set(body) == {ord("A")}, stderr
    assert code == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert "Error" not in stderr, stderr
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_shutdown_closes_each_keep_alive_connection_once_it_is_idle(tmp_path: Path) -> None:
    """Idle at the signal: closed at once. Busy: closed as soon as its response is done. The
    idle timeout (5 s) and graceful timeout (5 s) are both far longer than the bound."""
    site = make_site(tmp_path)
    server = start_server(site.root, tmp_path / "state")
    try:
        with tls_connect(server) as idle:
            idle.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert read_reply(idle, head_only=False).status == 200
            busy, first = start_paused_download(server)
            with busy:
                server.process.send_signal(signal.SIGTERM)
                assert seconds_until_closed(idle, None, 30) < 2
                body = first.partition(b"\r\n\r\n")[2]
                while len(body) < BIG_SIZE:
                    body += busy.recv(65536)
                assert seconds_until_closed(busy, None, 30) < 2
    finally:
        code, stderr = server.stop()
    assert code == 0, stderr


def test_a_client_that_stops_reading_cannot_hold_up_shutdown(tmp_path: Path) -> None:
    """Past the graceful timeout the response is dropped, and the TLS goodbye is bounded too."""
    site = make_site(tmp_path)
    server = start_server(site.root, tmp_path / "state", "--graceful-timeout", "1")
    sock, _ = start_paused_download(server)
    with sock:
        start = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        try:
            code = server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            raise
        elapsed = time.monotonic() - start
    stderr = server.stop()[1]
    assert code == 0 and "Traceback" not in stderr, stderr
    # graceful 1 s + TLS goodbye 2 s + slack; asyncio alone waits 30 s for the goodbye.
    assert elapsed < 1 + connection.TLS_GOODBYE_SECONDS + 3


def _start_h2_download(sock: ssl.SSLSocket) -> h2.connection.H2Connection:
    """GET /big.bin on stream 1; the flow-control window holds the response after 64 KiB."""
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2c.initiate_connection()
    request = [(b":method", b"GET"), (b":path", b"/big.bin"), (b":scheme", b"https")]
    h2c.send_headers(1, [*request, (b":authority", b"localhost")], end_stream=True)
    sock.sendall(h2c.data_to_send())
    started = False
    while not started:  # every byte goes through h2c: the server's SETTINGS come first
        events = h2c.receive_data(sock.recv(65536))
        started = any(isinstance(e, h2.events.ResponseReceived) for e in events)
        sock.sendall(h2c.data_to_send())
    return h2c


def _finish_h2_download(sock: ssl.SSLSocket, h2c: h2.connection.H2Connection) -> int:
    body, ended = 0, False
    while not ended:
        data = sock.recv(65536)
        assert data, "closed before the response was whole"
        for event in h2c.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                body += len(event.data)
                h2c.acknowledge_received_data(event.flow_controlled_length, 1)
            ended = ended or isinstance(event, h2.events.StreamEnded)
        sock.sendall(h2c.data_to_send())
    return body


def test_shutdown_closes_an_http2_connection_once_its_last_stream_is_done(tmp_path: Path) -> None:
    """HTTP/2 says goodbye with GOAWAY and leaves the close to the server. A client may still
    send after the server's TLS close_notify (late WINDOW_UPDATEs): the second connection makes
    that race certain with a PING, and the worker must still exit cleanly."""
    site = make_site(tmp_path)
    server = start_server(site.root, tmp_path / "state")
    try:
        with tls_connect(server, alpn=("h2",)) as quiet, tls_connect(server, alpn=("h2",)) as late:
            downloads = [(quiet, _start_h2_download(quiet)), (late, _start_h2_download(late))]
            server.process.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert _finish_h2_download(*downloads[0]) == BIG_SIZE
            assert seconds_until_closed(quiet, None, 30) < 2
            assert _finish_h2_download(*downloads[1]) == BIG_SIZE
            time.sleep(0.3)  # the server has sent GOAWAY and its close_notify by now
            late.sendall(b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"8 bytes!")  # PING
            assert seconds_until_closed(late, None, 30) < 2
    finally:
        code, stderr = server.stop()
    assert code == 0, stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_sigusr1_prints_each_process_stack_and_serving_goes_on(
    tmp_path: Path, workers: int
) -> None:
    site = make_site(tmp_path)
    server = start_server(site.root, tmp_path / "state", workers=workers)
    try:
        stacks = server.dump_stacks()
        assert stacks.count("Current thread") == workers + (workers > 1), stacks
        assert "serve/server.py" in stacks
        assert get(server, "/").status == 200
    finally:
        code, stderr = server.stop()
    assert code == 0, stderr


# The signal reaches a thread other than the main one: its mask blocks SIGTERM. Python still
# runs the handler in the main thread, but only once that thread runs bytecode; the loop below
# has nothing else to wake it for 20 s.
_SIGNAL_IN_ANOTHER_THREAD = """
import asyncio, os, signal, sys, threading, time
from serve.server import Stopper

stopper = Stopper()
signal.signal(signal.SIGTERM, stopper.request)

def send_later() -> None:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGTERM)

async def main() -> float:
    event = stopper.attach(asyncio.get_running_loop())
    threading.Thread(target=send_later).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    start = time.monotonic()
    await asyncio.wait_for(event.wait(), 20)
    stopper.detach()
    return time.monotonic() - start

waited = asyncio.run(main())
print(f"{waited:.3f} {signal.set_wakeup_fd(-1)}")
"""


def test_a_signal_taken_by_another_thread_still_stops_the_loop() -> None:
    """The certificate check's thread can take SIGTERM; the worker must still stop at once."""
    out = subprocess.run(
        [sys.executable, "-c", _SIGNAL_IN_ANOTHER_THREAD],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    waited, wakeup_fd_after_detach = float(out[0]), int(out[1])
    assert waited < 5, f"the loop slept {waited:.1f} s on a pending SIGTERM"
    assert wakeup_fd_after_detach == -1


# --- atomic swaps: a request sees one build, whole -----------------------------------------


def _publish(link: Path, target: Path) -> None:
    """What build.py does: a new symlink renamed over the old one."""
    fresh = link.with_name(link.name + ".new")
    fresh.symlink_to(target)
    os.replace(fresh, link)


@pytest.fixture()
def two_builds(tmp_path: Path) -> tuple[Path, Path, Path]:
    a = make_site(tmp_path / ".public" / "build-A", "A").root
    b = make_site(tmp_path / ".public" / "build-B", "B").root
    link = tmp_path / "public"
    link.symlink_to(a)
    return link, a, b


def test_in_flight_request_finishes_on_the_old_build(
    tmp_path: Path, two_builds: tuple[Path, Path, Path]
) -> None:
    link, a, b = two_builds
    server = start_server(link, tmp_path / "state")
    try:
        sock, first = start_paused_download(server)
        _publish(link, b)
        shutil.rmtree(a.parent)  # build.py deletes old builds after a grace period
        assert b"build B" in get(server, "/").body
        assert set(get(server, "/big.bin").body) == {ord("B")}
        body = _finish_download(sock, first)
        assert len(body) == BIG_SIZE and set(body) == {ord("A")}
    finally:
        code, stderr = server.stop()
    assert code == 0 and "Traceback" not in stderr


def test_no_response_mixes_two_builds(tmp_path: Path, two_builds: tuple[Path, Path, Path]) -> None:
    link, a, b = two_builds
    whole = {
        "/": {(s / "index.html").read_bytes() for s in (a, b)},
        "/nope": {(s / "404.html").read_bytes() for s in (a, b)},
    }
    server = start_server(link, tmp_path / "state")
    stop = threading.Event()

    def swap_forever() -> None:
        while not stop.is_set():
            for target in (b, a):
                _publish(link, target)
                time.sleep(0.002)

    swapper = threading.Thread(target=swap_forever)
    swapper.start()
    seen: set[bytes] = set()
    try:
        with tls_connect(server) as sock:  # one keep-alive connection, many requests
            for i in range(150):
                path = "/" if i % 2 else "/nope"
                sock.sendall(
                    f"GET {path} HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n".encode()
                )
                reply = read_reply(sock, head_only=False)
                body = gzip.decompress(reply.body)
                assert body in whole[path], body[:80]  # one build's page, byte for byte
                seen.add(body)
    finally:
        stop.set()
        swapper.join()
        server.stop()
    assert len(seen) >= 3, "the swaps were never observed; the test proved nothing"


# --- certificates renewed while running, and workers that outlive nothing ---------------


def _served_serial(server: Server) -> int:
    from cryptography import x509

    with tls_connect(server) as sock:
        der = sock.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_running_server_renews_and_loads_its_leaf(tmp_path: Path) -> None:
    from cryptography import x509

    site = make_site(tmp_path)
    state = tmp_path / "state"
    server = start_server(site.root, state, "--cert-check-interval", "0.3")
    try:
        before = _served_serial(server)
        (state / "leaf.pem").unlink()  # lost, or expired: the periodic check makes a new one
        (state / "leaf.key").unlink()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _served_serial(server) == before:
            time.sleep(0.2)
        current = x509.load_pem_x509_certificate((state / "leaf.pem").read_bytes())
        assert _served_serial(server) == current.serial_number != before
    finally:
        code, stderr = server.stop()
    assert code == 0 and "Traceback" not in stderr


def test_workers_exit_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    site = make_site(tmp_path)
    server = start_server(site.root, tmp_path / "state", workers=2)
    workers = _children(server.process.pid)
    assert len(workers) == 2
    server.process.kill()  # SIGKILL: the supervisor cannot forward anything
    server.process.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "orphaned workers kept serving"


def test_serve_and_build_agree_on_the_building_mark() -> None:
    # two processes share this name: build.py writes it, serve reads it
    assert build_module().BUILDING_MARK == BUILDING_MARK
