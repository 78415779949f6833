"""Load bench for `python -m serve`, against a naive ASGI handler and nginx, on the same files.

    python bench/bench_serve.py [--requests 20000] [--connections 64] [--workers 2]
    python bench/bench_serve.py --targets nginx,nginx-k3    # only the two nginx configurations

Every target serves one snapshot of the site (a copy of public/, or a small synthetic site when
there is no build) over TLS 1.3 on loopback:

    serve   python -m serve, --workers N (SO_REUSEPORT, each worker its own socket)
    serve1  python -m serve, one worker
    naive   hypercorn with its stock Config and an ASGI handler that reads the file per request
    ceiling hypercorn answering every request with one constant response from memory (two
            headers, no decisions), N processes on SO_REUSEPORT: the most any ASGI app served by
            hypercorn can reach here, so serve / ceiling is what our app costs and
            ceiling / nginx is how far the hypercorn design itself can go
    nginx   nginx, TLS 1.3 only, N worker processes, gzip_static: a minimal config, no policy
    nginx-k3
            nginx with `python -m serve --nginx-conf`'s configuration (serve/nginx.py): every
            header, check and rule of serve's policy, so nginx-k3 / nginx is what the policy
            costs in nginx (issue 19 aims for at least 0.9)

The targets are measured in --rounds rounds (default 3), in rotated order each round, so a
noisy machine's drift lands on every target alike; each ratio is printed as its median over the
rounds and its spread (min to max of the per-round ratios). Each run is bounded in count
(--requests, at --connections concurrent connections) and in time (--time-limit). wrk drives
HTTP/1.1: it runs for a duration, sized by a 2 s probe so the run reaches the count, and a Lua
script reports p99 and errors. h2load drives HTTP/2 for exactly the count (p99 from its
per-request log). It prints req/s, p99 and the ratios, and how evenly the serve workers shared
the CPU. It asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("serve", "serve1", "naive", "ceiling", "nginx", "nginx-k3")
URL_PATH = "/"  # the census page: index.html, about 10 KB, identity (no Accept-Encoding)

WRK_SCRIPT = """
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, ' ..
    '"status": %d, "timeout": %d, "p50_us": %d, "p99_us": %d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass
class Result:
    target: str
    protocol: str
    requests: int
    errors: int
    seconds: float
    p99_ms: float
    served: int = 0  # every request of the run, sizing probes included: what the CPU paid for
    cpu_seconds: float = 0.0  # the target's worker processes, over the whole run

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    @property
    def rate_per_cpu(self) -> float:
        """Requests per CPU second of the target: steadier than req/s on a shared machine."""
        return self.served / self.cpu_seconds if self.cpu_seconds else 0.0


# --- the naive baseline ------------------------------------------------------------------


def naive_server(root: Path, port: int, cert: Path, key: Path) -> None:
    """hypercorn's stock Config and the handler everyone writes first: read the file, send it."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        if scope["type"] != "http":
            return
        path = scope["path"] + ("index.html" if scope["path"].endswith("/") else "")
        try:
            body = (root / path.lstrip("/")).read_bytes()  # bench only: no containment checks
            status, kind = 200, b"text/html" if path.endswith(".html") else b"text/plain"
        except OSError:
            body, status, kind = b"not found", 404, b"text/plain"
        headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": body})  # type: ignore[operator]

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.certfile, config.keyfile = str(cert), str(key)
    config.accesslog = None
    asyncio.run(serve(app, config, mode="asgi"))  # type: ignore[arg-type]


def ceiling_server(root: Path, port: int, cert: Path, key: Path, workers: int) -> None:
    """The least ASGI app: one response, built once. Each forked process has its own socket."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    body = (root / "index.html").read_bytes()
    headers = [(b"content-type", b"text/html"), (b"content-length", str(len(body)).encode())]
    start = {"type": "http.response.start", "status": 200, "headers": headers}
    message = {"type": "http.response.body", "body": body}

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        if scope["type"] == "http":
            await send(start)  # type: ignore[operator]
            await send(message)  # type: ignore[operator]

    for _ in range(workers - 1):
        if os.fork() == 0:
            break
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.certfile, config.keyfile = str(cert), str(key)
    config.accesslog = None
    asyncio.run(serve(app, config, mode="asgi"))  # type: ignore[arg-type]


# --- starting the targets ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, process: subprocess.Popen[bytes], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"a bench target exited early with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listened on port {port} within {seconds}s")


