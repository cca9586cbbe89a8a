"""A private CA and the certificates it signs, as PEM files: for a secured local Kafka and
broker nodes serving HTTPS on 127.0.0.1 (tests, the demo's secure set-up). A production
deployment brings its own CA."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    """A CA whose certificate (`cert`) clients trust and whose key signs others."""

    cert: Path
    key: Path

    def issue(self, folder: Path, name: str, hosts: list[str], client: bool = False) -> Issued:
        """A certificate for `hosts` (names or IP addresses), as `<name>.pem` and
        `<name>-key.pem` in `folder`; `client` also allows it for mutual TLS."""
        ca_cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        ca_key = serialization.load_pem_private_key(self.key.read_bytes(), password=None)
        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = []
        for host in hosts:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                alt.append(x509.DNSName(host))
        usages = [ExtendedKeyUsageOID.SERVER_AUTH]
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        )
        return Issued(_write_cert(folder, name, cert), _write_key(folder, name, key))


def run(folder: Path, hosts: list[str]) -> int:
    """`dejaq certs DIR HOST...`: a CA in DIR (made once, then reused) and a certificate
    for HOSTs signed by it, for nodes serving HTTPS; prints the files."""
    ca = Authority(folder / "ca.pem", folder / "ca-key.pem")
    if not ca.cert.exists():
        ca = new_authority(folder)
    issued = ca.issue(folder, "node", hosts or ["127.0.0.1", "localhost"], client=True)
    print(f"ca:   {ca.cert}  (give it to clients: --cacert, Client(verify=...))")
    print(f"cert: {issued.cert}")
    print(f"key:  {issued.key}")
    return 0


def new_authority(folder: Path, name: str = "dejaq-local-ca") -> Authority:
    """A fresh self-signed CA in `folder` (`ca.pem`, `ca-key.pem`)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=VALID_DAYS))
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
    return Authority(_write_cert(folder, "ca", cert), _write_key(folder, "ca", key))


def _write_cert(folder: Path, name: str, cert: x509.Certificate) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(folder: Path, name: str, key: ec.EllipticCurvePrivateKey) -> Path:
    """PKCS#8, unencrypted, owner-only: what uvicorn and Kafka's PEM key stores read."""
    path = folder / f"{name}-key.pem"
    path.touch(mode=0o600)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path
