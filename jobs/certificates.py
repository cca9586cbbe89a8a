"""A private CA and the certificates it signs, as PEM files: for a secured local Kafka and
broker nodes serving HTTPS on 127.0.0.1 (tests, the demo's secure set-up). A production
deployment brings its own CA."""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365  # a certificate's, within its CA's
CA_VALID_DAYS = 3650
# A CA this close to its end is not reused: what it signed would stop working soon after.
CA_LEFT_AT_LEAST = dt.timedelta(days=30)
NAME = re.compile(r"[A-Za-z0-9._-]+")


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
        until = min(now + dt.timedelta(days=VALID_DAYS), ca_cert.not_valid_after_utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(until)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),  # type: ignore[arg-type]
                critical=False,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        )
        return Issued(_write_cert(folder, name, cert), _write_key(folder, name, key))


def run(folder: Path, hosts: list[str], name: str = "node", force: bool = False) -> int:
    """`dejaq certs DIR HOST... [--name NAME] [--force]`: a CA in DIR (made once, then
    reused while it has a month left) and a certificate for HOSTs signed by it, as
    NAME.pem and NAME-key.pem, for nodes serving HTTPS; prints the files. Another host's
    certificate under that name is not replaced without `force`."""
    if not NAME.fullmatch(name) or name == "ca":
        print(f"error: --name {name!r}: letters, digits and ._- (not 'ca')", file=sys.stderr)
        return 2
    hosts = hosts or ["127.0.0.1", "localhost"]
    ca = Authority(folder / "ca.pem", folder / "ca-key.pem")
    why = unfit(ca) if ca.cert.exists() else None
    if why is None and not force:
        why = _taken(folder / f"{name}.pem", hosts)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 1
    if not ca.cert.exists():
        ca = new_authority(folder)
    issued = ca.issue(folder, name, hosts, client=True)
    print(f"ca:   {ca.cert}  (give it to clients: --cacert, Client(verify=...))")
    print(f"cert: {issued.cert}")
    print(f"key:  {issued.key}")
    return 0


def unfit(ca: Authority) -> str | None:
    """Why the CA in place must not sign another certificate, if so."""
    if not ca.key.exists():
        return f"{ca.cert} has no key beside it ({ca.key}) to sign with"
    ends = x509.load_pem_x509_certificate(ca.cert.read_bytes()).not_valid_after_utc
    if ends - dt.datetime.now(dt.UTC) >= CA_LEFT_AT_LEAST:
        return None
    state = "expired" if ends <= dt.datetime.now(dt.UTC) else "expires"
    return (
        f"the CA {ca.cert} {state} {ends:%Y-%m-%d %H:%M} UTC: move {ca.cert.name} and "
        f"{ca.key.name} out of {ca.cert.parent} to make a new CA, issue every node's "
        "certificate again, and give clients the new CA"
    )


def _taken(cert: Path, hosts: list[str]) -> str | None:
    """Why `cert` may not be replaced by one for `hosts`: it is another host's."""
    if not cert.exists():
        return None
    held = hosts_of(cert)
    if held == {_host(h) for h in hosts}:
        return None  # the same host's, issued again
    named = ", ".join(sorted(held)) if held else "other hosts"
    return (
        f"{cert} is the certificate of {named}: give this one a name of its own "
        f"(--name), or --force to replace it"
    )


def hosts_of(cert: Path) -> set[str]:
    """The names and addresses a certificate is for (none, if it names none)."""
    try:
        loaded = x509.load_pem_x509_certificate(cert.read_bytes())
        names = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return set()
    return {str(v).lower() for v in names.get_values_for_type(x509.DNSName)} | {
        str(v) for v in names.get_values_for_type(x509.IPAddress)
    }


def _host(host: str) -> str:
    """A host as `hosts_of` gives it: an address in its canonical form, a name lower-case."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()


def new_authority(
    folder: Path, name: str = "dejaq-local-ca", days: int = CA_VALID_DAYS
) -> Authority:
    """A fresh self-signed CA in `folder` (`ca.pem`, `ca-key.pem`), valid `days`."""
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
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
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