def start_serve(site: Path, state: Path, workers: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {**os.environ, "K3SERVE_STATE": str(state)}
    command = [sys.executable, "-m", "serve", "--root", str(site), "--port", str(port)]
    command += ["--workers", str(workers)]
    process = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
    wait_for_port(port, process)
    time.sleep(0.5 * workers)  # every worker has its socket in the SO_REUSEPORT group
    return process, port


def start_naive(site: Path, state: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    command = [sys.executable, __file__, "--naive-server", str(site), str(port), str(state)]
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.DEVNULL)
    wait_for_port(port, process)
    return process, port


def start_ceiling(site: Path, state: Path, workers: int) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    command = [sys.executable, __file__, "--ceiling-server", str(site), str(port), str(state)]
    command.append(str(workers))
    # Its own process group: stop() must reach the forked processes too.
    process = subprocess.Popen(command, cwd=REPO, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_port(port, process)
    time.sleep(0.5 * workers)  # every process has its socket in the SO_REUSEPORT group
    return process, port


NGINX_CONF = """
worker_processes {workers};
pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
daemon off;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ text/html html; text/css css; application/json json; }}
    server {{
        listen 127.0.0.1:{port} ssl http2;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols TLSv1.3;
        ssl_ecdh_curve X25519:prime256v1:secp384r1;
        root {site};
        gzip_static on;
    }}
}}
"""


def start_nginx(
    site: Path, state: Path, workers: int, tmp: Path
) -> tuple[subprocess.Popen[bytes], int]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is not installed: run `bash tests/bootstrap.sh`")
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            workers=workers,
            tmp=tmp,
            port=port,
            site=site,
            cert=state / "leaf.pem",
            key=state / "leaf.key",
        )
    )
    command = [nginx, "-c", str(conf), "-e", str(tmp / "error.log")]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    wait_for_port(port, process)
    return process, port


