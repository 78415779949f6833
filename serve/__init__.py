"""HTTPS server for the built site: `python -m serve` (see serve/__main__.py).

Modules, in the order a request meets them: server (processes, sockets, signals), tls (the
TLS 1.3 context), app (the ASGI application), files (path, lookup, conditional GET,
negotiation), headers (security and cache headers), certs (the local CA).
"""
