"""The running server over real sockets: status table, headers, traversal, timeouts, redirect."""

from __future__ import annotations

import gzip
import hashlib
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from serve_support import (
    BIG_SIZE,
    FINGERPRINTED_CSS,
    SECRET,
    Server,
    Site,
    curl,
    get,
    h2_request,
    make_site,
    raw_request,
    read_reply,
    running_server,
    seconds_until_closed,
    start_paused_download,
    tls_connect,
)

from serve import connection

IDLE_TIMEOUT = 1.5  # the configured limits under test, small so the suite stays quick
HANDSHAKE_TIMEOUT = 1.5
READ_TIMEOUT = 1.5
CUT_OFF_SLACK = 2.0  # scheduling slack on a busy 2-core machine, on top of the configured limit
# More than the kernel buffers on both ends of a loopback connection can hold (4 MiB each).
HUGE_SIZE = 16 * 1024 * 1024


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    site = make_site(tmp_path_factory.mktemp("http-site"))
    (site.root / "huge.bin").write_bytes(b"h" * HUGE_SIZE)
    return site


@pytest.fixture(scope="module")
def server(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    state = tmp_path_factory.mktemp("http-state") / "k3serve"
    args = ["--idle-timeout", str(IDLE_TIMEOUT), "--handshake-timeout", str(HANDSHAKE_TIMEOUT)]
    args += ["--redirect-port", "0", "--redirect-host", "k3.example"]
    with running_server(site.root, state, *args) as running:
        yield running


# --- the status table --------------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_unsafe_methods_get_405_with_allow(server: Server, method: str) -> None:
    reply = get(server, "/", method, {"Content-Length": "0"})
    assert reply.status == 405
    assert reply.header("allow") == "GET, HEAD"


def test_64_kb_header_gets_431_over_http1(server: Server) -> None:
    big = "a" * 64 * 1024
    for _ in range(3):  # both of hypercorn's paths (incomplete head, complete head) say 431
        assert _answer_to_oversized_head(server, big) == 431


def _answer_to_oversized_head(server: Server, big: str, attempts: int = 5) -> int:
    """The status the server answers an oversized head with. The server may answer and close
    before the client has sent it all (RFC 9112 9.6 lets it): that attempt's send fails, and a
    close with unread bytes can reset the reply away. Such an attempt says nothing, so the next
    connection asks again; only a status read from the server is an answer."""
    for _ in range(attempts):
        try:
            return get(server, "/", headers={"X-Big": big}).status
        except (ssl.SSLError, ConnectionError):
            continue
    raise AssertionError(f"no answer to a 64 KiB head in {attempts} connections")


def test_64_kb_header_gets_431_over_h2(server: Server) -> None:
    # The h2 library, not curl: curl's nghttp2 refuses to send a header block over 64 KiB.
    reply = h2_request(server, b"/", headers=[(b"x-big", b"a" * 64 * 1024)])
    assert reply.status == 431


def test_conditional_get_with_the_etag_is_304(server: Server) -> None:
    first = get(server, "/census.json")
    etag = first.header("etag")
    assert first.status == 200 and etag
    again = get(server, "/census.json", headers={"If-None-Match": etag})
    assert (again.status, again.body, again.header("etag")) == (304, b"", etag)
    modified = get(
        server, "/census.json", headers={"If-Modified-Since": first.header("last-modified") or ""}
    )
    assert modified.status == 304


def test_gzip_is_sent_with_vary(server: Server, site: Site) -> None:
    reply = get(server, "/", headers={"Accept-Encoding": "gzip, br"})
    assert (reply.status, reply.header("content-encoding")) == (200, "gzip")
    assert reply.header("vary") == "accept-encoding"
    assert gzip.decompress(reply.body) == (site.root / "index.html").read_bytes()


def test_gzip_q0_gets_identity(server: Server, site: Site) -> None:
    reply = get(server, "/", headers={"Accept-Encoding": "gzip;q=0, br"})
    assert reply.status == 200
    assert reply.header("content-encoding") is None
    assert reply.header("vary") == "accept-encoding"
    assert reply.body == (site.root / "index.html").read_bytes()


def test_cross_site_request_is_not_compressed(server: Server) -> None:
    headers = {"Accept-Encoding": "gzip", "Referer": "https://google.com/"}
    assert get(server, "/", headers=headers).header("content-encoding") is None
    headers = {"Accept-Encoding": "gzip", "Sec-Fetch-Site": "same-origin"}
    assert get(server, "/", headers=headers).header("content-encoding") == "gzip"


def test_head_sends_headers_only(server: Server, site: Site) -> None:
    reply = get(server, "/", "HEAD")
    assert (reply.status, reply.body) == (200, b"")
    assert reply.header("content-length") == str((site.root / "index.html").stat().st_size)


def test_folder_redirect_and_index(server: Server) -> None:
    reply = get(server, "/innovations/kda")
    assert (reply.status, reply.header("location")) == (308, "/innovations/kda/")
    assert get(server, "/innovations/kda/").status == 200


def test_404_page_with_no_store(server: Server, site: Site) -> None:
    reply = get(server, "/nope/")
    assert (reply.status, reply.header("cache-control")) == (404, "no-store")
    assert reply.body == (site.root / "404.html").read_bytes()


def test_big_file_arrives_whole_over_h1_and_h2(server: Server, site: Site) -> None:
    expected = hashlib.sha256((site.root / "big.bin").read_bytes()).hexdigest()
    assert hashlib.sha256(get(server, "/big.bin").body).hexdigest() == expected
    result = curl(server, "/big.bin", "--http2", "-o", "-")
    assert len(result.stdout) == BIG_SIZE


def test_h2_stream_and_header_limits_are_advertised(server: Server) -> None:
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with tls_connect(server, alpn=("h2",)) as sock:
        connection.initiate_connection()
        sock.sendall(connection.data_to_send())
        events = connection.receive_data(sock.recv(65536))
    settings = next(e for e in events if isinstance(e, h2.events.RemoteSettingsChanged))
    advertised = {k: v.new_value for k, v in settings.changed_settings.items()}
    assert advertised[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == 64
    assert advertised[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE] == 128 * 1024
    assert advertised[h2.settings.SettingCodes.MAX_FRAME_SIZE] == 16 * 1024


# --- headers -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", FINGERPRINTED_CSS, "/nope", "/../x"])
def test_security_headers_on_every_response(server: Server, path: str) -> None:
    reply = get(server, path)
    hsts = reply.header("strict-transport-security") or ""
    assert int(hsts.split("max-age=")[1].split(";")[0]) >= 63072000
    csp = {d.strip() for d in (reply.header("content-security-policy") or "").split(";")}
    assert {
        "default-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    } <= csp
    assert reply.header("x-content-type-options") == "nosniff"
    assert reply.header("referrer-policy")
    assert reply.header("permissions-policy")
    assert reply.header("cross-origin-opener-policy") == "same-origin"
    assert reply.header("server") is None


def test_cache_control_immutable_and_no_cache(server: Server) -> None:
    assert get(server, FINGERPRINTED_CSS).header("cache-control") == (
        "public, max-age=31536000, immutable"
    )
    assert get(server, "/").header("cache-control") == "no-cache"


def test_no_server_header_over_h2(server: Server) -> None:
    result = curl(server, "/", "--http2", "-D", "-", "-o", "/dev/null")
    assert result.stdout.startswith("HTTP/2 200")
    assert "\nserver:" not in result.stdout.lower()
    assert "strict-transport-security: max-age=63072000" in result.stdout


# --- traversal -------------------------------------------------------------------------------

# Each tries to escape public/ (the secret sits beside it) or to reach a dotfile or a symlink.
ESCAPES = [
    b"/../secret.txt",
    b"/../../secret.txt",
    b"/../../../../../../etc/passwd",
    b"/%2e%2e/secret.txt",
    b"/%2E%2E/secret.txt",
    b"/%2e%2e%2fsecret.txt",
    b"/..%2fsecret.txt",
    b"/%2f%2e%2e%2fsecret.txt",
    b"/%252e%252e/secret.txt",
    b"/%252e%252e%252fsecret.txt",
    b"/..%5csecret.txt",
    b"/..\\secret.txt",
    b"/%c0%ae%c0%ae/secret.txt",
    b"/%c0%af..%c0%afsecret.txt",
    b"/%e0%80%ae%e0%80%ae/secret.txt",
    b"/%ef%bc%8e%ef%bc%8e/secret.txt",
    b"/innovations/../../secret.txt",
    b"/innovations/kda/../../../secret.txt",
    b"//..//secret.txt",
    b"/./../secret.txt",
    b"/.%2e/secret.txt",
    b"/%2e./secret.txt",
    b"/..;/secret.txt",
    b"/secret.txt%00.html",
    b"/%00../secret.txt",
    b"/index.html%00/../../secret.txt",
    b"/link-out.txt",
    b"/dir-out/secret.txt",
    b"/dir-out/public/../secret.txt",
    b"/link-in.txt",
    b"/.env",
    b"/%2eenv",
    b"/.git/config",
    b"/%2egit/config",
    b"http://localhost/../secret.txt",
]


def test_traversal_suite_is_large_enough() -> None:
    assert len(ESCAPES) >= 25


@pytest.mark.parametrize("path", ESCAPES, ids=[p.decode("latin-1") for p in ESCAPES])
def test_no_byte_escapes_the_site(server: Server, site: Site, path: bytes) -> None:
    reply = raw_request(
        server, b"GET " + path + b" HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    assert reply.status in (400, 404), reply.status
    assert SECRET.encode() not in reply.body
    assert b"root:" not in reply.body
    assert site.secret.read_bytes() not in reply.body


@pytest.mark.parametrize("path", ESCAPES, ids=[p.decode("latin-1") for p in ESCAPES])
def test_no_byte_escapes_over_h2(server: Server, site: Site, path: bytes) -> None:
    reply = h2_request(server, path)
    assert reply.status in (0, 400, 404), reply.status  # 0: the h2 layer reset the stream
    assert SECRET.encode() not in reply.body
    assert site.secret.read_bytes() not in reply.body


def test_fifo_in_the_tree_does_not_hang_the_server(server: Server) -> None:
    assert get(server, "/fifo").status == 404
    assert get(server, "/").status == 200


# --- slow and idle clients ----------------------------------------------------------------


def test_slow_client_is_cut_off_within_the_configured_timeout(server: Server) -> None:
    """Slowloris: a request head trickled a byte at a time never completes, and is dropped."""
    with tls_connect(server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
        elapsed = seconds_until_closed(sock, b"X-Slow: abcdefgh\r\n", IDLE_TIMEOUT + 30)
    assert elapsed <= IDLE_TIMEOUT + CUT_OFF_SLACK


def test_idle_connection_is_cut_off(server: Server) -> None:
    with tls_connect(server) as sock:
        elapsed = seconds_until_closed(sock, None, IDLE_TIMEOUT + 30)
    assert IDLE_TIMEOUT - 0.1 <= elapsed <= IDLE_TIMEOUT + CUT_OFF_SLACK


def _server_sockets(server: Server) -> int:
    fds = Path(f"/proc/{server.process.pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))


def test_a_peer_that_never_answers_the_tls_goodbye_is_dropped(server: Server) -> None:
    """Idle, the server says close_notify; a client that never answers is dropped after
    connection.TLS_GOODBYE_SECONDS rather than asyncio's 30 s."""
    before = _server_sockets(server)
    with tls_connect(server):  # never reads, so never answers the close_notify
        deadline = time.monotonic() + 10
        while _server_sockets(server) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        opened = time.monotonic()
        while _server_sockets(server) > before and time.monotonic() - opened < 20:
            time.sleep(0.1)
        held = time.monotonic() - opened
    assert held < IDLE_TIMEOUT + connection.TLS_GOODBYE_SECONDS + CUT_OFF_SLACK


KEEP_ALIVE_GET = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"


def test_each_request_moves_the_idle_deadline(server: Server) -> None:
    """Requests every IDLE_TIMEOUT / 3 for twice IDLE_TIMEOUT keep one connection open; the
    idle time counts again from the last response."""
    with tls_connect(server) as sock:
        start = time.monotonic()
        while time.monotonic() - start < 2 * IDLE_TIMEOUT:
            time.sleep(IDLE_TIMEOUT / 3)
            sock.sendall(KEEP_ALIVE_GET)
            assert read_reply(sock, head_only=False).status == 200
        elapsed = seconds_until_closed(sock, None, IDLE_TIMEOUT + 30)
    assert IDLE_TIMEOUT - 0.1 <= elapsed <= IDLE_TIMEOUT + CUT_OFF_SLACK


def _paused_huge_download(server: Server, pause: float) -> bytes:
    """GET /huge.bin, pause with the response half sent (16 MiB fills both ends' buffers), then
    read all that comes."""
    sock, data = start_paused_download(server, b"/huge.bin", b"Connection: close\r\n")
    with sock:
        time.sleep(pause)
        sock.settimeout(10)
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass
    return data.partition(b"\r\n\r\n")[2]


def test_a_busy_connection_is_never_cut_as_idle(server: Server) -> None:
    """A response in progress past the idle timeout (the read timeout is 30 s here) arrives."""
    assert len(_paused_huge_download(server, IDLE_TIMEOUT + CUT_OFF_SLACK)) == HUGE_SIZE


def test_stalled_handshake_is_cut_off(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        elapsed = seconds_until_closed(sock, None, HANDSHAKE_TIMEOUT + 30)
    assert elapsed <= HANDSHAKE_TIMEOUT + CUT_OFF_SLACK


@pytest.fixture(scope="module")
def reader_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A short read timeout and a long idle one, so only the read timeout can cut."""
    site = make_site(tmp_path_factory.mktemp("read-site"))
    (site.root / "huge.bin").write_bytes(b"h" * HUGE_SIZE)
    state = tmp_path_factory.mktemp("read-state") / "k3serve"
    args = ["--read-timeout", str(READ_TIMEOUT), "--idle-timeout", "60"]
    with running_server(site.root, state, *args) as running:
        yield running


def test_a_client_that_stops_reading_a_response_is_cut_off(reader_server: Server) -> None:
    """16 MiB through a 16 KiB window, then no byte from the client: the rest never comes."""
    assert len(_paused_huge_download(reader_server, READ_TIMEOUT + CUT_OFF_SLACK)) < HUGE_SIZE


def test_each_byte_from_the_client_moves_the_read_deadline(reader_server: Server) -> None:
    """A header value sent a byte every READ_TIMEOUT / 3 for twice READ_TIMEOUT is answered."""
    with tls_connect(reader_server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        start = time.monotonic()
        while time.monotonic() - start < 2 * READ_TIMEOUT:
            time.sleep(READ_TIMEOUT / 3)
            sock.sendall(b"a")
        sock.sendall(b"\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")


def test_server_still_serves_after_the_abuse(server: Server) -> None:
    assert get(server, "/").status == 200
    assert "Traceback" not in server.stderr()


# --- the plain-HTTP redirect listener --------------------------------------------------------


def test_http_redirect_goes_to_the_fixed_host_not_the_request_host(server: Server) -> None:
    assert server.redirect_port is not None
    with socket.create_connection(("127.0.0.1", server.redirect_port), timeout=10) as sock:
        sock.sendall(b"GET /a/b?x=1 HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    head = data.decode("latin-1").lower()
    assert head.startswith("http/1.1 308")
    assert f"location: https://k3.example:{server.port}/a/b?x=1\r\n" in head
    assert "evil.example" not in head
    assert "strict-transport-security" not in head  # RFC 6797 7.2: never over plain HTTP