def start_nginx_k3(
    site: Path, state: Path, workers: int, tmp: Path
) -> tuple[subprocess.Popen[bytes], int]:
    """nginx with the configuration `python -m serve --nginx-conf` writes, under its own prefix."""
    sys.path.insert(0, str(REPO))
    from serve.nginx import NginxSettings, nginx_conf

    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    port = free_port()
    prefix = tmp / "nginx-k3"
    prefix.mkdir(exist_ok=True)
    settings = NginxSettings(
        root=site,
        certfile=state / "leaf.pem",
        keyfile=state / "leaf.key",
        listen=f"127.0.0.1:{port}",
        worker_processes=str(workers),
    )
    (prefix / "nginx.conf").write_text(nginx_conf(settings))
    command = [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf")]
    command += ["-e", str(prefix / "error.log"), "-g", "daemon off;"]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    wait_for_port(port, process)
    return process, port


def cpu_model() -> str:
    """The CPU the ratios were measured on, as /proc/cpuinfo names it."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def stop(process: subprocess.Popen[bytes]) -> None:
    if os.getpgid(process.pid) == process.pid:  # a group of its own: its forks go too
        os.killpg(process.pid, signal.SIGTERM)
    else:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- the load generators --------------------------------------------------------------------


def run_wrk(port: int, args: argparse.Namespace, tmp: Path, headers: list[str]) -> Result:
    """wrk runs for a duration, so a 2 s probe sizes the run to reach the request count."""
    probe = _wrk(port, args, tmp, headers, 2)
    served = probe.requests
    seconds = min(args.time_limit, max(3, int(1.5 * args.requests / max(probe.rate, 1.0)) + 1))
    result = _wrk(port, args, tmp, headers, seconds)
    served += result.requests
    if result.requests < args.requests and seconds < args.time_limit:
        # The machine slowed down under us (it is shared): once more, sized by what we saw.
        seconds = min(args.time_limit, int(1.5 * args.requests / max(result.rate, 1.0)) + 1)
        result = _wrk(port, args, tmp, headers, seconds)
        served += result.requests
    result.served = served
    return result


def _wrk(
    port: int, args: argparse.Namespace, tmp: Path, headers: list[str], seconds: int
) -> Result:
    script = tmp / "bench.lua"
    script.write_text(WRK_SCRIPT)
    command = ["wrk", "-t", "2", "-c", str(args.connections), "-d", f"{seconds}s"]
    command += ["-s", str(script), "--timeout", "10s"]
    for header in headers:
        command += ["-H", header]
    command.append(f"https://127.0.0.1:{port}{URL_PATH}")
    out = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
    if line is None:
        raise SystemExit(f"wrk printed no summary:\n{out.stdout}\n{out.stderr}")
    s = json.loads(line)
    errors = s["connect"] + s["read"] + s["write"] + s["status"] + s["timeout"]
    return Result("", "h1", s["requests"], errors, s["duration_us"] / 1e6, s["p99_us"] / 1e3)


def run_h2load(port: int, args: argparse.Namespace, tmp: Path, headers: list[str]) -> Result:
    log = tmp / "h2load.log"
    log.unlink(missing_ok=True)
    command = ["h2load", "-n", str(args.requests), "-c", str(args.connections), "-m", "1"]
    command += ["-t", "2", "--log-file", str(log)]
    for header in headers:
        command += ["-H", header]
    command.append(f"https://127.0.0.1:{port}{URL_PATH}")
    out = subprocess.run(command, capture_output=True, text=True, timeout=args.time_limit + 60)
    finished = re.search(r"finished in ([\d.]+)(ms|s)", out.stdout)
    counts = re.search(
        r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded, "
        r"(\d+) failed, (\d+) errored, (\d+) timeout",
        out.stdout,
    )
    status = re.search(r"status codes: (\d+) 2xx", out.stdout)
    if not (finished and counts and status):
        raise SystemExit(f"h2load printed no summary:\n{out.stdout}\n{out.stderr}")
    seconds = float(finished.group(1)) / (1000 if finished.group(2) == "ms" else 1)
    ok = int(status.group(1))
    errors = (
        int(counts.group(2))
        + int(counts.group(3))
        + int(counts.group(4))
        + int(counts.group(1))
        - ok
    )
    durations = sorted(int(row.split()[2]) for row in log.read_text().splitlines() if row.strip())
    p99 = durations[int(0.99 * (len(durations) - 1))] / 1e3 if durations else float("nan")
    return Result("", "h2", ok, errors, seconds, p99, served=ok)


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def serving_pids(target: str, pid: int) -> list[int]:
    """The processes that answer requests: serve's and nginx's workers (their parent only
    supervises), the ceiling's parent and the processes it forked, the naive server itself."""
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    if target.startswith(("serve", "nginx")) and children:
        return children
    return [pid, *children] if target == "ceiling" else [pid]


# --- the site ------------------------------------------------------------------------------


def copy_site(tmp: Path) -> Path:
    """One fixed snapshot for every target, readable by nginx's unprivileged workers."""
    site = tmp / "site"
    public = REPO / "public"
    if public.exists():
        shutil.copytree(public.resolve(), site, symlinks=True)
    else:
        sys.path.insert(0, str(REPO / "tests"))
        from serve_support import make_site

        site = make_site(tmp / "synthetic").root
    for path in [tmp, *tmp.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    return site


def make_certificates(state: Path) -> None:
    sys.path.insert(0, str(REPO))
    from serve.certs import CertSettings, ensure_local_certificates

    ensure_local_certificates(CertSettings(state))


# --- main ------------------------------------------------------------------------------------


def measure(
    name: str, port: int, args: argparse.Namespace, tmp: Path, pids: list[int]
) -> list[Result]:
    results = []
    for runner, protocol in ((run_wrk, "h1"), (run_h2load, "h2")):
        warm = argparse.Namespace(**{**vars(args), "requests": 1000})
        run_h2load(port, warm, tmp, [])  # warm-up: caches filled, connections' code paths hot
        before = [cpu_ticks(p) for p in pids]
        result = runner(port, args, tmp, [])
        after = [cpu_ticks(p) for p in pids]
        result.target = name
        results.append(result)
        used = [b - a for a, b in zip(before, after, strict=True)]
        result.cpu_seconds = sum(used) / os.sysconf("SC_CLK_TCK")
        share = ", ".join(f"{100 * u / max(1, sum(used)):.0f}%" for u in used)
        print(
            f"  {name:8}{protocol}: {result.requests:6d} requests, {result.errors} errors, "
            f"{result.rate:8.0f} req/s, p99 {result.p99_ms:7.1f} ms, "
            f"{result.rate_per_cpu:6.0f} req per CPU s"
            + (f"  (worker CPU shares: {share})" if len(pids) > 1 else ""),
            flush=True,
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--time-limit", type=int, default=120, help="seconds per run, at most")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all targets")
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated subset of {','.join(TARGETS)} (default: all)",
    )
    parser.add_argument("--naive-server", nargs=3, metavar=("ROOT", "PORT", "STATE"))
    parser.add_argument("--ceiling-server", nargs=4, metavar=("ROOT", "PORT", "STATE", "N"))
    args = parser.parse_args()
    if args.naive_server:
        root, port, state = args.naive_server
        naive_server(Path(root), int(port), Path(state) / "leaf.pem", Path(state) / "leaf.key")
        return 0
    if args.ceiling_server:
        root, port, state, workers = args.ceiling_server
        cert, key = Path(state) / "leaf.pem", Path(state) / "leaf.key"
        ceiling_server(Path(root), int(port), cert, key, int(workers))
        return 0
    for tool in ("wrk", "h2load"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: run `bash tests/bootstrap.sh`")
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as name:
        tmp = Path(name)
        state = tmp / "state"
        make_certificates(state)
        site = copy_site(tmp)
        print(
            f"bench: GET {URL_PATH} ({(site / 'index.html').stat().st_size} bytes), "
            f"{args.requests} requests per run, {args.connections} connections, TLS 1.3, "
            f"{os.cpu_count()} cores of {cpu_model()} (shared with the load generator); "
            f"load average {os.getloadavg()[0]:.2f} at start",
            flush=True,
        )
        rounds: list[dict[tuple[str, str], Result]] = []
        starters = {
            "serve": lambda: start_serve(site, state, args.workers),
            "serve1": lambda: start_serve(site, state, 1),
            "naive": lambda: start_naive(site, state),
            "ceiling": lambda: start_ceiling(site, state, args.workers),
            "nginx": lambda: start_nginx(site, state, args.workers, tmp),
            "nginx-k3": lambda: start_nginx_k3(site, state, args.workers, tmp),
        }
        names = [name.strip() for name in args.targets.split(",")]
        unknown = sorted(set(names) - set(starters))
        if unknown:
            raise SystemExit(f"unknown --targets {unknown}; choose from {list(starters)}")
        for k in range(args.rounds):
            print(f"round {k + 1} of {args.rounds}", flush=True)
            results: dict[tuple[str, str], Result] = {}
            for target in names[k % len(names) :] + names[: k % len(names)]:  # rotated
                process, port = starters[target]()
                try:
                    pids = serving_pids(target, process.pid)
                    for result in measure(target, port, args, tmp, pids):
                        results[(target, result.protocol)] = result
                finally:
                    stop(process)
            rounds.append(results)
        print(f"load average {os.getloadavg()[0]:.2f} at the end")
        print_ratios(rounds, args)
    return 0


def print_ratios(rounds: list[dict[tuple[str, str], Result]], args: argparse.Namespace) -> None:
    """Each ratio of req/s: its median over the rounds, and its spread (min .. max)."""
    print(f"\nratios (serve = {args.workers} workers; req/s; median over {len(rounds)} rounds, "
          "min .. max):")  # fmt: skip

    def line(protocol: str, a: str, b: str, per_cpu: bool = False) -> None:
        if not all((a, protocol) in r and (b, protocol) in r for r in rounds):
            return  # a target left out with --targets
        rate = (lambda x: x.rate_per_cpu) if per_cpu else (lambda x: x.rate)
        v = sorted(_ratio(rate(r[(a, protocol)]), rate(r[(b, protocol)])) for r in rounds)
        median = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
        name = f"{a} / {b}" + (" (per CPU s)" if per_cpu else "")
        print(f"  {protocol}: {name:29} = {median:6.2f}   ({v[0]:.2f} .. {v[-1]:.2f})")

    for protocol in ("h1", "h2"):
        for other in ("serve1", "naive", "ceiling", "nginx"):
            line(protocol, "serve", other)
        line(protocol, "ceiling", "nginx")
        line(protocol, "nginx-k3", "nginx")
        # What the policy costs nginx, counted in its workers' CPU rather than in wall time.
        line(protocol, "nginx-k3", "nginx", per_cpu=True)
    clean = all(r.errors == 0 and r.requests >= args.requests
                for results in rounds for r in results.values())  # fmt: skip
    print(
        f"\nall runs reached {args.requests} requests with zero errors: {'yes' if clean else 'NO'}"
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


if __name__ == "__main__":
    sys.exit(main())
