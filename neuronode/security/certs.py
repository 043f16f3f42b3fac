"""A swarm certificate authority and node certificates for mutual TLS.

A closed swarm has one CA (`neuronode ca init`); its operator issues each node a certificate
(`neuronode ca issue`). Every node is both a server and a client of its peers, so node
certificates carry serverAuth and clientAuth, and servers require a client certificate from the
same CA: a node without one cannot even finish the TLS handshake.

Keys are EC P-256, written unencrypted with mode 0600. The CA key admits nodes to the swarm;
keep it off the nodes.

This module is the certificate crypto (it needs only `cryptography`: the `neuronode ca` commands
run on the operator's machine); gRPC credentials live in neuronode.security.tls and the `ca`
command line in neuronode.security.ca_cli.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from neuronode.errors import NeuronodeError

CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
CA_DAYS = 3650
NODE_DAYS = 825
LOOPBACK_HOSTS = ("localhost", "127.0.0.1")
# Certificates start a little in the past so a peer whose clock runs behind accepts them.
BACKDATE = timedelta(minutes=5)
MAX_CN_CHARS = 64  # X.520 upper bound for commonName

_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_DNS_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DNS_NAME = re.compile(rf"^(\*\.)?{_DNS_LABEL}(\.{_DNS_LABEL})*$")


class CertError(NeuronodeError, ValueError):
    """A certificate, key or host name that cannot be used; the message says what to do."""

    exit_code = 2


# --- creating ---------------------------------------------------------------------------------


def create_ca(out_dir: Path, *, swarm_id: str, days: int = CA_DAYS,
              force: bool = False) -> tuple[Path, Path]:
    """Write `ca.crt` and `ca.key` (mode 0600) of a new swarm CA into `out_dir`.

    Refuses to overwrite existing files unless `force`. Returns (cert path, key path).
    """
    _check_swarm_id(swarm_id)
    _check_days(days)
    cert_path, key_path = out_dir / CA_CERT_FILE, out_dir / CA_KEY_FILE
    _refuse_existing((cert_path, key_path), force)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, _ca_common_name(swarm_id))])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_pair(cert_path, cert, key_path, key)
    return cert_path, key_path


def issue_node_cert(ca_dir: Path, out_dir: Path, *, node_name: str, hosts: Sequence[str],
                    days: int = NODE_DAYS, force: bool = False) -> tuple[Path, Path]:
    """Write `<node_name>.crt` and `<node_name>.key` (mode 0600), signed by the CA in `ca_dir`.

    The certificate names `hosts` (DNS names and IP addresses; "localhost" and "127.0.0.1" are
    always added) and serves both ends of mutual TLS. It never outlives the CA.
    Returns (cert path, key path).
    """
    _check_node_name(node_name)
    _check_days(days)
    sans = parse_hosts([*hosts, *LOOPBACK_HOSTS])
    ca_cert, ca_key = load_ca(ca_dir)
    cert_path, key_path = out_dir / f"{node_name}.crt", out_dir / f"{node_name}.key"
    _refuse_existing((cert_path, key_path), force)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    not_after = min(now + timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_pair(cert_path, cert, key_path, key)
    return cert_path, key_path


def load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA certificate and key in `ca_dir`, checked to belong together."""
    cert = load_cert(ca_dir / CA_CERT_FILE, "CA certificate")
    key = load_key(ca_dir / CA_KEY_FILE, "CA key")
    if not same_key(cert, key):
        raise CertError(f"{ca_dir / CA_KEY_FILE} is not the key of {ca_dir / CA_CERT_FILE}")
    if not _is_ca(cert):
        raise CertError(f"{ca_dir / CA_CERT_FILE} is not a CA certificate; "
                        "make one with 'neuronode ca init'")
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{ca_dir / CA_KEY_FILE}: expected an EC key (made by 'neuronode ca init')")
    return cert, key


