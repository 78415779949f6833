"""Processes, sockets and signals: one worker in-process, or a supervisor with N workers.

Each worker is a whole server (event loop, hypercorn, StaticApp) on its own listening socket.
With several workers those sockets share the port through SO_REUSEPORT, so the kernel balances
connections evenly (bench/bench_serve.py prints each worker's CPU share). Hypercorn's built-in
multi-worker mode shares one socket instead; issue 6 saw one worker take all 64 connections.

Shutdown: SIGINT or SIGTERM makes a worker stop accepting, finish in-flight responses (up to
`graceful_timeout`), close, and exit 0 without a traceback. The supervisor forwards the signal
and waits for its workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import h2.connection
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Sockets

from . import connection
from .app import AppSettings, StaticApp
from .certs import CertSettings, ensure_local_certificates
from .files import FileSettings
from .headers import HeaderSettings
from .tls import HardenedConfig, TLSSettings, bind_listener, build_ssl_context


@dataclass(frozen=True)
class ServerSettings:
    """Listening, process and connection-level limits."""

    # Loopback by default: putting the server on a network is a decision, not an accident.
    host: str = "127.0.0.1"
    port: int = 8443  # 0 picks a free port (printed at start)
    # Worker processes. Python serves on one core per process, so one per core (up to 4) is
    # what helps; more only adds switching. Each keeps its own cache.
    workers: int = field(default_factory=lambda: min(4, len(os.sched_getaffinity(0))))
    # Seconds a connection may go without a complete request head: closes idle keep-alive
    # connections and slowloris clients that trickle header bytes to hold a socket.
    idle_timeout: float = 5.0
    # Seconds without a byte from the client while a request is open. It also bounds a client
    # that stops reading a response. Cost: an HTTP/1.1 download longer than this is cut; the
    # site's files take milliseconds.
    read_timeout: float = 30.0
    # Seconds in-flight responses get to finish after SIGINT/SIGTERM before connections drop.
    graceful_timeout: float = 5.0
    # HTTP/1.1: bytes of an incomplete request head buffered before 431 (h11's limit; complete
    # heads are checked by the app against AppSettings.max_header_bytes).
    max_header_bytes: int = 16 * 1024
    # HTTP/2 streams open at once per connection (SETTINGS_MAX_CONCURRENT_STREAMS). Browsers
    # need tens; each open stream costs a task and buffers.
    h2_max_concurrent_streams: int = 64
    # HTTP/2 decoded header list ceiling (SETTINGS_MAX_HEADER_LIST_SIZE). Up to this the app
    # answers 431; beyond it the HTTP/2 layer resets the connection (RFC 9113 10.5.1).
    h2_max_header_list_size: int = 128 * 1024
    # Largest HTTP/2 frame accepted: the RFC minimum, so one frame cannot make us buffer much.
    h2_max_inbound_frame_size: int = 16 * 1024
    # Requests (HTTP/2: streams, reset ones included) per connection before it is closed.
    # Bounds HTTP/2 "rapid reset" floods (CVE-2023-44487) on one connection.
    max_requests_per_connection: int = 1000
    # Pending connections the kernel queues per socket (capped by net.core.somaxconn).
    backlog: int = 1024
    # Optional plain-HTTP listener that only redirects to HTTPS (see AppSettings.redirect_host).
    redirect_port: int | None = None
    # One access-log line per request on stderr. Off by default: formatting and writing a line
    # is CPU on the hot path of every request, and a static site needs no log of its readers.
    access_log: bool = False
    # How often a worker checks that its certificate is fresh, and reloads renewed files.
    cert_check_seconds: float = 6 * 3600


@dataclass(frozen=True)
class Plan:
    """Everything one worker needs, frozen before the workers are forked."""

    server: ServerSettings
    files: FileSettings
    headers: HeaderSettings
    app: AppSettings
    tls: TLSSettings
    certs: CertSettings | None  # None with --cert/--key: those are reloaded when changed


# --- startup checks ----------------------------------------------------------------------


class StartupError(Exception):
    """Bad configuration or environment, reported in one line and exit status 1."""


def check_tls(tls: TLSSettings) -> None:
    """Build one context now, so a bad certificate fails at start, naming the file."""
    try:
        build_ssl_context(tls)
    except (OSError, ssl.SSLError) as error:
        raise StartupError(
            f"cannot load certificate {tls.certfile} with key {tls.keyfile}: {error}"
        ) from error


def reserve_port(host: str, port: int) -> tuple[int, socket.socket]:
    """Prove the port free, then hold it for our workers only.

    The first bind is without SO_REUSEPORT, so a stale copy of this server (which holds the
    port with SO_REUSEPORT) is detected instead of silently sharing traffic with us. The kept,
    never-listening socket reserves the port for SO_REUSEPORT sockets of this user.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as error:
            raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from error
        port = probe.getsockname()[1]
    holder = socket.socket(family, socket.SOCK_STREAM)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        holder.bind((host, port))
    except OSError as error:
        holder.close()
        raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from error
    return port, holder


