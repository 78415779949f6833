"""`python -m serve`: serve the built site over HTTPS (TLS 1.3 only, h2 and http/1.1).

python -m serve                     serve :8443; with no public/ yet, a live building page
                                    until build.py publishes the site
python -m serve --watch             also run `build.py --watch`; each new build is served
python -m serve --print-ca > ca.pem the local CA, for `curl --cacert ca.pem` or a browser
python -m serve --cert c.pem --key k.pem --host 0.0.0.0 --port 443 --workers 2
python -m serve --nginx-conf [--root public] [--cert c.pem --key k.pem] > site.conf
                                    the same policy for nginx: nginx -p DIR -c site.conf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .app import AppSettings
from .certs import CertPaths, CertSettings, default_state_dir, ensure_local_certificates
from .files import FileSettings
from .headers import HeaderSettings
from .nginx import NginxSettings, nginx_conf
from .server import Plan, ServerSettings, StartupError, build_child, needs_first_build, serve_plan
from .tls import TLSSettings

# The project root is the folder holding serve/; build.py and public/ live there.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = PROJECT_ROOT / "public"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = ServerSettings()
    p = argparse.ArgumentParser(prog="python -m serve", description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="site folder (default: public/)")
    p.add_argument("--host", default=d.host, help=f"address to listen on (default {d.host})")
    p.add_argument(
        "--port", type=int, default=d.port, help=f"HTTPS port; 0 picks one (default {d.port})"
    )
    p.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help=f"processes (default {d.workers}: cores, at most 4)",
    )
    p.add_argument("--cert", type=Path, help="PEM certificate chain (instead of the local CA's)")
    p.add_argument("--key", type=Path, help="PEM private key for --cert")
    p.add_argument(
        "--print-ca", action="store_true", help="print the local CA certificate and exit"
    )
    p.add_argument(
        "--nginx-conf",
        action="store_true",
        help="print an nginx configuration with this server's policy (for --root) and exit",
    )
    p.add_argument("--watch", action="store_true", help="run build.py --watch alongside")
    p.add_argument(
        "--build-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="pass ARG to the build.py this starts (repeatable; e.g. --build-arg=--jobs=1)",
    )
    p.add_argument("--redirect-port", type=int, help="also listen on plain HTTP, only to redirect")
    p.add_argument(
        "--redirect-host",
        default="localhost",
        help="host name HTTP redirects point to; fixed, never taken from the request",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout,
        help=f"seconds a connection may wait for a whole request head (default {d.idle_timeout:g})",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=d.read_timeout,
        help=f"seconds without a byte from the client mid-request (default {d.read_timeout:g})",
    )
    p.add_argument(
        "--handshake-timeout",
        type=float,
        default=TLSSettings.handshake_timeout,
        help=f"seconds for the TLS handshake (default {TLSSettings.handshake_timeout:g})",
    )
    p.add_argument(
        "--graceful-timeout",
        type=float,
        default=d.graceful_timeout,
        help=f"seconds to finish in-flight responses on a signal (default {d.graceful_timeout:g})",
    )
    p.add_argument(
        "--max-header-bytes",
        type=int,
        default=d.max_header_bytes,
        help=f"request head size answered with 431 above it (default {d.max_header_bytes})",
    )
    p.add_argument(
        "--cert-check-interval",
        type=float,
        default=d.cert_check_seconds,
        help="seconds between certificate renewal/reload checks",
    )
    p.add_argument("--access-log", action="store_true", help="log each request to stderr")
    return p.parse_args(argv)


def validate(args: argparse.Namespace) -> None:
    """Reject bad option values up front, each with the option's name."""
    if (args.cert is None) != (args.key is None):
        raise StartupError("--cert and --key go together")
    if args.workers < 1:
        raise StartupError(f"--workers must be at least 1, not {args.workers}")
    for name in ("port", "redirect_port"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 65535:
            raise StartupError(f"--{name.replace('_', '-')} must be 0..65535, not {value}")
    for name in (
        "idle_timeout",
        "read_timeout",
        "handshake_timeout",
        "graceful_timeout",
        "cert_check_interval",
    ):
        if getattr(args, name) <= 0:
            raise StartupError(f"--{name.replace('_', '-')} must be positive")
    if args.max_header_bytes < 1024:
        # Below this no real browser's request fits: everything would be 431.
        raise StartupError(f"--max-header-bytes must be at least 1024, not {args.max_header_bytes}")
    host = args.redirect_host
    if not host or any(c in host for c in "/\\?#@ \r\n\t") or host.startswith("["):
        # The redirect target must be a bare host name: anything else could point elsewhere.
        raise StartupError(f"--redirect-host must be a bare host name, not {host!r}")


def ensure_site(root: Path, project_root: Path | None) -> bool:
    """True when the site must be built first. Only public/ of this project is ever built (a
    site given with --root is not, since build.py only writes public/); otherwise the site must
    exist."""
    if project_root is not None and needs_first_build(root):
        return True
    if not root.exists():
        raise StartupError(f"site root {root} does not exist")
    if not root.is_dir():
        raise StartupError(f"site root {root} is not a folder")
    return False


def tls_settings(args: argparse.Namespace) -> tuple[TLSSettings, CertSettings | None]:
    if args.cert is not None:
        return TLSSettings(args.cert, args.key, handshake_timeout=args.handshake_timeout), None
    certs = CertSettings(default_state_dir())
    paths = ensure_local_certificates(certs)
    tls = TLSSettings(paths.leaf_cert, paths.leaf_key, handshake_timeout=args.handshake_timeout)
    print(
        f"serve: certificate from the local CA {paths.ca_cert} "
        f"(trust it: python -m serve --print-ca > ca.pem)",
        file=sys.stderr,
    )
    return tls, certs


def print_ca() -> int:
    certs = CertSettings(default_state_dir())
    ensure_local_certificates(certs)
    path = CertPaths.in_dir(certs.state_dir).ca_cert
    print(f"serve: local CA certificate at {path}", file=sys.stderr)
    sys.stdout.write(path.read_text())
    return 0


def print_nginx_conf(args: argparse.Namespace) -> int:
    """The production path: nginx serving --root with exactly this server's policy."""
    if args.cert is not None:
        cert, key = args.cert.absolute(), args.key.absolute()
    else:
        paths = ensure_local_certificates(CertSettings(default_state_dir()))
        cert, key = paths.leaf_cert, paths.leaf_key
    settings = NginxSettings(
        root=args.root.absolute(),
        certfile=cert,
        keyfile=key,
        listen=f"{args.host}:{args.port}",
        server=server_settings(args),
        app=AppSettings(max_header_bytes=args.max_header_bytes),
        access_log=args.access_log,
    )
    sys.stdout.write(nginx_conf(settings))
    return 0


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        host=args.host,
        port=args.port,
        workers=args.workers,
        idle_timeout=args.idle_timeout,
        read_timeout=args.read_timeout,
        graceful_timeout=args.graceful_timeout,
        max_header_bytes=args.max_header_bytes,
        redirect_port=args.redirect_port,
        access_log=args.access_log,
        cert_check_seconds=args.cert_check_interval,
    )


def build_plan(args: argparse.Namespace) -> Plan:
    root = args.root.absolute()  # not resolved: a `public` symlink is followed per request
    tls, certs = tls_settings(args)
    server = server_settings(args)
    app = AppSettings(
        max_header_bytes=args.max_header_bytes,
        redirect_host=args.redirect_host if args.redirect_port is not None else None,
    )
    return Plan(server, FileSettings(root), HeaderSettings(), app, tls, certs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate(args)
        if args.print_ca:
            return print_ca()
        if args.nginx_conf:
            return print_nginx_conf(args)
        root = args.root.absolute()
        first = ensure_site(root, PROJECT_ROOT if args.root == DEFAULT_ROOT else None)
        with build_child(PROJECT_ROOT, root, first=first, watch=args.watch, extra=args.build_arg):
            return serve_plan(build_plan(args))
    except StartupError as error:
        print(f"serve: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C before the event loop took over the signal (during a build, say): quiet exit.
        return 130


if __name__ == "__main__":
    sys.exit(main())
