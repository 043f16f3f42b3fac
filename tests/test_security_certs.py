"""Swarm CA and node certificates (neuronode.security.certs), and mutual TLS over real grpc.aio.

The network tests serve the standard health service on 127.0.0.1, port 0, with
`server_credentials` and dial it with certificates from the same CA, from another CA, and none.
"""

from __future__ import annotations

import ipaddress
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from neuronode.cli import Parser, UsageError
from neuronode.security.ca_cli import add_ca_parser, run_ca
from neuronode.security.certs import CertError, cert_hosts, create_ca, issue_node_cert
from neuronode.security.tls import (
    channel_credentials,
    load_node_tls,
    peer_common_name,
    server_credentials,
)

pytestmark = pytest.mark.timeout(60)

RPC_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NodeFiles:
    cert: Path
    key: Path
    ca: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NodeFiles]:
    """Swarm CA 'a' with nodes 'server' and 'client'; CA 'b' (another swarm) with node 'outsider'."""
    root = tmp_path_factory.mktemp("pki")
    nodes = {}
    for ca_name, node_names in (("a", ("server", "client")), ("b", ("outsider",))):
        ca_cert, _ = create_ca(root / f"ca-{ca_name}", swarm_id=f"swarm-{ca_name}")
        for name in node_names:
            cert, key = issue_node_cert(root / f"ca-{ca_name}", root / "nodes", node_name=name,
                                        hosts=[f"{name}.example.org", "10.0.0.5"])
            nodes[name] = NodeFiles(cert, key, ca_cert)
    return nodes


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


# --- files and contents ----------------------------------------------------------------------


def test_ca_files(tmp_path: Path) -> None:
    cert_path, key_path = create_ca(tmp_path / "ca", swarm_id="my-swarm", days=30)
    assert (cert_path.name, key_path.name) == ("ca.crt", "ca.key")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert key_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    cert = load(cert_path)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == \
        "neuronode swarm CA my-swarm"
    assert cert.issuer == cert.subject
    basic = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and not usage.digital_signature
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    assert 29 < (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 30
    cert.verify_directly_issued_by(cert)


def test_node_cert_contents(pki: dict[str, NodeFiles]) -> None:
    files = pki["server"]
    cert = load(files.cert)
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "server"
    cert.verify_directly_issued_by(load(files.ca))
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["server.example.org", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5"),
                                                       ipaddress.ip_address("127.0.0.1")]
    assert cert_hosts(files.cert) == ("server.example.org", "localhost", "10.0.0.5", "127.0.0.1")


def test_node_cert_never_outlives_its_ca(tmp_path: Path) -> None:
    create_ca(tmp_path, swarm_id="s", days=10)
    cert_path, _ = issue_node_cert(tmp_path, tmp_path, node_name="n", hosts=["h"], days=825)
    assert load(cert_path).not_valid_after_utc == load(tmp_path / "ca.crt").not_valid_after_utc


def test_long_swarm_id_fits_the_common_name(tmp_path: Path) -> None:
    cert_path, _ = create_ca(tmp_path, swarm_id="x" * 128)
    cn = str(load(cert_path).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)
    assert len(cn) == 64 and cn.endswith("...")


@pytest.mark.parametrize("host", ["10.1.2.3", "2001:db8::1", "[::1]", "node-1.example.org",
                                  "*.swarm.example.org", "NODE.Example.org", "box"])
def test_good_hosts(tmp_path: Path, host: str) -> None:
    create_ca(tmp_path, swarm_id="s")
    cert_path, _ = issue_node_cert(tmp_path, tmp_path, node_name="n", hosts=[host])
    assert len(cert_hosts(cert_path)) == 3


@pytest.mark.parametrize(("host", "message"), [
    ("node.example.org:7420", "without the port"),
    ("[::1]:7420", "without the port"),
    ("https://node.example.org", "not a URL"),
    ("", "neither an IP address nor a DNS name"),
    ("bad host", "neither an IP address nor a DNS name"),
    ("-bad.example.org", "neither an IP address nor a DNS name"),
    ("nøde.example.org", "neither an IP address nor a DNS name"),
    ("256.1.1.1", "not a valid one"),
    ("10.0.0", "not a valid one"),
    ("fe80::1%eth0", "drop the zone"),
])
def test_bad_hosts_are_refused_before_anything_is_written(tmp_path: Path, host: str,
                                                          message: str) -> None:
    create_ca(tmp_path / "ca", swarm_id="s")
    with pytest.raises(CertError, match=message):
        issue_node_cert(tmp_path / "ca", tmp_path / "out", node_name="n", hosts=[host])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["", "ca", "../evil", "a b", "-x", "x" * 65])