def bind_sockets(server: ServerSettings) -> Sockets:
    reuse = server.workers > 1
    secure = [_listen(server.host, server.port, reuse, server.backlog)]
    insecure = []
    if server.redirect_port is not None:
        insecure.append(_listen(server.host, server.redirect_port, reuse, server.backlog))
    return Sockets(secure_sockets=secure, insecure_sockets=insecure, quic_sockets=[])


def _listen(host: str, port: int, reuse_port: bool, backlog: int) -> socket.socket:
    try:
        return bind_listener(host, port, reuse_port, backlog)
    except OSError as error:
        raise StartupError(f"cannot listen on {host}:{port}: {error.strerror}") from error


# --- one worker --------------------------------------------------------------------------


def make_config(plan: Plan, sockets: Sockets) -> HardenedConfig:
    s = plan.server
    config = HardenedConfig(plan.tls, sockets)
    config.include_server_header = False  # no banner: it only helps someone matching exploits
    config.keep_alive_timeout = s.idle_timeout
    config.read_timeout = s.read_timeout  # type: ignore[assignment]  # used as a float
    config.graceful_timeout = s.graceful_timeout
    config.h11_max_incomplete_size = s.max_header_bytes
    config.h2_max_concurrent_streams = s.h2_max_concurrent_streams
    config.h2_max_header_list_size = s.h2_max_header_list_size
    # hypercorn advertises the setting, but h2's HPACK decoder only adopts it once the client
    # ACKs our SETTINGS; a request sent before that (curl does) meets this class default. The
    # same value both ways, so a 64 KiB header gets the app's 431, not a reset connection.
    h2.connection.H2Connection.DEFAULT_MAX_HEADER_LIST_SIZE = s.h2_max_header_list_size
    config.h2_max_inbound_frame_size = s.h2_max_inbound_frame_size
    config.keep_alive_max_requests = s.max_requests_per_connection
    config.backlog = s.backlog
    config.accesslog = "-" if s.access_log else None
    config.errorlog = "-"
    config.loglevel = "WARNING"
    config.workers = 1  # each worker process is a whole hypercorn; we manage the processes
    return config


def run_worker(plan: Plan, sockets: Sockets | None = None) -> int:
    """Serve until SIGINT/SIGTERM; the body of every worker process (and of the only one)."""
    if sockets is None:
        sockets = bind_sockets(plan.server)
    app = StaticApp(plan.files, plan.headers, plan.app)
    config = make_config(plan, sockets)
    connection.install()
    stopper = Stopper()
    # Installed before asyncio.run, which then leaves SIGINT alone (no KeyboardInterrupt).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stopper.request)
    try:
        asyncio.run(_serve_until_signalled(app, config, plan, stopper))
    finally:
        # Exiting now: a second Ctrl-C during interpreter shutdown must not print a traceback.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
    return 0


class Stopper:
    """Turns SIGINT/SIGTERM into an asyncio event, from a plain signal handler.

    Not loop.add_signal_handler: asyncio restores the default handlers when the loop closes,
    and a signal in that window either raised KeyboardInterrupt or hit a closed wakeup fd
    ("Bad file descriptor"). This handler stays valid before, during and after the loop.
    Repeated signals while draining change nothing: graceful_timeout bounds the drain.

    Python runs the handler only when the main thread runs bytecode. A signal taken by another
    thread (asyncio.to_thread's, for the certificate check), or one landing just before the
    loop enters epoll_wait, would otherwise wait for the next timer or byte, and an idle worker
    may have neither for hours. So while the loop runs, the signal also writes a byte to a
    socket the loop watches (signal.set_wakeup_fd), which wakes it.
    """

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None
        self.requested = False
        self._wakeup: tuple[socket.socket, socket.socket] | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """Call in the main thread, from inside the running loop; `detach` before it closes."""
        self.loop, self.event = loop, asyncio.Event()
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        loop.add_reader(reader.fileno(), _drain, reader)
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)
        if self.requested:
            self.event.set()
        return self.event

    def detach(self) -> None:
        if self._wakeup is None or self.loop is None:
            return
        signal.set_wakeup_fd(-1)  # before the close: a late signal must not hit a closed fd
        reader, writer = self._wakeup
        self.loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
        self._wakeup = None

    def request(self, signum: int, frame: object) -> None:
        self.requested = True
        loop, event = self.loop, self.event
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)


