"""The server's decisions as pure functions and as `StaticApp.respond`, without any socket."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest
from serve_support import FINGERPRINTED_CSS, SECRET, Site, make_site

from serve import files
from serve.app import AppSettings, StaticApp
from serve.files import FileSettings, Refused, RequestPath
from serve.headers import HeaderSettings, cache_control, security_headers

SETTINGS = FileSettings(Path("/nonexistent"))


# --- the path resolver: one table, each row an attack or a normal URL ------------------------

PATHS = [
    # (raw request path, segments or refusal status, why)
    (b"/", (), "the root"),
    (b"/index.html", ("index.html",), "a file"),
    (b"/innovations/kda/", ("innovations", "kda"), "a folder"),
    (b"//innovations///kda", ("innovations", "kda"), "empty segments cannot make a join absolute"),
    (b"/unicode%20%C3%A9.txt", ("unicode é.txt",), "percent-decoded once, as UTF-8"),
    (b"/%252e%252e/secret.txt", ("%2e%2e", "secret.txt"), "decoded once: %252e is a literal %2e"),
    (b"/../secret.txt", 400, "dot-dot"),
    (b"/a/../../secret.txt", 400, "dot-dot deeper"),
    (b"/%2e%2e/secret.txt", 400, "encoded dot-dot"),
    (b"/%2E%2E%2Fsecret.txt", 400, "encoded dot-dot and slash"),
    (b"/./index.html", 400, "single dot"),
    (b"/..%5csecret.txt", 400, "encoded backslash"),
    (b"/..\\secret.txt", 400, "raw backslash"),
    (b"/index.html%00.png", 400, "NUL truncation"),
    (b"/%0d%0aSet-Cookie:x=1", 400, "CR/LF header injection"),
    (b"/%c0%ae%c0%ae/secret.txt", 400, "overlong UTF-8 dots"),
    (b"/%c0%af", 400, "overlong UTF-8 slash"),
    (b"/%ff", 400, "invalid UTF-8"),
    (b"/.env", 404, "dotfile"),
    (b"/.git/config", 404, "dot folder"),
    (b"/%2egit/config", 404, "encoded dot folder"),
    (b"/" + b"a" * 256, 404, "name longer than NAME_MAX"),
    (b"/" + b"a/" * 40, 404, "too deep"),
    (b"/" + b"a" * 3000, 414, "request path too long"),
    (b"http://evil.example/index.html", 400, "absolute-form target"),
    (b"*", 400, "asterisk-form target"),
]


@pytest.mark.parametrize(("raw", "expected", "why"), PATHS, ids=[p[2] for p in PATHS])
def test_parse_request_path(raw: bytes, expected: tuple[str, ...] | int, why: str) -> None:
    if isinstance(expected, int):
        with pytest.raises(Refused) as refused:
            files.parse_request_path(raw, SETTINGS)
        assert refused.value.status == expected, why
    else:
        assert files.parse_request_path(raw, SETTINGS).segments == expected, why


def test_canonical_href_is_percent_encoded() -> None:
    path = RequestPath(("unicode é", "a b"), trailing_slash=True)
    assert path.url == "/unicode é/a b/"
    assert path.href == "/unicode%20%C3%A9/a%20b/"


# --- content negotiation --------------------------------------------------------------------

ENCODINGS = [
    (None, False),
    ("", False),
    ("gzip", True),
    ("GZIP", True),
    ("x-gzip", True),
    ("gzip;q=0", False),
    ("gzip; q=0.0", False),
    ("gzip;q=0.001", True),
    ("br, gzip;q=0.5", True),
    ("deflate, br", False),
    ("*", True),
    ("*;q=0", False),
    ("gzip;q=0, *", False),  # the explicit entry wins over the wildcard
    ("*, gzip;q=0", False),
    ("identity", False),
    ("gzip;q=abc", False),  # malformed q: not acceptable
    ("gzip;q=nan", False),
    ("gzip;q=2", False),
]


@pytest.mark.parametrize(("header", "expected"), ENCODINGS)
def test_accepts_gzip(header: str | None, expected: bool) -> None:
    assert files.accepts_gzip(header) is expected


@pytest.mark.parametrize(
    ("fetch_site", "referer", "host", "cross"),
    [
        (None, None, "localhost:8443", False),
        ("same-origin", None, "localhost:8443", False),
        ("none", None, "localhost:8443", False),
        ("cross-site", None, "localhost:8443", True),
        (None, "https://localhost:8443/census/", "localhost:8443", False),
        (None, "https://google.com/", "localhost:8443", True),
        (None, "https://[broken/", "localhost:8443", True),
    ],
)
def test_cross_site_requests_are_not_compressed(
    fetch_site: str | None, referer: str | None, host: str, cross: bool
) -> None:
    assert files.is_cross_site(fetch_site, referer, host) is cross


# --- conditional GET --------------------------------------------------------------------------

ETAG = '"18a-2f"'
MTIME = 1_700_000_000.5
CONDITIONS = [
    (None, None, False, "unconditional"),
    (ETAG, None, True, "matching ETag"),
    ('"other"', None, False, "other ETag"),
    (f'"a", {ETAG}', None, True, "ETag in a list"),
    (f"W/{ETAG}", None, True, "weak comparison"),
    ("*", None, True, "any representation"),
    ('"other"', "Tue, 14 Nov 2023 22:13:20 GMT", False, "If-None-Match decides alone"),
    (None, "Tue, 14 Nov 2023 22:13:20 GMT", True, "modified exactly then (whole seconds)"),
    (None, "Tue, 14 Nov 2023 22:13:19 GMT", False, "modified after"),
    (None, "Wed, 15 Nov 2023 00:00:00 GMT", True, "not modified since"),
    (None, "yesterday", False, "unparsable date is ignored"),
]


@pytest.mark.parametrize(
    ("inm", "ims", "expected", "why"), CONDITIONS, ids=[c[3] for c in CONDITIONS]
)
def test_is_not_modified(inm: str | None, ims: str | None, expected: bool, why: str) -> None:
    assert files.is_not_modified(inm, ims, ETAG, MTIME) is expected, why


def test_etag_differs_per_encoding() -> None:
    st = os.stat(__file__)
    assert files.make_etag(st, None) != files.make_etag(st, "gzip")


# --- MIME and caching ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "mime"),
    [
        ("index.html", "text/html; charset=utf-8"),
        ("site.0123456789.css", "text/css; charset=utf-8"),
        ("app.js", "text/javascript; charset=utf-8"),
        ("census.json", "application/json"),
        ("chart.SVG", "image/svg+xml"),
        ("font.woff2", "font/woff2"),
        ("archive.gz", "application/gzip"),
        ("README", "application/octet-stream"),
        ("x.unknown", "application/octet-stream"),
    ],
)
def test_content_type(name: str, mime: str) -> None:
    assert files.content_type(name) == mime


@pytest.mark.parametrize(
    ("url", "status", "policy"),
    [
        ("/assets/css/site.0123456789.css", 200, "public, max-age=31536000, immutable"),
        ("/assets/site.abcdef0123.js", 200, "public, max-age=31536000, immutable"),
        ("/assets/css/site.css", 200, "no-cache"),  # not fingerprinted
        ("/assets/css/site.0123456789a.css", 200, "no-cache"),  # 11 hex digits
        ("/assets/css/site.ABCDEF0123.css", 200, "no-cache"),  # upper case
        ("/elsewhere/site.0123456789.css", 200, "no-cache"),  # not under /assets/
        ("/", 200, "no-cache"),
        ("/census.json", 200, "no-cache"),
        ("/404.html", 404, "no-store"),
    ],
)
def test_cache_control(url: str, status: int, policy: str) -> None:
    assert cache_control(url, status) == policy


def test_security_headers() -> None:
    headers = {k.decode(): v.decode() for k, v in security_headers(HeaderSettings())}
    hsts = headers["strict-transport-security"]
    assert int(hsts.split("max-age=")[1].split(";")[0]) >= 63072000
    csp = [d.strip() for d in headers["content-security-policy"].split(";")]
    for directive in ("default-src 'self'", "object-src 'none'", "base-uri 'none'"):
        assert directive in csp
    assert "frame-ancestors 'none'" in csp
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"]
    assert "camera=()" in headers["permissions-policy"]
    assert headers["cross-origin-opener-policy"] == "same-origin"
    assert "server" not in headers


# --- the application over a real tree --------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    return make_site(tmp_path_factory.mktemp("unit-site"))


@pytest.fixture()
def app(site: Site) -> StaticApp:
    return StaticApp(FileSettings(site.root), app_settings=AppSettings())


def respond(
    app: StaticApp, path: bytes, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    raw_path, _, query = path.partition(b"?")
    scope = {
        "type": "http",
        "scheme": "https",
        "method": method,
        "raw_path": raw_path,
        "query_string": query,
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
    }
    response = app.respond(scope)
    body = response.body
    if response.fd is not None:
        body += os.read(response.fd, response.length)
        response.close()
    return response.status, {k.decode(): v.decode() for k, v in response.headers}, body


def test_method_not_allowed_names_allowed_methods(app: StaticApp) -> None:
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"):
        status, headers, _ = respond(app, b"/", method)
        assert (status, headers["allow"]) == (405, "GET, HEAD"), method


def test_oversized_headers_get_431(app: StaticApp) -> None:
    status, _, _ = respond(app, b"/", headers={"x-big": "a" * 64 * 1024})
    assert status == 431


def test_head_has_the_get_headers_and_no_body(app: StaticApp) -> None:
    get_status, get_headers, get_body = respond(app, b"/")
    status, headers, body = respond(app, b"/", "HEAD")
    assert (status, body) == (get_status, b"")
    assert headers == get_headers
    assert int(headers["content-length"]) == len(get_body)


def test_conditional_get_with_the_etag_is_304(app: StaticApp) -> None:
    _, headers, _ = respond(app, b"/census.json")
    status, again, body = respond(app, b"/census.json", headers={"if-none-match": headers["etag"]})
    assert (status, body) == (304, b"")
    assert again["etag"] == headers["etag"]
    assert "content-length" not in again


def test_gzip_sidecar_is_negotiated_with_vary(app: StaticApp, site: Site) -> None:
    status, headers, body = respond(app, b"/", headers={"accept-encoding": "gzip"})
    assert (status, headers["content-encoding"], headers["vary"]) == (
        200,
        "gzip",
        "accept-encoding",
    )
    assert gzip.decompress(body) == (site.root / "index.html").read_bytes()
    status, headers, body = respond(app, b"/", headers={"accept-encoding": "gzip;q=0"})
    assert "content-encoding" not in headers
    assert headers["vary"] == "accept-encoding"
    assert body == (site.root / "index.html").read_bytes()


def test_sidecar_is_not_a_resource_of_its_own(app: StaticApp) -> None:
    assert respond(app, b"/index.html.gz")[0] == 404
    status, headers, _ = respond(app, b"/archive.gz")  # a real .gz with no base file
    assert (status, headers["content-type"]) == (200, "application/gzip")


def test_folder_redirects_to_its_canonical_slash(app: StaticApp) -> None:
    status, headers, _ = respond(app, b"/innovations/kda?x=1")
    assert (status, headers["location"]) == (308, "/innovations/kda/?x=1")
    assert respond(app, b"/innovations/kda/")[0] == 200
    assert respond(app, b"/index.html/")[0] == 404


def test_redirect_location_is_never_protocol_relative(app: StaticApp) -> None:
    # "//evil.example" as a Location would send the browser to another host.
    status, headers, _ = respond(app, b"//innovations//kda")
    assert (status, headers["location"]) == (308, "/innovations/kda/")


def test_not_found_serves_404_page_with_no_store(app: StaticApp, site: Site) -> None:
    status, headers, body = respond(app, b"/no/such/page")
    assert (status, headers["cache-control"]) == (404, "no-store")
    assert body == (site.root / "404.html").read_bytes()


def test_folder_without_index_is_404_not_a_listing(app: StaticApp) -> None:
    status, _, body = respond(app, b"/empty-folder/")
    assert status == 404
    assert b"empty-folder" not in body


@pytest.mark.parametrize("path", [b"/link-out.txt", b"/dir-out/secret.txt", b"/link-in.txt"])
def test_symlinks_below_the_root_are_never_followed(app: StaticApp, path: bytes) -> None:
    status, _, body = respond(app, path)
    assert status == 404
    assert SECRET.encode() not in body


def test_fifo_is_refused_without_hanging(app: StaticApp) -> None:
    assert respond(app, b"/fifo")[0] == 404


def test_fingerprinted_asset_is_immutable(app: StaticApp) -> None:
    _, headers, _ = respond(app, FINGERPRINTED_CSS.encode())
    assert headers["cache-control"] == "public, max-age=31536000, immutable"
    _, headers, _ = respond(app, b"/")
    assert headers["cache-control"] == "no-cache"


def test_big_file_streams_from_its_fd(app: StaticApp, site: Site) -> None:
    scope = {"type": "http", "scheme": "https", "method": "GET", "raw_path": b"/big.bin"}
    response = app.respond(scope)
    try:
        assert response.fd is not None and response.length == (site.root / "big.bin").stat().st_size
    finally:
        response.close()


# Every branch of lookup: the root, a file, a descent, a folder with and without its slash, a
# miss after a descent, a file named as a folder, a sidecar by name, a symlinked folder, a FIFO,
# gzip and identity.
LOOKUPS = [b"/", b"/notes.txt", b"/innovations/kda/", b"/innovations/kda", b"/innovations/nope",
           b"/innovations/kda/index.html", b"/notes.txt/", b"/index.html.gz",
           b"/dir-out/secret.txt", b"/fifo", b"/empty-folder/", b"/archive.gz",
           b"/missing"]  # fmt: skip


@pytest.mark.parametrize("gzip_ok", [False, True])
def test_lookup_closes_every_folder_it_opens_and_never_the_root(site: Site, gzip_ok: bool) -> None:
    settings = FileSettings(site.root)
    root_fd = files.open_snapshot(site.root)
    try:
        before = sorted(os.listdir("/proc/self/fd"))
        for raw in LOOKUPS * 3:
            try:
                found = files.lookup(
                    root_fd, files.parse_request_path(raw, settings), gzip_ok, settings
                )
            except Refused:
                found = None
            if isinstance(found, files.Found):
                os.close(found.fd)
            os.fstat(root_fd)  # still open: EBADF here means lookup closed the caller's root
        assert sorted(os.listdir("/proc/self/fd")) == before
    finally:
        os.close(root_fd)


def test_plain_http_redirects_to_the_configured_host_only(site: Site) -> None:
    app = StaticApp(
        FileSettings(site.root),
        app_settings=AppSettings(redirect_host="k3.example", redirect_https_port=8443),
    )
    scope = {
        "type": "http",
        "scheme": "http",
        "method": "GET",
        "raw_path": b"/a b/%2e",
        "query_string": b"q=1",
        "headers": [(b"host", b"evil.example")],
    }
    response = app.respond(scope)
    headers = dict(response.headers)
    assert response.status == 308
    assert headers[b"location"] == b"https://k3.example:8443/a%20b/%2e?q=1"
    assert b"strict-transport-security" not in headers  # RFC 6797 7.2


# --- snapshots and the cache ----------------------------------------------------------------


def test_cache_never_serves_the_old_build_after_a_swap(tmp_path: Path) -> None:
    """Two builds whose files have identical names, sizes and mtimes: only identity differs."""
    a = make_site(tmp_path / "a", "A").root
    b = make_site(tmp_path / "b", "B").root
    for path in a.rglob("*"):
        twin = b / path.relative_to(a)
        if path.is_file() and not path.is_symlink() and twin.is_file():
            stat = path.stat()
            os.utime(twin, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    link = tmp_path / "public"
    link.symlink_to(a)
    app = StaticApp(FileSettings(link))
    assert b"build A" in respond(app, b"/")[2]
    tmp_link = tmp_path / "public.new"
    tmp_link.symlink_to(b)
    os.replace(tmp_link, link)  # build.py's atomic publish
    assert b"build B" in respond(app, b"/")[2]
    assert respond(app, b"/big.bin")[2][:1] == b"B"


def test_lifespan_and_websocket_scopes() -> None:
    import asyncio

    app = StaticApp(SETTINGS)
    sent: list[dict[str, object]] = []
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, object]:
        return inbox.pop(0)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    asyncio.run(app({"type": "lifespan"}, receive, send))
    asyncio.run(app({"type": "websocket"}, receive, send))
    assert [m["type"] for m in sent] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
        "websocket.close",
    ]