def test_bad_node_names(tmp_path: Path, name: str) -> None:
    create_ca(tmp_path, swarm_id="s")
    with pytest.raises(CertError, match="--name"):
        issue_node_cert(tmp_path, tmp_path, node_name=name, hosts=["h"])


def test_bad_swarm_id_and_days(tmp_path: Path) -> None:
    with pytest.raises(CertError, match="--swarm-id"):
        create_ca(tmp_path, swarm_id="two words")
    with pytest.raises(CertError, match="--days: 0"):
        create_ca(tmp_path, swarm_id="s", days=0)


def test_missing_ca_is_explained(tmp_path: Path) -> None:
    with pytest.raises(CertError, match=r"CA certificate .*ca\.crt does not exist; run 'neuronode ca init'"):
        issue_node_cert(tmp_path / "nowhere", tmp_path, node_name="n", hosts=["h"])
    create_ca(tmp_path / "ca", swarm_id="s")
    (tmp_path / "ca" / "ca.key").unlink()
    with pytest.raises(CertError, match=r"CA key .*ca\.key does not exist"):
        issue_node_cert(tmp_path / "ca", tmp_path, node_name="n", hosts=["h"])


def test_node_cert_is_not_a_ca(pki: dict[str, NodeFiles], tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_bytes(pki["server"].cert.read_bytes())
    (tmp_path / "ca.key").write_bytes(pki["server"].key.read_bytes())
    with pytest.raises(CertError, match="not a CA certificate"):
        issue_node_cert(tmp_path, tmp_path, node_name="n", hosts=["h"])


def test_existing_files_are_kept_unless_forced(tmp_path: Path) -> None:
    cert_path, key_path = create_ca(tmp_path, swarm_id="s")
    before = key_path.read_bytes()
    with pytest.raises(CertError, match="already exist.*--force"):
        create_ca(tmp_path, swarm_id="s")
    assert key_path.read_bytes() == before
    create_ca(tmp_path, swarm_id="s", force=True)
    assert key_path.read_bytes() != before
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600

    node_cert, _ = issue_node_cert(tmp_path, tmp_path / "n", node_name="n", hosts=["h"])
    with pytest.raises(CertError, match="already exist"):
        issue_node_cert(tmp_path, tmp_path / "n", node_name="n", hosts=["h"])
    issue_node_cert(tmp_path, tmp_path / "n", node_name="n", hosts=["h2"], force=True)
    assert "h2" in cert_hosts(node_cert)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ca.crt", "ca.key", "n", "n.crt", "n.key"]


def test_load_node_tls_catches_mismatched_files(pki: dict[str, NodeFiles]) -> None:
    server, outsider = pki["server"], pki["outsider"]
    assert load_node_tls(server.cert, server.key, server.ca).cert_pem.startswith(b"-----BEGIN")
    with pytest.raises(CertError, match="is not the key of"):
        load_node_tls(server.cert, pki["client"].key, server.ca)
    with pytest.raises(CertError, match="was not issued by the CA"):
        load_node_tls(outsider.cert, outsider.key, server.ca)
    with pytest.raises(CertError, match="is not a PEM certificate"):
        load_node_tls(server.key, server.key, server.ca)
    with pytest.raises(CertError, match="is not a PEM private key"):
        load_node_tls(server.cert, server.cert, server.ca)


def test_peer_common_name() -> None:
    assert peer_common_name({"x509_common_name": [b"node-a"]}) == "node-a"
    assert peer_common_name({"transport_security_type": [b"insecure"]}) is None


# --- mutual TLS over grpc.aio ----------------------------------------------------------------


WHO = "/neuronode.test.Who/Name"


async def who_am_i(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return (peer_common_name(context.auth_context()) or "").encode()


@pytest.fixture
async def tls_server(pki: dict[str, NodeFiles]) -> AsyncIterator[int]:
    files = pki["server"]
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "neuronode.test.Who", {"Name": grpc.unary_unary_rpc_method_handler(who_am_i)})])
    port = server.add_secure_port("127.0.0.1:0", server_credentials(files.cert, files.key,
                                                                    files.ca))
    await server.start()
    try:
        yield port
    finally:
        await server.stop(grace=None)


async def health_check(target: str, creds: grpc.ChannelCredentials | None,
                       name_override: str | None = None) -> int:
    options = [("grpc.ssl_target_name_override", name_override)] if name_override else []
    channel = (grpc.aio.secure_channel(target, creds, options=options) if creds
               else grpc.aio.insecure_channel(target))
    async with channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S)
        return reply.status


def creds_of(files: NodeFiles) -> grpc.ChannelCredentials:
    return channel_credentials(files.cert, files.key, files.ca)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_member_with_a_cert_from_the_same_ca_is_served(
        tls_server: int, pki: dict[str, NodeFiles], host: str) -> None:
    status = await health_check(f"{host}:{tls_server}", creds_of(pki["client"]))
    assert status == health_pb2.HealthCheckResponse.SERVING


