"""Support for tests/test_lesson.py: a local HTTP server that sends the site's CSP, a browser
launcher for Debian's chromium, and a recorder of console errors, page errors, CSP violations and
any request that would leave the machine.

The real HTTPS server (`python -m serve`) is someone else's; this one only needs to serve files
under the same Content-Security-Policy, so a CSP slip in the lesson fails here first.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

CSP = "default-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
]

# Registered before any page script: every CSP violation is reported to the test through an
# exposed binding (which survives reloads), kept on window, and counted in a data attribute on
# <html> that a test can wait for with a selector. (Never wait with page.wait_for_function on a
# string: Playwright evaluates it with eval, which this CSP refuses, and the refusal is recorded.)
CSP_LISTENER = """
(() => {
  window.__cspViolations = [];
  document.addEventListener("securitypolicyviolation", (e) => {
    const v = {directive: e.violatedDirective, blocked: e.blockedURI, source: e.sourceFile,
               line: e.lineNumber, sample: e.sample};
    window.__cspViolations.push(v);
    document.documentElement.dataset.cspViolations = String(window.__cspViolations.length);
    if (window.__k3ReportCsp) window.__k3ReportCsp(JSON.stringify(v));
  });
})();
"""


class _Handler(SimpleHTTPRequestHandler):
    """Static files with the site's CSP, and nothing cached between test steps."""

    def end_headers(self) -> None:
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output quiet
        pass


@contextmanager
def serve_site(folder: Path) -> Iterator[str]:
    """Serve `folder` on 127.0.0.1 at a free port; yields the base URL (no trailing slash)."""
    handler = functools.partial(_Handler, directory=str(folder.resolve()))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@dataclass
class Recorder:
    """What went wrong in a page: console errors, uncaught exceptions, CSP violations, and
    requests to any host other than the local test server (which are aborted, never sent)."""

    base: str
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    csp_violations: list[dict[str, Any]] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)

    def attach(self, context: Any) -> None:
        """Hook a Playwright BrowserContext; call before its first page opens."""
        context.expose_binding(
            "__k3ReportCsp", lambda _source, v: self.csp_violations.append(json.loads(v))
        )
        context.add_init_script(CSP_LISTENER)
        here = urlsplit(self.base).netloc

        def route(r: Any) -> None:
            url = r.request.url
            if (
                urlsplit(url).scheme in {"http", "https", "ws", "wss"}
                and urlsplit(url).netloc != here
            ):
                self.external_requests.append(url)
                r.abort()
            else:
                r.continue_()

        context.route("**/*", route)
        context.on("page", self._attach_page)

    def _attach_page(self, page: Any) -> None:
        page.on(
            "console",
            lambda msg: (
                self.console_errors.append(f"{msg.type}: {msg.text}")
                if msg.type == "error"
                else None
            ),
        )
        page.on("pageerror", lambda exc: self.page_errors.append(str(exc)))

    def problems(self) -> list[str]:
        return [
            *(f"console {e}" for e in self.console_errors),
            *(f"page error: {e}" for e in self.page_errors),
            *(f"CSP violation: {v}" for v in self.csp_violations),
            *(f"external request: {u}" for u in self.external_requests),
        ]
