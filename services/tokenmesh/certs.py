"""``tokenmesh certs``: a development CA and a certificate per service, with the identities the mesh checks.

Each certificate carries its service's identity as a SPIFFE-style URI SAN,
``spiffe://tokenmesh/<role>`` (router, worker, prober, gateway, client), and
the names it is reached by as DNS and IP SANs (``localhost`` and 127.0.0.1 for
the embedded mesh; more with ``--host``). Each is good for both ends of a TLS
connection (serverAuth and clientAuth), since every service is a client of
another. Files, PEM: ``ca.crt`` (and ``ca.key``, kept to sign more),
``<role>.crt`` and ``<role>.key``. For development and tests: a production
deployment takes its certificates from its own CA (the chart: cert-manager).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tokenmesh.tls import SPIFFE_PREFIX

ROLES = ("router", "worker", "prober", "gateway", "client")
"""The identities a mesh has; `client` is a caller of the Inference API (grpcurl, an internal service)."""


def identity(role: str) -> str:
    """The URI SAN of a role."""
    return f"{SPIFFE_PREFIX}{role}"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(
    folder: Path, days: int = 365, name: str = "tokenmesh development CA"
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA, written as folder/ca.crt and folder/ca.key."""
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / "ca.crt", cert.public_bytes(serialization.Encoding.PEM))
    _write(folder / "ca.key", _pem_key(key), private=True)
    return cert, key


def issue(  # wide: keyword-only certificate fields, each with a default
    folder: Path,
    role: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    *,
    hosts: Iterable[str] = ("localhost", "127.0.0.1"),
    days: int = 90,
    name: str = "",
    not_before: datetime.datetime | None = None,
    uri: str | None = None,
) -> tuple[Path, Path]:
    """A certificate for role signed by ca, written as folder/<name or role>.crt and .key; returns the paths.

    ``uri`` overrides the identity (tests of foreign identities); ``not_before``
    and ``days`` make expired or not-yet-valid certificates for tests.
    """
    ca_cert, ca_key = ca
    key = _key()
    start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri or identity(role))]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tokenmesh {role}")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    stem = name or role
    cert_path, key_path = folder / f"{stem}.crt", folder / f"{stem}.key"
    _write(key_path, _pem_key(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def make_dev_certs(folder: Path, hosts: Iterable[str] = ("localhost", "127.0.0.1"), days: int = 90) -> Path:
    """A CA and one certificate per role in folder (created if missing); returns folder."""
    ca = make_ca(folder, days=max(days, 365))
    for role in ROLES:
        issue(folder, role, ca, hosts=hosts, days=days)
    return folder
