"""The production path: Debian's nginx with `python -m serve --nginx-conf`, against the server.

Both serve the same small site (serve_support.make_site) on loopback with the same certificate.
Every request below goes to both, and the replies must agree: status, body, and every header
apart from Date and Server, with two named exceptions (see `policy_view`). testssl.sh then scans
the nginx configuration as test_serve_tls scans the server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from serve_support import (
    FINGERPRINTED_CSS,
    REPO,
    Reply,
    Server,
    Site,
    get,
    h2_request,
    make_site,
    raw_request,
    require_tool,
    running_server,
    s_client,
    tls_connect,
)
from test_serve_http import ESCAPES
from test_serve_tls import SCAN_TIMEOUT, assert_testssl_tls13_only

from serve.headers import HeaderSettings
from serve.nginx import NginxSettings, nginx_conf

# Headers that may differ, each for a reason that is not policy:
# - date: the clock; server: nginx always names itself (no module to drop it in Debian's build).
IGNORED = {"date", "server"}
# - connection, keep-alive: how each server manages the socket, not what it says about the file.
TRANSPORT = {"connection", "keep-alive"}


def nginx_binary() -> str:
    """Debian installs nginx in /usr/sbin, which is not on a non-root PATH."""
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else require_tool("nginx")
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Nginx:
    server: Server  # port, CA and process, so serve_support's clients work unchanged
    prefix: Path
    conf: str

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""


def start_nginx(prefix: Path, settings: NginxSettings, state: Path) -> Nginx:
    """nginx in the foreground, everything it writes under `prefix`, on a free loopback port."""
    prefix.mkdir(parents=True, exist_ok=True)
    conf = nginx_conf(settings)
    (prefix / "nginx.conf").write_text(conf)
    directives = "daemon off;"
    if os.geteuid() == 0:
        # As root nginx would run its workers as nobody, who cannot enter pytest's 0700 folders.
        directives += " user root;"
    command = [nginx_binary(), "-p", str(prefix), "-c", str(prefix / "nginx.conf")]
    command += ["-e", str(prefix / "error.log"), "-g", directives]
    log = prefix / "stderr.log"
    with open(log, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=sink)
    server = Server(process, int(settings.listen.rsplit(":", 1)[1]), state, log)
    nginx = Nginx(server, prefix, conf)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"nginx exited with {process.returncode}:\n{log.read_text()}")
        try:
            with tls_connect(server):
                return nginx
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise AssertionError(f"nginx never completed a handshake:\n{log.read_text()}")


def stop_nginx(nginx: Nginx) -> None:
    nginx.server.process.terminate()  # SIGTERM: nginx's fast shutdown, workers included
    nginx.server.process.wait(20)


def settings_for(site: Site, state: Path, **changes: object) -> NginxSettings:
    """The configuration `python -m serve --nginx-conf` writes, on a free port, one worker."""
    return NginxSettings(
        root=site.root,
        certfile=state / "leaf.pem",
        keyfile=state / "leaf.key",
        listen=f"127.0.0.1:{free_port()}",
        worker_processes="1",
        **changes,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    return make_site(tmp_path_factory.mktemp("nginx-site"))


@pytest.fixture(scope="module")
def serve(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    state = tmp_path_factory.mktemp("nginx-state") / "k3serve"
    with running_server(site.root, state) as running:
        yield running


@pytest.fixture(scope="module")
def nginx(site: Site, serve: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    running = start_nginx(
        tmp_path_factory.mktemp("nginx"), settings_for(site, serve.state), serve.state
    )
    try:
        yield running
    finally:
        stop_nginx(running)


# --- comparing replies -----------------------------------------------------------------------


def policy_view(reply: Reply) -> dict[str, object]:
    """Status, body and headers, with the two differences that are representation, not policy.

    - etag: each server's own validator (serve's has nanoseconds, nginx's seconds); present or
      absent alike, and each server's 304 test below uses its own.
    - vary: a list of field names, which RFC 9110 12.5.5 makes case-insensitive; nginx writes
      "Accept-Encoding", serve "accept-encoding".
    """
    headers: dict[str, str] = {}
    for name, value in reply.headers.items():
        if name in IGNORED or name in TRANSPORT:
            continue
        if name == "etag":
            value = "<validator>"
        elif name == "vary":
            value = value.lower()
        headers[name] = value
    return {"status": reply.status, "headers": headers, "body": reply.body}


def differences(a: Reply, b: Reply) -> list[str]:
    """What differs between two replies' policy views, one line per field."""
    va, vb = policy_view(a), policy_view(b)
    out = [f"{key}: {va[key]!r} != {vb[key]!r}" for key in ("status", "body") if va[key] != vb[key]]
    ha, hb = va["headers"], vb["headers"]
    assert isinstance(ha, dict) and isinstance(hb, dict)
    for name in sorted(set(ha) | set(hb)):
        if ha.get(name) != hb.get(name):
            out.append(f"{name}: serve {ha.get(name)!r}, nginx {hb.get(name)!r}")
    return out


