"""The ASGI application: one request in, one static response out.

`StaticApp.respond` makes every decision synchronously and returns a `Response` value, so the
whole request path is testable without a socket; `__call__` only sends that value. Failures
become statuses in exactly two places: `files.Refused` (raised where the decision is made) and
`_refusal` here (the one place a refusal becomes a response).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, NamedTuple
from urllib.parse import quote_from_bytes

from . import files
from .files import FileSettings, Found, Redirect, Refused
from .headers import NO_STORE, REVALIDATE, Header, HeaderSettings, cache_control, security_headers

ALLOWED_METHODS = frozenset({"GET", "HEAD"})
ALLOW = b"GET, HEAD"
# Request headers the decisions read; all others are only counted toward the size limit.
WANTED_HEADERS = frozenset(
    {
        b"accept-encoding",
        b"if-none-match",
        b"if-modified-since",
        b"sec-fetch-site",
        b"referer",
        b"host",
    }
)
# RFC 3986 query characters, plus "%" so existing escapes pass through unchanged.
QUERY_SAFE = "!$&'()*+,;=:@/?%-._~"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class AppSettings:
    """Request-level limits of the application itself."""

    # Total bytes of request header names and values accepted; more gets 431. 16 KiB holds any
    # real browser's headers with room to spare and bounds what one request makes us parse.
    max_header_bytes: int = 16 * 1024
    # When set, plain-HTTP requests are redirected to https://<this host>. A fixed name, never
    # the request's Host header: trusting that would make us an open redirector.
    redirect_host: str | None = None
    # The HTTPS port named in those redirects (omitted from the URL when 443).
    redirect_https_port: int = 443
    # Serve gzip to requests another site's page made. Off: that is how BREACH is delivered
    # (files.is_cross_site). Cost: the first page of a visit arriving by a link from another
    # site is sent uncompressed; everything after it is same-origin and compressed.
    compress_cross_site: bool = False


@dataclass
class Response:
    """Status, headers and body; a file body streams from `fd` (`length` bytes) after `body`."""

    status: int
    headers: Sequence[Header] = ()
    body: bytes = b""
    fd: int | None = None
    length: int = 0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass(frozen=True)
class Prepared:
    """A remembered response for one file: headers, validator, and the body when small."""

    headers: tuple[Header, ...]  # shared by every response for this file: never mutated
    etag: str
    body: bytes | None


# Refusals are short plain text: nothing in them for a browser to render or a cache to keep.
REFUSAL_TYPE = "text/plain; charset=utf-8"


def refusal_body(status: int) -> bytes:
    """The whole body of a refusal ("405 Method Not Allowed\\n"); nginx.py sends the same."""
    return f"{status} {HTTPStatus(status).phrase}\n".encode("ascii")


# A 304 carries no body, so no header that describes one (RFC 9110 15.4.5).
NOT_IN_304 = frozenset({b"content-type", b"content-length", b"content-encoding"})


class RequestInfo(NamedTuple):
    """The parts of a request the decisions use, read once from the ASGI scope (a NamedTuple:
    immutable, and built in a third of a frozen dataclass's time on every request)."""

    method: str
    raw_path: bytes
    query: bytes
    header_bytes: int
    accept_encoding: str | None
    if_none_match: str | None
    if_modified_since: str | None
    sec_fetch_site: str | None = None
    referer: str | None = None
    host: str | None = None

    @classmethod
    def from_scope(cls, scope: Scope) -> RequestInfo:
        total, wanted = _read_headers(scope.get("headers", ()))
        raw_path = scope.get("raw_path") or scope.get("path", "/").encode("utf-8")
        get = wanted.get
        return cls(  # positional, in field order: a third faster than keywords, per request
            scope.get("method", "GET"),
            raw_path,
            scope.get("query_string", b""),
            total,
            get(b"accept-encoding"),
            get(b"if-none-match"),
            get(b"if-modified-since"),
            get(b"sec-fetch-site"),
            get(b"referer"),
            get(b"host"),
        )


def _read_headers(raw: Iterable[tuple[bytes, bytes]]) -> tuple[int, dict[bytes, str]]:
    total = 0
    wanted: dict[bytes, str] = {}
    for name, value in raw:
        total += len(name) + len(value)
        if name in WANTED_HEADERS:
            text = value.decode("latin-1")
            # Repeated fields are one comma-separated list (RFC 9110 5.3).
            wanted[name] = f"{wanted[name]}, {text}" if name in wanted else text
    return total, wanted


class StaticApp:
    """Serves the files under `files.root`, one snapshot per request, and nothing else."""

    def __init__(
        self,
        file_settings: FileSettings,
        header_settings: HeaderSettings | None = None,
        app_settings: AppSettings | None = None,
    ) -> None:
        self.files = file_settings
        self.settings = app_settings or AppSettings()
        self.security = security_headers(header_settings or HeaderSettings())
        self.cache = files.LRUCache(
            file_settings.cache_max_entries, file_settings.cache_max_total_bytes
        )
        # A pure function of the path's bytes, and a site is a few hundred paths. Refusals are
        # not remembered, so a scan of made-up paths cannot fill it with them.
        self.parse_path = functools.lru_cache(maxsize=1024)(
            functools.partial(files.parse_request_path, settings=file_settings)
        )

    # --- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            response = self.respond(scope)
            await self._send(response, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:
            # WebSocket (HTTP/1.1 Upgrade or HTTP/2 CONNECT): a static site has none; refusing
            # before accept makes hypercorn answer 403.
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _send(self, response: Response, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": response.headers,
                }
            )
            if response.fd is None:
                await send({"type": "http.response.body", "body": response.body})
                return
            remaining = response.length
            while remaining > 0:
                chunk = os.read(response.fd, min(self.files.chunk_bytes, remaining))
                if not chunk:
                    break  # the file shrank under us; the short body makes the client notice
                remaining -= len(chunk)
                await send(
                    {"type": "http.response.body", "body": chunk, "more_body": remaining > 0}
                )
            if remaining > 0:
                await send({"type": "http.response.body", "body": b""})
        finally:
            response.close()

    # --- decisions -------------------------------------------------------------------------

    def respond(self, scope: Scope) -> Response:
        """The whole answer to one HTTP request, decided without touching the connection."""
        request = RequestInfo.from_scope(scope)
        if scope.get("scheme") != "https":
            return self._to_https(request)
        if request.header_bytes > self.settings.max_header_bytes:
            # Oversized headers: memory and parser exhaustion.
            return self._refusal(Refused(431, "request headers too large"), request)
        if request.method not in ALLOWED_METHODS:
            # A static site has nothing to POST, PUT or DELETE to; say what is allowed.
            response = self._refusal(Refused(405, f"method {request.method}"), request)
            response.headers = [*response.headers, (b"allow", ALLOW)]
            return response
        try:
            root_fd = files.open_snapshot(self.files.root)
        except Refused as refusal:
            return self._refusal(refusal, request)
        try:
            return self._respond_in_snapshot(root_fd, request)
        finally:
            os.close(root_fd)

    def _respond_in_snapshot(self, root_fd: int, request: RequestInfo) -> Response:
        gzip_ok = files.accepts_gzip(request.accept_encoding) and (
            self.settings.compress_cross_site
            or not files.is_cross_site(request.sec_fetch_site, request.referer, request.host)
        )
        try:
            path = self.parse_path(request.raw_path)
            found = files.lookup(root_fd, path, gzip_ok, self.files)
        except Refused as refusal:
            if refusal.status == 404:
                return self._not_found(root_fd, request, gzip_ok)
            return self._refusal(refusal, request)
        if isinstance(found, Redirect):
            return self._redirect(found.location, request.query)
        return self._file_response(found, request, 200)

    def _file_response(self, found: Found, request: RequestInfo, status: int) -> Response:
        try:
            prepared = self._prepared(found, status)
        except BaseException:
            os.close(found.fd)  # a failed read must not leak the descriptor
            raise
        if status == 200 and files.is_not_modified(
            request.if_none_match, request.if_modified_since, prepared.etag, found.stat.st_mtime
        ):
            os.close(found.fd)
            # RFC 9110 15.4.5: a 304 repeats the validators and caching headers, without body.
            return Response(304, [h for h in prepared.headers if h[0] not in NOT_IN_304])
        if request.method == "HEAD":
            os.close(found.fd)
            return Response(status, prepared.headers)
        if prepared.body is not None:
            os.close(found.fd)
            return Response(status, prepared.headers, body=prepared.body)
        return Response(status, prepared.headers, fd=found.fd, length=found.stat.st_size)

    def _prepared(self, found: Found, status: int) -> Prepared:
        """The header block (and small body) for this exact file, made once and remembered.

        Keyed by the opened file's identity (see files.file_identity) plus everything else the
        headers depend on, so an entry can only ever be reused for the same bytes.
        """
        key = (
            files.file_identity(found.stat),
            found.encoding,
            found.has_variants,
            found.url,
            status,
        )
        prepared = self.cache.get(key)
        if isinstance(prepared, Prepared):
            return prepared
        size = found.stat.st_size
        body = files.read_whole(found.fd, size) if size <= self.files.cache_max_file_bytes else None
        etag = files.make_etag(found.stat, found.encoding)
        if body is not None and len(body) != size:
            # Short read: the file changed under us. Send what we have and remember nothing.
            return Prepared(self._file_headers(found, status, len(body), etag), etag, body)
        prepared = Prepared(self._file_headers(found, status, size, etag), etag, body)
        self.cache.put(key, prepared, cost=size if body is not None else 0)
        return prepared

    def _file_headers(self, found: Found, status: int, size: int, etag: str) -> tuple[Header, ...]:
        headers = [
            (b"content-type", files.content_type(found.name).encode("latin-1")),
            (b"content-length", str(size).encode("latin-1")),
            (b"cache-control", cache_control(found.url, status).encode("latin-1")),
        ]
        if status == 200:
            headers.append((b"etag", etag.encode("latin-1")))
            headers.append((b"last-modified", files.last_modified(found.stat).encode("latin-1")))
        if found.encoding is not None:
            headers.append((b"content-encoding", found.encoding.encode("latin-1")))
        if found.has_variants:
            # Caches must key this URL on Accept-Encoding, or they hand gzip to clients that
            # cannot read it (and identity to those that asked for gzip).
            headers.append((b"vary", b"accept-encoding"))
        headers.extend(self.security)
        return tuple(headers)

    def _not_found(self, root_fd: int, request: RequestInfo, gzip_ok: bool) -> Response:
        """404 with the site's own 404.html, read from the same snapshot as the request."""
        page = files.lookup_not_found_page(root_fd, gzip_ok, self.files)
        if page is None:
            return self._refusal(Refused(404, "no 404 page"), request)
        # Conditional headers are ignored: a 404 is never "not modified".
        plain = RequestInfo(request.method, request.raw_path, b"", 0, None, None, None)
        return self._file_response(page, plain, 404)

    def _refusal(self, refusal: Refused, request: RequestInfo) -> Response:
        """The one place a refusal becomes a response: a short plain-text body, never cached."""
        body = refusal_body(refusal.status)
        headers = [
            (b"content-type", REFUSAL_TYPE.encode("latin-1")),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"cache-control", NO_STORE.encode("latin-1")),
            *self.security,
        ]
        return Response(refusal.status, headers, b"" if request.method == "HEAD" else body)

    def _redirect(self, location: str, query: bytes) -> Response:
        if query:
            location += "?" + quote_from_bytes(query, safe=QUERY_SAFE)
        headers = [
            (b"location", location.encode("ascii")),
            (b"content-length", b"0"),
            (b"cache-control", REVALIDATE.encode("latin-1")),
            *self.security,
        ]
        # 308 keeps the method (RFC 9110 15.4.9), so the redirect never turns into a GET.
        return Response(308, headers)

    def _to_https(self, request: RequestInfo) -> Response:
        """The plain-HTTP listener: redirect to the one configured HTTPS host, or refuse."""
        host = self.settings.redirect_host
        if host is None:
            # Plain HTTP reached us without a redirect configured: serve nothing in clear text.
            return Response(421, [(b"content-length", b"0"), (b"cache-control", b"no-store")])
        port = self.settings.redirect_https_port
        authority = host if port == 443 else f"{host}:{port}"
        raw = request.raw_path if request.raw_path.startswith(b"/") else b"/"
        # Re-encode rather than copy: no byte of the request reaches the header unescaped.
        path = quote_from_bytes(raw, safe="/" + QUERY_SAFE)
        location = f"https://{authority}{path}"
        if request.query:
            location += "?" + quote_from_bytes(request.query, safe=QUERY_SAFE)
        # No HSTS here: RFC 6797 7.2 forbids it over plain HTTP.
        headers = [
            (b"location", location.encode("ascii")),
            (b"content-length", b"0"),
            (b"cache-control", b"no-cache"),
        ]
        return Response(308, headers)
