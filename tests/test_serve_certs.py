"""The local CA and its leaf: algorithms, names, lifetimes, key modes, renewal, --print-ca."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from serve_support import REPO, require_tool

from serve.certs import CertPaths, CertSettings, ensure_local_certificates

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@pytest.fixture()
def made(tmp_path: Path) -> tuple[CertSettings, CertPaths]:
    settings = CertSettings(tmp_path / "state")
    return settings, ensure_local_certificates(settings, NOW)


def test_leaf_is_p256_for_loopback_and_at_most_90_days(
    made: tuple[CertSettings, CertPaths],
) -> None:
    _, paths = made
    leaf = load(paths.leaf_cert)
    key = leaf.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= dt.timedelta(days=90)
    assert leaf.not_valid_before_utc <= NOW < leaf.not_valid_after_utc
    assert leaf.signature_hash_algorithm is not None
    assert leaf.signature_hash_algorithm.name == "sha256"
    leaf.verify_directly_issued_by(load(paths.ca_cert))


def test_ca_is_name_constrained_to_loopback(made: tuple[CertSettings, CertPaths]) -> None:
    ca = load(made[1].ca_cert)
    constraints = ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    permitted = constraints.value.permitted_subtrees or []
    assert x509.DNSName("localhost") in permitted
    basic = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert basic.ca and basic.path_length == 0


def test_keys_are_mode_0600_and_state_dir_0700(made: tuple[CertSettings, CertPaths]) -> None:
    settings, paths = made
    for key in (paths.ca_key, paths.leaf_key):
        assert key.stat().st_mode & 0o777 == 0o600, key
    assert settings.state_dir.stat().st_mode & 0o777 == 0o700


def test_loose_key_mode_is_repaired(made: tuple[CertSettings, CertPaths]) -> None:
    settings, paths = made
    paths.leaf_key.chmod(0o644)
    ensure_local_certificates(settings, NOW)
    assert paths.leaf_key.stat().st_mode & 0o777 == 0o600


def test_openssl_verifies_the_chain(made: tuple[CertSettings, CertPaths]) -> None:
    _, paths = made
    at = str(int(NOW.timestamp()))
    command = [require_tool("openssl"), "verify", "-attime", at, "-CAfile", str(paths.ca_cert)]
    result = subprocess.run(
        [*command, str(paths.leaf_cert)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(": OK")


def test_a_fresh_leaf_is_kept(made: tuple[CertSettings, CertPaths]) -> None:
    settings, paths = made
    before = paths.leaf_cert.read_bytes()
    ensure_local_certificates(settings, NOW + dt.timedelta(days=30))
    assert paths.leaf_cert.read_bytes() == before


def test_leaf_near_expiry_is_renewed_by_the_same_ca(made: tuple[CertSettings, CertPaths]) -> None:
    settings, paths = made
    old_leaf, old_ca = load(paths.leaf_cert), paths.ca_cert.read_bytes()
    later = NOW + dt.timedelta(days=settings.leaf_days - settings.renew_within_days + 1)
    ensure_local_certificates(settings, later)
    new_leaf = load(paths.leaf_cert)
    assert new_leaf.serial_number != old_leaf.serial_number
    assert new_leaf.not_valid_after_utc > old_leaf.not_valid_after_utc
    assert paths.ca_cert.read_bytes() == old_ca  # no need to trust anything new
    new_leaf.verify_directly_issued_by(load(paths.ca_cert))


def test_corrupt_leaf_is_replaced(made: tuple[CertSettings, CertPaths]) -> None:
    settings, paths = made
    paths.leaf_cert.write_text("not a certificate")
    ensure_local_certificates(settings, NOW)
    load(paths.leaf_cert).verify_directly_issued_by(load(paths.ca_cert))


def test_print_ca_prints_the_pem_and_its_path(tmp_path: Path) -> None:
    state = tmp_path / "state"
    result = subprocess.run(
        [sys.executable, "-m", "serve", "--print-ca"],
        cwd=REPO,
        env={**os.environ, "K3SERVE_STATE": str(state)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (state / "ca.pem").read_text()
    assert result.stdout.startswith("-----BEGIN CERTIFICATE-----")
    assert str(state / "ca.pem") in result.stderr