def parse_hosts(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """Subject alternative names for `hosts` (duplicates dropped, order kept)."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        name = _parse_host(host)
        if name not in names:
            names.append(name)
    if not names:
        raise CertError("give at least one --host (the name or address peers dial)")
    return names


def _parse_host(host: str) -> x509.GeneralName:
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]  # "[::1]", as written in HOST:PORT
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        addr = None
    if addr is not None:
        if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id:
            raise CertError(f"host {host!r}: drop the zone ('%{addr.scope_id}')")
        return x509.IPAddress(addr)
    if "://" in text or "/" in text:
        raise CertError(f"host {host!r}: give a host name or IP address, not a URL")
    if text.count(":") == 1 or (text.startswith("[") and "]:" in text):
        raise CertError(f"host {host!r}: give the host without the port")
    if len(text) > 253 or not _DNS_NAME.match(text):
        raise CertError(f"host {host!r} is neither an IP address nor a DNS name "
                        "(letters, digits, '-' and '.')")
    if text.rsplit(".", 1)[-1].isdigit():
        raise CertError(f"host {host!r} looks like an IP address but is not a valid one")
    return x509.DNSName(text.lower())


# --- reading ---------------------------------------------------------------------------------


def cert_hosts(cert: Path) -> tuple[str, ...]:
    """The DNS names and IP addresses a certificate is valid for (to check --advertise against)."""
    node_cert = load_cert(cert, "certificate")
    try:
        san = node_cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    dns = san.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return (*dns, *ips)


def cert_common_name(cert: Path) -> str:
    """The CN of a node certificate: the node id it proves (`ca issue --name`)."""
    values = load_cert(cert, "certificate").subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(values[0].value) if values else ""


# --- files ------------------------------------------------------------------------------------


def _refuse_existing(paths: Iterable[Path], force: bool) -> None:
    if force:
        return
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        verb = "exists" if len(existing) == 1 else "exist"
        raise CertError(f"{' and '.join(existing)} already {verb}; "
                        "pass --force to overwrite (nodes using the old files stop matching)")


def _write_pair(cert_path: Path, cert: x509.Certificate, key_path: Path,
                key: ec.EllipticCurvePrivateKey) -> None:
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    try:
        cert_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Key first: a certificate on disk always has its key beside it.
        _write_atomic(key_path, key_pem, mode=0o600)
        _write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    except OSError as exc:
        raise CertError(f"cannot write {exc.filename or cert_path.parent}: "
                        f"{exc.strerror or exc}") from None


def _write_atomic(path: Path, data: bytes, *, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # Created with `mode` (never briefly readable by others), then renamed into place.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # the umask may have cleared bits of `mode`
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_cert(path: Path, what: str) -> x509.Certificate:
    data = _read(path, what)
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise CertError(f"{path} is not a PEM certificate ({what})") from None


def load_key(path: Path, what: str) -> Any:
    data = _read(path, what)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise CertError(f"{path} is encrypted; neuronode needs an unencrypted key "
                        "(protect it with mode 0600)") from None
    except (ValueError, UnsupportedAlgorithm):
        raise CertError(f"{path} is not a PEM private key ({what})") from None


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        hint = "run 'neuronode ca init'" if "CA" in what else "run 'neuronode ca issue'"
        raise CertError(f"{what} {path} does not exist; {hint}") from None
    except OSError as exc:
        raise CertError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


# --- checks -----------------------------------------------------------------------------------


def same_key(cert: x509.Certificate, key: Any) -> bool:
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    return bool(cert.public_key().public_bytes(enc, pub) == key.public_key().public_bytes(enc, pub))


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def _key_usage(*, digital_signature: bool = False, key_cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(digital_signature=digital_signature, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         key_cert_sign=key_cert_sign, crl_sign=key_cert_sign,
                         encipher_only=False, decipher_only=False)


def _ca_common_name(swarm_id: str) -> str:
    cn = f"neuronode swarm CA {swarm_id}"
    # commonName is limited to 64 characters; swarm ids may be longer (the CN is only a label).
    return cn if len(cn) <= MAX_CN_CHARS else cn[: MAX_CN_CHARS - 3] + "..."


def _check_swarm_id(swarm_id: str) -> None:
    if not swarm_id or len(swarm_id) > 128 or any(c.isspace() for c in swarm_id):
        raise CertError(f"--swarm-id: {swarm_id!r} must be 1 to 128 characters without spaces")


def _check_node_name(node_name: str) -> None:
    if not _NODE_NAME.match(node_name) or node_name.lower() == "ca":
        raise CertError(f"--name: {node_name!r} must be 1 to 64 letters, digits, '.', '_' or '-', "
                        "start with a letter or digit, and not be 'ca'")


def _check_days(days: int) -> None:
    if days < 1:
        raise CertError(f"--days: {days} must be at least 1")