def assert_same(serve_reply: Reply, nginx_reply: Reply) -> None:
    found = differences(serve_reply, nginx_reply)
    if found:
        pytest.fail("serve and nginx differ:\n" + "\n".join(found), pytrace=False)


# --- the configuration itself ----------------------------------------------------------------


def test_generated_configuration_passes_nginx_t(nginx: Nginx) -> None:
    conf = nginx.prefix / "nginx.conf"
    command = [nginx_binary(), "-t", "-p", str(nginx.prefix), "-c", str(conf)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_cli_writes_the_configuration(site: Site, serve: Server) -> None:
    cert, key = serve.state / "leaf.pem", serve.state / "leaf.key"
    command = [sys.executable, "-m", "serve", "--nginx-conf", "--root", str(site.root)]
    command += ["--cert", str(cert), "--key", str(key), "--port", "8443"]
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    expected = nginx_conf(NginxSettings(site.root, cert, key, listen="127.0.0.1:8443"))
    assert result.stdout == expected


# --- the kinds of response --------------------------------------------------------------------

GZIP = {"Accept-Encoding": "gzip, br"}
NO_GZIP = {"Accept-Encoding": "gzip;q=0, br"}
CROSS_SITE = {"Accept-Encoding": "gzip", "Referer": "https://google.com/", "User-Agent": "t/1"}
SAME_SITE = {"Accept-Encoding": "gzip", "Sec-Fetch-Site": "same-origin", "User-Agent": "t/1"}

CASES: list[tuple[str, str, str, dict[str, str]]] = [
    ("html", "/", "GET", {}),
    ("html by name", "/index.html", "GET", {}),
    ("html gzip", "/", "GET", GZIP),
    ("html gzip;q=0", "/", "GET", NO_GZIP),
    ("html HEAD", "/", "HEAD", GZIP),
    ("folder index", "/innovations/kda/", "GET", GZIP),
    ("fingerprinted", FINGERPRINTED_CSS, "GET", {}),
    ("fingerprinted gzip", FINGERPRINTED_CSS, "GET", GZIP),
    ("census.json", "/census.json", "GET", GZIP),
    ("text", "/notes.txt", "GET", {}),
    ("unicode name", "/unicode%20%C3%A9.txt", "GET", {}),
    ("real .gz resource", "/archive.gz", "GET", GZIP),
    ("sidecar by name", "/index.html.gz", "GET", {}),
    ("404", "/nope", "GET", {}),
    ("404 folder", "/nope/", "GET", GZIP),
    ("404 file as folder", "/notes.txt/", "GET", {}),
    ("404 HEAD", "/nope", "HEAD", {}),
    ("404 conditional", "/nope", "GET", {"If-None-Match": "*"}),
    ("folder without index", "/empty-folder/", "GET", {}),
    ("folder without slash", "/innovations/kda", "GET", {}),
    ("folder without slash, query", "/innovations/kda?x=1&y=%20", "GET", {}),
    ("folder without slash, //", "//innovations//kda", "GET", {}),
    ("dotfile", "/.env", "GET", {}),
    ("dotfolder", "/.git/config", "GET", GZIP),
    ("symlink inside", "/link-in.txt", "GET", {}),
    ("symlink outside", "/link-out.txt", "GET", {}),
    ("fifo", "/fifo", "GET", {}),
    ("POST", "/", "POST", {"Content-Length": "0"}),
    ("DELETE", "/", "DELETE", {}),
    ("over-long path", "/" + "a" * 2100, "GET", {}),
    ("too deep", "/a" * 40, "GET", {}),
    ("cross-site gets identity", "/", "GET", CROSS_SITE),
    ("cross-site 404 gets identity", "/nope", "GET", CROSS_SITE),
    ("same-origin gets gzip", "/", "GET", SAME_SITE),
    ("same host referer", "/", "GET", {**CROSS_SITE, "Referer": "https://LocalHost/x"}),
    ("other port referer", "/", "GET", {**CROSS_SITE, "Referer": "https://localhost:1/x"}),
]


@pytest.mark.parametrize(
    ("path", "method", "headers"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_same_reply_over_http1(
    serve: Server, nginx: Nginx, path: str, method: str, headers: dict[str, str]
) -> None:
    assert_same(get(serve, path, method, headers), get(nginx.server, path, method, headers))


H2_CASES = ["/", FINGERPRINTED_CSS, "/nope", "/innovations/kda", "/.env", "/census.json"]


@pytest.mark.parametrize("path", H2_CASES)
def test_same_reply_over_h2(serve: Server, nginx: Nginx, path: str) -> None:
    headers = [(b"accept-encoding", b"gzip")]
    assert_same(
        h2_request(serve, path.encode(), headers=headers),
        h2_request(nginx.server, path.encode(), headers=headers),
    )


@pytest.mark.parametrize("path", ["/", FINGERPRINTED_CSS, "/census.json"])
@pytest.mark.parametrize("accept", ["gzip", "identity"])
def test_same_304_with_each_servers_own_validators(
    serve: Server, nginx: Nginx, path: str, accept: str
) -> None:
    """A 304 repeats the caching and security headers. Each server gets its own validator."""
    replies = []
    for server in (serve, nginx.server):
        first = get(server, path, headers={"Accept-Encoding": accept})
        etag, modified = first.header("etag"), first.header("last-modified")
        assert etag and modified, first.headers
        by_tag = get(server, path, headers={"Accept-Encoding": accept, "If-None-Match": etag})
        by_date = get(
            server, path, headers={"Accept-Encoding": accept, "If-Modified-Since": modified}
        )
        assert (by_tag.status, by_date.status) == (304, 304)
        replies.append((by_tag, by_date))
    assert_same(replies[0][0], replies[1][0])
    assert_same(replies[0][1], replies[1][1])


@pytest.mark.parametrize("path", ESCAPES, ids=[p.decode("latin-1") for p in ESCAPES])
def test_same_reply_to_the_traversal_suite(
    serve: Server, nginx: Nginx, site: Site, path: bytes
) -> None:
    head = b"GET " + path + b" HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    from_serve, from_nginx = raw_request(serve, head), raw_request(nginx.server, head)
    assert site.secret.read_bytes() not in from_nginx.body
    assert_same(from_serve, from_nginx)


def test_a_changed_header_is_caught(
    site: Site, serve: Server, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The comparison can fail: nginx configured with another Referrer-Policy differs there."""
    changed = HeaderSettings(referrer_policy="same-origin")
    settings = settings_for(site, serve.state, headers=changed)
    other = start_nginx(tmp_path_factory.mktemp("nginx-changed"), settings, serve.state)
    try:
        found = differences(get(serve, "/"), get(other.server, "/"))
    finally:
        stop_nginx(other)
    assert found == ["referrer-policy: serve 'no-referrer', nginx 'same-origin'"]


def test_nginx_logged_nothing_unexpected(nginx: Nginx) -> None:
    """Nothing at alert or emerg; at crit only nginx's own words for the planted traps."""
    traps = ("(40: Too many levels of symbolic links)", '/fifo" is not a regular file')
    for line in nginx.error_log().splitlines():
        if any(level in line for level in ("[crit]", "[alert]", "[emerg]")):
            assert any(trap in line for trap in traps), line


# --- TLS: 1.3 only, h2, the same groups ------------------------------------------------------


def test_tls12_is_refused(nginx: Nginx) -> None:
    result = s_client(nginx.server, "-tls1_2")
    assert result.returncode != 0
    assert "Cipher is (NONE)" in result.stdout or "Cipher    : 0000" in result.stdout


def test_tls13_negotiates_h2_with_the_same_certificate(serve: Server, nginx: Nginx) -> None:
    results = [s_client(s, "-tls1_3", "-alpn", "h2,http/1.1") for s in (serve, nginx.server)]
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "ALPN protocol: h2" in result.stdout and "New, TLSv1.3" in result.stdout
        assert "Verify return code: 0 (ok)" in result.stdout
    certificates = [r.stdout.split("-----BEGIN CERTIFICATE-----")[1][:200] for r in results]
    assert certificates[0] == certificates[1]


@pytest.mark.parametrize("group", ["X25519", "P-256", "P-384", "P-521", "X448", "ffdhe2048"])
def test_the_same_groups_are_accepted(serve: Server, nginx: Nginx, group: str) -> None:
    accepted = [s_client(s, "-groups", group).returncode == 0 for s in (serve, nginx.server)]
    assert accepted[0] == accepted[1], f"{group}: serve {accepted[0]}, nginx {accepted[1]}"
    assert accepted[0] == (group in ("X25519", "P-256", "P-384"))


# --- testssl on the generated configuration -------------------------------------------------


def test_testssl_reports_only_tls13_hsts_and_nothing_medium(
    nginx: Nginx, tmp_path_factory: pytest.TempPathFactory
) -> None:
    out = tmp_path_factory.mktemp("nginx-testssl")
    report = out / "testssl.json"
    command = [require_tool("testssl"), "--jsonfile", str(report)]
    # --add-ca: trust the local CA; --nodns none: no DNS lookups, so nothing leaves loopback.
    command += ["--add-ca", str(nginx.server.ca), "--nodns", "none", "--color", "0"]
    command += ["--warnings", "off", "--quiet", f"127.0.0.1:{nginx.server.port}"]
    log = out / "testssl.log"
    with open(log, "wb") as sink:
        subprocess.run(
            command, stdout=sink, stderr=subprocess.STDOUT, cwd=out, timeout=SCAN_TIMEOUT
        )
    if not report.exists():
        raise AssertionError(f"testssl wrote no JSON:\n{log.read_text()[-3000:]}")
    assert_testssl_tls13_only(report)
