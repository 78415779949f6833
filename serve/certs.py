"""The local certificate authority and the short-lived leaf it signs for loopback.

On first run this makes, in the state folder:

    ca.pem      the CA certificate: give it to curl (--cacert) or import it into a browser
    ca.key      its P-256 key, mode 0600
    leaf.pem    ECDSA P-256 leaf for localhost, 127.0.0.1, ::1; at most 90 days
    leaf.key    its key, mode 0600

The CA is name-constrained to those loopback names, so even a leaked ca.key can only mint
certificates for this machine's loopback, never for a real site. The leaf is replaced when it
nears expiry, when the CA changed, or when it does not parse; `ensure_local_certificates` is
safe to call from several processes at once (a lock file serialises them, files are replaced
atomically).
"""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

STATE_ENV = "K3SERVE_STATE"


def default_state_dir() -> Path:
    override = os.environ.get(STATE_ENV)
    if override:
        return Path(override)
    return Path.home() / ".local" / "state" / "k3serve"


@dataclass(frozen=True)
class CertSettings:
    """Where the local CA lives and how long its certificates last."""

    state_dir: Path
    # Mozilla's modern profile caps leaf lifetime at 90 days: a stolen key expires soon.
    leaf_days: int = 90
    # Renew when fewer days than this remain: a third of the lifetime, as ACME clients do, so a
    # server that runs for weeks is renewed by its periodic check long before expiry.
    renew_within_days: int = 30
    # The anchor you install once. Long, so you rarely re-trust; the name constraints make a
    # long life cheap, since the key can sign nothing but loopback.
    ca_days: int = 3650
    # Renew the CA (and so ask the user to trust it again) when it has less than this left.
    ca_renew_within_days: int = 90
    dns_names: tuple[str, ...] = ("localhost",)
    ip_addresses: tuple[str, ...] = ("127.0.0.1", "::1")
    # Certificates are backdated by this much: a client clock a little behind ours must not
    # see a certificate "from the future". Counted inside leaf_days, not added to it.
    clock_skew: dt.timedelta = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class CertPaths:
    ca_cert: Path
    ca_key: Path
    leaf_cert: Path
    leaf_key: Path

    @classmethod
    def in_dir(cls, state_dir: Path) -> CertPaths:
        return cls(
            state_dir / "ca.pem",
            state_dir / "ca.key",
            state_dir / "leaf.pem",
            state_dir / "leaf.key",
        )


def ensure_local_certificates(settings: CertSettings, now: dt.datetime | None = None) -> CertPaths:
    """Make or renew what is missing or near expiry; returns the paths, valid at `now`."""
    now = now or dt.datetime.now(dt.UTC)
    paths = CertPaths.in_dir(settings.state_dir)
    settings.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(settings.state_dir / ".lock"):
        ca_key, ca_cert, ca_renewed = _ensure_ca(paths, now, settings)
        leaf_key, leaf_cert = _load_pair(paths.leaf_key, paths.leaf_cert)
        if ca_renewed or leaf_reason(leaf_cert, leaf_key, ca_cert, now, settings):
            leaf_key = ec.generate_private_key(ec.SECP256R1())
            leaf_cert = _make_leaf(leaf_key, ca_key, ca_cert, now, settings)
            _write_private(paths.leaf_key, _key_pem(leaf_key))
            _write_public(paths.leaf_cert, leaf_cert.public_bytes(serialization.Encoding.PEM))
        for key_path in (paths.ca_key, paths.leaf_key):
            # A key made group- or world-readable by hand (or by a copy) is made private again.
            if key_path.stat().st_mode & 0o077:
                key_path.chmod(0o600)
    return paths


def _ensure_ca(
    paths: CertPaths, now: dt.datetime, settings: CertSettings
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, bool]:
    """The CA key and certificate, made anew when `ca_reason` says so; True when made."""
    key, cert = _load_pair(paths.ca_key, paths.ca_cert)
    if key is not None and cert is not None and ca_reason(cert, key, now, settings) is None:
        return key, cert, False
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _make_ca(key, now, settings)
    _write_private(paths.ca_key, _key_pem(key))
    _write_public(paths.ca_cert, cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, True


def ca_reason(
    cert: x509.Certificate | None,
    key: ec.EllipticCurvePrivateKey | None,
    now: dt.datetime,
    settings: CertSettings,
) -> str | None:
    """Why the CA must be (re)made, or None when it is good."""
    if cert is None or key is None:
        return "missing or unreadable"
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        return "key does not match certificate"
    if cert.not_valid_after_utc - now < dt.timedelta(days=settings.ca_renew_within_days):
        return "near expiry"
    return None


def leaf_reason(
    cert: x509.Certificate | None,
    key: ec.EllipticCurvePrivateKey | None,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    settings: CertSettings,
) -> str | None:
    """Why the leaf must be (re)made, or None when it is good."""
    if cert is None or key is None:
        return "missing or unreadable"
    if cert.public_key().public_numbers() != key.public_key().public_numbers():
        return "key does not match certificate"
    if cert.issuer != ca_cert.subject:
        return "signed by another CA"
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, x509.InvalidSignature):
        return "not signed by the current CA"
    if cert.not_valid_before_utc > now:
        return "not yet valid"
    if cert.not_valid_after_utc - now < dt.timedelta(days=settings.renew_within_days):
        return "near expiry"
    if _san_of(cert) != _wanted_san(settings):
        return "names changed"
    return None


def _make_ca(
    key: ec.EllipticCurvePrivateKey, now: dt.datetime, settings: CertSettings
) -> x509.Certificate:
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "k3serve local development CA"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"k3serve local CA {now:%Y-%m-%d}"),
        ]
    )
    start = now - settings.clock_skew
    permitted: list[x509.GeneralName] = [x509.DNSName(n) for n in settings.dns_names]
    permitted += [x509.IPAddress(ipaddress.ip_network(ip)) for ip in settings.ip_addresses]
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=settings.ca_days))
        # path_length=0: this CA signs leaves only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        # Critical, so a verifier that does not understand the constraint rejects the chain.
        .add_extension(x509.NameConstraints(permitted, None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _make_leaf(
    key: ec.EllipticCurvePrivateKey,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: dt.datetime,
    settings: CertSettings,
) -> x509.Certificate:
    start = now - settings.clock_skew
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, settings.dns_names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=settings.leaf_days))
        .add_extension(x509.SubjectAlternativeName(_wanted_san(settings)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _wanted_san(settings: CertSettings) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in settings.dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in settings.ip_addresses]
    return names


def _san_of(cert: x509.Certificate) -> list[x509.GeneralName]:
    try:
        return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        return []


def _load_pair(
    key_path: Path, cert_path: Path
) -> tuple[ec.EllipticCurvePrivateKey | None, x509.Certificate | None]:
    """Key and certificate from disk; (None, None) when either is missing or unreadable."""
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except (OSError, ValueError, TypeError):
        return None, None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None, None
    return key, cert


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_private(path: Path, data: bytes) -> None:
    # Created 0600 from the first byte: a chmod after writing leaves a window where the key is
    # readable under the umask's mode.
    _write_atomically(path, data, 0o600)


def _write_public(path: Path, data: bytes) -> None:
    _write_atomically(path, data, 0o644)


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Write beside, then rename: a reader (another worker) sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # O_CREAT's mode is filtered by the umask; set it exactly
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class _locked:
    """An exclusive flock on `path` for the duration of a with-block."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