def _drain(sock: socket.socket) -> None:
    """Empty the wakeup socket; the signal's own handler has run by the time this does."""
    with contextlib.suppress(BlockingIOError):
        while sock.recv(4096):
            pass


async def _serve_until_signalled(
    app: StaticApp, config: HardenedConfig, plan: Plan, stopper: Stopper
) -> None:
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(_quiet_client_teardown)
    stop = stopper.attach(loop)
    refresher = asyncio.create_task(_keep_certificate_fresh(config, plan))
    try:
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait, mode="asgi")
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher
        stopper.detach()


def _quiet_client_teardown(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Drop asyncio's report of a connection the client tore down mid-TLS; report all else.

    A client that keeps sending after we answered 431 and closed (or that resets mid-handshake)
    makes hypercorn's close path raise SSLError, and CPython 3.11's sslproto an AttributeError.
    The connection is already gone; logging a traceback per such connection would let any
    client flood our log.
    """
    error = context.get("exception")
    if error is not None and _is_client_teardown(error):
        return
    if isinstance(error, asyncio.CancelledError):
        # A connection still open when the graceful timeout ends is cancelled, and CPython
        # 3.11's asyncio.streams then calls task.exception() on that cancelled task from a
        # callback. The cancellation is ours and intended; there is nothing to report.
        return
    loop.default_exception_handler(context)


def _is_client_teardown(error: BaseException) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return all(_is_client_teardown(e) for e in error.exceptions)
    if isinstance(error, ssl.SSLError | ConnectionError | TimeoutError):
        return True
    if isinstance(error, AttributeError):
        # Only the known CPython 3.11 bug: resume_reading() after the SSL protocol was detached.
        frames = traceback.extract_tb(error.__traceback__)
        return bool(frames) and frames[-1].filename.endswith(os.path.join("asyncio", "sslproto.py"))
    return False


async def _keep_certificate_fresh(config: HardenedConfig, plan: Plan) -> None:
    """Renew the local leaf when it nears expiry, and load changed certificate files.

    The live SSLContext takes the new chain for new handshakes; open connections keep theirs.
    With --cert/--key this picks up a renewal done by an outside tool (certbot, for example).
    """
    loaded = _file_stamps(plan.tls)
    while True:
        await asyncio.sleep(plan.server.cert_check_seconds)
        try:
            if plan.certs is not None:
                await asyncio.to_thread(ensure_local_certificates, plan.certs)
            stamps = _file_stamps(plan.tls)
            if stamps != loaded and config.ssl_context is not None:
                config.ssl_context.load_cert_chain(str(plan.tls.certfile), str(plan.tls.keyfile))
                loaded = stamps
                print(f"serve: loaded renewed certificate {plan.tls.certfile}", file=sys.stderr)
        except (OSError, ssl.SSLError, ValueError) as error:
            # Keep serving the current certificate; the next check tries again.
            print(f"serve: certificate refresh failed: {error}", file=sys.stderr)


def _file_stamps(tls: TLSSettings) -> tuple[int, ...]:
    try:
        return tuple(os.stat(p).st_mtime_ns for p in (tls.certfile, tls.keyfile))
    except OSError:
        return ()


def _worker_process_main(plan: Plan, supervisor: int) -> None:
    """Entry point of a forked worker. SIGINT arrives ignored (see supervise) until serving."""
    _exit_with_parent(supervisor)
    try:
        sys.exit(run_worker(plan))
    except StartupError as error:
        print(f"serve: worker {os.getpid()}: {error}", file=sys.stderr)
        sys.exit(1)


def _exit_with_parent(supervisor: int) -> None:
    """Ask Linux for SIGTERM when the supervisor dies, even by SIGKILL: no orphan keeps the port."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != supervisor:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


# --- the supervisor ------------------------------------------------------------------------


def supervise(plan: Plan) -> int:
    """Start `workers` processes on one port, forward shutdown signals, and wait for them."""
    port, holder = reserve_port(plan.server.host, plan.server.port)
    holders = [holder]
    server = replace(plan.server, port=port)
    if server.redirect_port is not None:
        redirect_port, redirect_holder = reserve_port(server.host, server.redirect_port)
        holders.append(redirect_holder)
        server = replace(server, redirect_port=redirect_port)
    plan = replace(plan, server=server, app=replace(plan.app, redirect_https_port=port))
    announce(plan)
    # fork: workers start in milliseconds and share the parent's imported code. Safe here: the
    # supervisor has started no threads and no event loop.
    context = multiprocessing.get_context("fork")
    # Workers inherit "ignore SIGINT" so a Ctrl-C during their start cannot print a traceback;
    # each installs its own handler once serving.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    workers = [
        context.Process(target=_worker_process_main, args=(plan, os.getpid()))
        for _ in range(server.workers)
    ]
    for worker in workers:
        worker.start()
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for worker in workers:
            if worker.pid is not None and worker.exitcode is None:
                os.kill(worker.pid, signal.SIGTERM)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        status = _wait_for_workers(workers, plan.server.graceful_timeout, lambda: stopping, stop)
    finally:
        # Exiting now: a late signal must not interrupt the exit with a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for sock in holders:
            sock.close()
    return status