async def test_server_sees_the_client_certificate_name(tls_server: int,
                                                       pki: dict[str, NodeFiles]) -> None:
    async with grpc.aio.secure_channel(f"127.0.0.1:{tls_server}", creds_of(pki["client"])) as ch:
        name = await ch.unary_unary(WHO)(b"", timeout=RPC_TIMEOUT_S)
    assert name == b"client"


async def test_name_override_must_match_a_san_of_the_server(tls_server: int,
                                                            pki: dict[str, NodeFiles]) -> None:
    target = f"127.0.0.1:{tls_server}"
    creds = creds_of(pki["client"])
    assert await health_check(target, creds, name_override="server.example.org") == \
        health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_check(target, creds, name_override="client.example.org")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_with_a_cert_from_another_ca_is_refused(tls_server: int,
                                                             pki: dict[str, NodeFiles]) -> None:
    outsider = pki["outsider"]
    # The outsider trusts the swarm CA (so it accepts the server) but presents its own cert.
    creds = grpc.ssl_channel_credentials(root_certificates=pki["server"].ca.read_bytes(),
                                         private_key=outsider.key.read_bytes(),
                                         certificate_chain=outsider.cert.read_bytes())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_check(f"127.0.0.1:{tls_server}", creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_that_trusts_another_ca_refuses_the_server(tls_server: int,
                                                                pki: dict[str, NodeFiles]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_check(f"127.0.0.1:{tls_server}", creds_of(pki["outsider"]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_without_a_cert_is_refused(tls_server: int,
                                                pki: dict[str, NodeFiles]) -> None:
    creds = grpc.ssl_channel_credentials(root_certificates=pki["server"].ca.read_bytes())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_check(f"127.0.0.1:{tls_server}", creds)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_client_is_refused(tls_server: int) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_check(f"127.0.0.1:{tls_server}", None)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# --- command line ----------------------------------------------------------------------------


def ca_parser() -> Parser:
    """The shape cli.build_parser gives it: a `Parser` whose subparsers are `Parser`s."""
    parser = Parser(prog="neuronode")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    add_ca_parser(sub)
    return parser


def run(argv: list[str]) -> int:
    args = ca_parser().parse_args(argv)
    assert args.command == "ca"
    return run_ca(args)


async def test_cli_flow_makes_files_a_node_can_serve_with(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca_dir, out = tmp_path / "ca", tmp_path / "node-files"
    assert run(["ca", "init", "--out", str(ca_dir), "--swarm-id", "cli-swarm"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {ca_dir / 'ca.crt'}" in printed and f"wrote {ca_dir / 'ca.key'}" in printed
    assert f"neuronode ca issue --ca {ca_dir}" in printed

    for name in ("alpha", "beta"):
        assert run(["ca", "issue", "--ca", str(ca_dir), "--out", str(out), "--name", name,
                    "--host", f"{name}.example.org", "--host", "192.0.2.7"]) == 0
    printed = capsys.readouterr().out
    flags = (f"--tls-cert {out / 'beta.crt'} --tls-key {out / 'beta.key'} "
             f"--tls-ca {ca_dir / 'ca.crt'}")
    assert flags in printed
    assert "hosts: beta.example.org, localhost, 192.0.2.7, 127.0.0.1" in printed
    assert stat.S_IMODE((out / "beta.key").stat().st_mode) == 0o600

    # The files the CLI wrote are a working mutual-TLS pair.
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    ca_crt = ca_dir / "ca.crt"
    port = server.add_secure_port("127.0.0.1:0", server_credentials(
        out / "alpha.crt", out / "alpha.key", ca_crt))
    await server.start()
    try:
        creds = channel_credentials(out / "beta.crt", out / "beta.key", ca_crt)
        assert await health_check(f"localhost:{port}", creds) == \
            health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=None)


@pytest.mark.parametrize(("argv", "message"), [
    (["ca"], "neuronode ca: the following arguments are required: ACTION"),
    (["ca", "init", "--out", "x"], "required: --swarm-id"),
    (["ca", "issue", "--ca", "c", "--out", "o", "--name", "n"], "required: --host"),
    (["ca", "issue", "--ca", "c", "--out", "o", "--name", "n", "--host", "h", "--days", "x"],
     "invalid int value"),
])
def test_cli_mistakes_are_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ca_parser().parse_args(argv)


def test_cli_refuses_to_overwrite(tmp_path: Path) -> None:
    run(["ca", "init", "--out", str(tmp_path), "--swarm-id", "s"])
    with pytest.raises(CertError, match="--force"):
        run(["ca", "init", "--out", str(tmp_path), "--swarm-id", "s"])
    assert run(["ca", "init", "--out", str(tmp_path), "--swarm-id", "s", "--force"]) == 0
