"""TLS 1.3-only server context, and the hypercorn Config that uses it.

Hypercorn's own `Config.create_ssl_context` allows TLS 1.2 and overwrites the default options
with OP_NO_COMPRESSION alone. `HardenedConfig.create_ssl_context` builds the context here
instead: Mozilla's "modern" profile (TLS 1.3 only; its three AEAD suites are OpenSSL's TLS 1.3
defaults; groups X25519, P-256, P-384).

Python 3.11's `ssl` can restrict key exchange to one group only (`set_ecdh_curve`); the modern
profile needs three. `_set_groups` therefore calls OpenSSL's `SSL_CTX_set1_groups_list` through
ctypes on the context's own SSL_CTX, after checking that the pointer really is that context.
"""

from __future__ import annotations

import _ssl
import ctypes
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

from hypercorn.config import Config, Sockets

# OpenSSL 1.1.1 and 3.x, ssl.h: SSL_CTX_set1_groups_list(ctx, s) is
# SSL_CTX_ctrl(ctx, SSL_CTRL_SET_GROUPS_LIST, 0, s); the min-version getter is a ctrl as well.
SSL_CTRL_SET_GROUPS_LIST = 92
SSL_CTRL_GET_MIN_PROTO_VERSION = 130
TLS1_3_VERSION = 0x0304


@dataclass(frozen=True)
class TLSSettings:
    """The certificate and the protocol surface offered to clients."""

    # PEM chain (leaf first) and its key; the local CA's by default, real ones via --cert/--key.
    certfile: Path
    keyfile: Path
    # Mozilla modern: X25519, P-256, P-384. Leaving out X448, P-521 and the FFDHE groups costs no
    # client that matters and shrinks the code a handshake can reach.
    groups: str = "X25519:P-256:P-384"
    # h2 first: one connection per client instead of six; http/1.1 for curl, wrk and old clients.
    alpn: tuple[str, ...] = ("h2", "http/1.1")
    # Seconds a client may take to finish the handshake. Short: a real handshake on loopback or
    # the internet takes milliseconds to a few round trips; a stalled one only holds a socket.
    handshake_timeout: float = 10.0


def build_ssl_context(settings: TLSSettings) -> ssl.SSLContext:
    """A server context that speaks TLS 1.3 and nothing else."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # TLS 1.2 and below are refused outright (RFC 8996 deprecates 1.0/1.1; the profile drops 1.2).
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.maximum_version = ssl.TLSVersion.TLSv1_3
    # Keep Python's defaults (OP_ALL workarounds, no SSLv2/3, single-use ECDH) and add:
    # no TLS compression (CRIME; RFC 7540 9.2.1 requires it off for h2), no renegotiation.
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    # Mozilla modern: the client picks among equally strong suites (it knows if it has AES-NI).
    context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    context.set_alpn_protocols(list(settings.alpn))
    context.load_cert_chain(certfile=str(settings.certfile), keyfile=str(settings.keyfile))
    _set_groups(context, settings.groups)
    return context


def _ssl_ctx_pointer(context: ssl.SSLContext) -> int:
    """The SSL_CTX* inside a Python SSLContext (CPython's PySSLContext: PyObject_HEAD, ctx)."""
    return ctypes.c_void_p.from_address(id(context) + object.__basicsize__).value or 0


def _set_groups(context: ssl.SSLContext, groups: str) -> None:
    """Restrict key-exchange groups; fail loudly rather than serve with OpenSSL's defaults."""
    library = ctypes.CDLL(_ssl.__file__)  # dlsym on it also searches its libssl dependency
    ctrl = library.SSL_CTX_ctrl
    ctrl.restype = ctypes.c_long
    ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    get_options = library.SSL_CTX_get_options
    get_options.restype = ctypes.c_uint64
    get_options.argtypes = [ctypes.c_void_p]
    pointer = _ssl_ctx_pointer(context)
    # Two independent readings must agree before we write through the pointer: a wrong pointer
    # (another CPython layout) would otherwise corrupt memory instead of failing.
    if (
        not pointer
        or get_options(pointer) != int(context.options)
        or ctrl(pointer, SSL_CTRL_GET_MIN_PROTO_VERSION, 0, None) != TLS1_3_VERSION
    ):
        raise RuntimeError("cannot reach OpenSSL's SSL_CTX to restrict TLS groups")
    if ctrl(pointer, SSL_CTRL_SET_GROUPS_LIST, 0, ctypes.c_char_p(groups.encode("ascii"))) != 1:
        raise ValueError(f"OpenSSL rejected the TLS group list {groups!r}")


class HardenedConfig(Config):
    """hypercorn Config whose TLS context and listening sockets are built here."""

    def __init__(self, tls: TLSSettings, sockets: Sockets) -> None:
        super().__init__()
        self.tls = tls
        self.prepared_sockets = sockets
        # ssl_enabled in hypercorn means "both set"; the paths are ours.
        self.certfile = str(tls.certfile)
        self.keyfile = str(tls.keyfile)
        self.alpn_protocols = list(tls.alpn)
        self.ssl_handshake_timeout = tls.handshake_timeout
        self.ssl_context: ssl.SSLContext | None = None
        self._response_headers: dict[str, tuple[int, list[tuple[bytes, bytes]]]] = {}

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        """hypercorn's Date and Server headers, made once a second rather than per response.

        Date has one-second resolution, and hypercorn formatted it afresh for every response:
        about 2% of a small request's CPU here (bench/bench_serve.py, py-spy).
        """
        second = int(time.time())
        made = self._response_headers.get(protocol)
        if made is None or made[0] != second:
            made = (second, super().response_headers(protocol))
            self._response_headers[protocol] = made
        return list(made[1])  # callers may extend what they get

    def create_ssl_context(self) -> ssl.SSLContext:
        # Kept, so a renewed certificate can be loaded into the live context.
        self.ssl_context = build_ssl_context(self.tls)
        return self.ssl_context

    def create_sockets(self) -> Sockets:
        return self.prepared_sockets


def bind_listener(host: str, port: int, reuse_port: bool, backlog: int) -> socket.socket:
    """A listening TCP socket.

    With `reuse_port`, each worker process binds its own socket to the same address and the
    kernel spreads new connections across them by hash. Hypercorn's own multi-worker mode shares
    one socket instead, and there one worker's accept loop can win almost every connection.
    Linux only lets sockets of the same user join a SO_REUSEPORT group, so another user cannot
    hijack the port; a stale copy of this server run by the same user could, which is why the
    supervisor first proves the port free (see server.py).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            # "::1" means IPv6 loopback only, not also IPv4 through mapped addresses.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
