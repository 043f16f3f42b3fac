"""Mutual TLS for gRPC: a node's certificate, key and swarm CA checked at start-up, and the
server and channel credentials made from them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import grpc
from cryptography.exceptions import InvalidSignature

from neuronode.security.certs import CertError, load_cert, load_key, same_key


@dataclass(frozen=True)
class NodeTLS:
    """PEM bytes of a node's certificate, its key and the swarm CA, checked to fit together."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes


def load_node_tls(cert: Path, key: Path, ca: Path) -> NodeTLS:
    """Read and check a node's TLS files, so a mistake fails at startup with a clear message.

    Checks: the key belongs to the certificate, the CA signed it, and it is valid now.
    """
    node_cert = load_cert(cert, "node certificate")
    node_key = load_key(key, "node key")
    ca_cert = load_cert(ca, "CA certificate")
    if not same_key(node_cert, node_key):
        raise CertError(f"{key} is not the key of {cert}")
    try:
        node_cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        raise CertError(f"{cert} was not issued by the CA in {ca}; "
                        "issue it with 'neuronode ca issue --ca DIR' of this swarm") from None
    now = datetime.now(UTC)
    if now < node_cert.not_valid_before_utc or now > node_cert.not_valid_after_utc:
        raise CertError(f"{cert} is valid from {node_cert.not_valid_before_utc:%Y-%m-%d %H:%M} "
                        f"to {node_cert.not_valid_after_utc:%Y-%m-%d} UTC, not now; issue a new one")
    return NodeTLS(cert_pem=cert.read_bytes(), key_pem=key.read_bytes(), ca_pem=ca.read_bytes())


def server_credentials(cert: Path, key: Path, ca: Path) -> grpc.ServerCredentials:
    """Server side of mutual TLS: clients must present a certificate from the swarm CA."""
    tls = load_node_tls(cert, key, ca)
    return grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)],
                                       root_certificates=tls.ca_pem, require_client_auth=True)


def channel_credentials(cert: Path, key: Path, ca: Path) -> grpc.ChannelCredentials:
    """Client side of mutual TLS: trust only the swarm CA and present this node's certificate."""
    tls = load_node_tls(cert, key, ca)
    return grpc.ssl_channel_credentials(root_certificates=tls.ca_pem,
                                        private_key=tls.key_pem, certificate_chain=tls.cert_pem)


def peer_common_name(auth_context: Mapping[str, Sequence[bytes]]) -> str | None:
    """The verified peer certificate's CN from `context.auth_context()`, or None without TLS."""
    values = auth_context.get("x509_common_name") or ()
    return values[0].decode("utf-8", "replace") if values else None