def _wait_for_workers(
    workers: list[multiprocessing.process.BaseProcess],
    grace: float,
    is_stopping: Callable[[], bool],
    stop: Callable[[int, object], None],
) -> int:
    """Block until all workers exit; one dying on its own takes the others down with it."""
    status = 0
    alive = list(workers)
    while alive:
        multiprocessing.connection.wait([w.sentinel for w in alive])
        for worker in [w for w in alive if w.exitcode is not None]:
            alive.remove(worker)
            if worker.exitcode != 0 and not is_stopping():
                print(f"serve: worker {worker.pid} exited with {worker.exitcode}", file=sys.stderr)
                status = 1
                stop(signal.SIGTERM, None)
    for worker in workers:
        worker.join(grace + 5)
        if worker.exitcode is None:
            worker.kill()
    return status


def announce(plan: Plan) -> None:
    """The one line a user (and the test fixture) reads to find the server."""
    s = plan.server
    host = f"[{s.host}]" if ":" in s.host else s.host
    workers = f"{s.workers} worker{'s' if s.workers != 1 else ''}"
    line = f"serve: https://{host}:{s.port}/ serving {plan.files.root} (TLS 1.3, h2, {workers})"
    if s.redirect_port is not None:
        line += f"; http://{host}:{s.redirect_port}/ redirects to https://{plan.app.redirect_host}"
    print(line, file=sys.stderr, flush=True)


def serve_plan(plan: Plan) -> int:
    """Run the plan: in this process for one worker, under a supervisor for more."""
    check_tls(plan.tls)
    # `kill -USR1 PID` prints that process's Python stack to stderr and serving goes on: how to
    # see where a stuck worker is. Forked workers inherit the handler.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if plan.server.workers > 1:
        return supervise(plan)
    sockets = bind_sockets(plan.server)
    port = sockets.secure_sockets[0].getsockname()[1]
    server = plan.server
    if server.redirect_port is not None:
        server = replace(server, redirect_port=sockets.insecure_sockets[0].getsockname()[1])
    plan = replace(
        plan, server=replace(server, port=port), app=replace(plan.app, redirect_https_port=port)
    )
    announce(plan)
    return run_worker(plan, sockets)


# --- build.py as a child -----------------------------------------------------------------


# build.py's mark on the live page it publishes until the site exists (build.BUILDING_MARK)
BUILDING_MARK = ".building"
FIRST_PAGE_S = 10.0  # how long to wait for build.py's first building page before giving up


def needs_first_build(root: Path) -> bool:
    """No site yet: a fresh clone, or a build that never finished publishing one."""
    return not root.exists() or (root / BUILDING_MARK).exists()


@contextlib.contextmanager
def build_child(
    project_root: Path, root: Path, *, first: bool, watch: bool, extra: Sequence[str] = ()
) -> Iterator[None]:
    """build.py as a child for the server's lifetime; it publishes, we serve.

    `first`: there is no site, so the build publishes a live building page (within a second or
    two) and then the site, by the same atomic swap; only that first page is waited for, so a
    reader gets an answer at once. A failed build leaves its error on that page. `watch`: the
    child keeps rebuilding on every change. `extra` goes to build.py as is.
    """
    args = [*(["--watch"] if watch else []), *(["--building-page"] if first else []), *extra]
    if not (first or watch):
        yield
        return
    if first:
        print("serve: no site yet; build.py builds it, and the page shows how far it is",
              file=sys.stderr, flush=True)  # fmt: skip
    child = subprocess.Popen([sys.executable, "build.py", *args], cwd=project_root)
    try:
        if first:
            _wait_for_first_page(child, root)
        yield
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def _wait_for_first_page(child: subprocess.Popen[bytes], root: Path) -> None:
    deadline = time.monotonic() + FIRST_PAGE_S
    while not (root / "index.html").is_file():
        if child.poll() is not None:
            raise StartupError(
                f"build.py exited with status {child.returncode} before publishing a page; "
                "nothing to serve (its error is above)"
            )
        if time.monotonic() > deadline:
            raise StartupError(f"build.py published no page within {FIRST_PAGE_S:g} s")
        time.sleep(0.05)
