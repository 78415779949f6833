"""Response header sets: the security headers every HTTPS response carries, and caching policy.

All of it is decided from the URL and status alone, so it is testable without a socket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Header = tuple[bytes, bytes]


@dataclass(frozen=True)
class HeaderSettings:
    """Security headers. Defaults follow Mozilla's web security guidelines for a static site."""

    # Two years, the minimum for the HSTS preload list and Mozilla's "modern" profile. The cost:
    # for that long a browser refuses plain HTTP to this host name (for localhost: on every port).
    hsts_max_age: int = 63072000
    # Extending HSTS to subdomains commits hosts this server does not control; opt in only.
    hsts_include_subdomains: bool = False
    # Only same-origin resources; no plugins, no <base> hijack, no framing (clickjacking), forms
    # post only here. The site has no inline script or style, so it needs no 'unsafe-inline'.
    content_security_policy: str = (
        "default-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'self'"
    )
    # The site links to evidence elsewhere; those hosts learn nothing about where readers came
    # from. The cost: no referrer analytics, which this site does not have.
    referrer_policy: str = "no-referrer"
    # Powerful features a static page never needs, denied to it and to anything it embeds.
    # Only names Chromium knows: an unknown one costs a console error on every page.
    permissions_policy: str = (
        "accelerometer=(), camera=(), geolocation=(), gyroscope=(), magnetometer=(), "
        "microphone=(), payment=(), usb=()"
    )
    # A separate browsing-context group: a cross-origin opener cannot script this window.
    cross_origin_opener_policy: str = "same-origin"
    # More (name, value) pairs for a deployment that wants them, such as
    # ("cross-origin-resource-policy", "same-origin"). Each header costs every response a
    # little: hypercorn validates each one, so the default set is the minimum that matters.
    extra: tuple[tuple[str, str], ...] = ()


def security_headers(settings: HeaderSettings) -> tuple[Header, ...]:
    """Headers sent on every HTTPS response, errors included. (No `server`: no banner.)"""
    hsts = f"max-age={settings.hsts_max_age}"
    if settings.hsts_include_subdomains:
        hsts += "; includeSubDomains"
    pairs = [
        ("strict-transport-security", hsts),
        ("content-security-policy", settings.content_security_policy),
        # Without it a browser may sniff a text file as HTML and run script in it.
        ("x-content-type-options", "nosniff"),
        ("referrer-policy", settings.referrer_policy),
        ("permissions-policy", settings.permissions_policy),
        ("cross-origin-opener-policy", settings.cross_origin_opener_policy),
        # No X-Frame-Options: CSP frame-ancestors supersedes it in every browser that has CSP 2.
        *settings.extra,
    ]
    return tuple((name.encode("latin-1"), value.encode("latin-1")) for name, value in pairs)


# build.py names fingerprinted assets `name.<10 lowercase hex>.ext` under /assets/: the name
# changes whenever the content does, so a cached copy can never be stale.
FINGERPRINTED = re.compile(r"^/assets/(?:[^/]+/)*[^/]+\.[0-9a-f]{10}\.[A-Za-z0-9]+$")

IMMUTABLE = "public, max-age=31536000, immutable"  # one year, the longest RFC 9111 suggests
REVALIDATE = "no-cache"  # may be stored, but asked about (cheaply, with the ETag) before use
NO_STORE = "no-store"  # never kept: error pages must not outlive the error


# serve only ever redirects with 308; nginx may use the others, and must cache them alike.
REDIRECTS = frozenset({301, 302, 303, 307, 308})


def cache_control(url: str, status: int) -> str:
    """Caching policy from the canonical URL path and the status."""
    return cache_policy(FINGERPRINTED.match(url) is not None, status)


def cache_policy(fingerprinted: bool, status: int) -> str:
    """Caching policy from whether the URL is fingerprinted and the status.

    Split from `cache_control` so nginx.py can evaluate it for every status, fingerprinted or
    not: the two servers then share this one function rather than two copies of it.
    """
    if status >= 400:
        # A 404 cached for a URL that a later build adds would hide the new page.
        return NO_STORE
    if status in REDIRECTS:
        # A folder redirect: the next build may turn the folder into a file.
        return REVALIDATE
    if fingerprinted:
        return IMMUTABLE
    # HTML and every unfingerprinted file: the next build may change it under the same URL.
    return REVALIDATE
