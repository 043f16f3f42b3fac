"""Start-up of a node, shared by `neuronode start` and neuronode.library: check what needs the
file system, load the node's identity (key and id, kept in the data dir) and its credentials
(the swarm secret, TLS files), so a mistake stops the start with one line."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from neuronode.config import NodeConfig, check_data_dir
from neuronode.errors import ConfigError
from neuronode.security.auth import load_secret, permissions_warning
from neuronode.security.identity import NodeKey
from neuronode.swarm.guard.proofs import Security

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Identity:
    """Who a node is and where it keeps its files."""

    node_id: str
    key: NodeKey
    data_dir: Path


def identify(cfg: NodeConfig) -> Identity:
    """Check the exposure rule and the data dir, then load or create the node's key and id."""
    cfg.check_exposure()
    data_dir = check_data_dir(cfg.data_dir)
    key = NodeKey.load_or_create(data_dir)
    node_id = tls_node_id(cfg) or cfg.node_id or load_or_create_node_id(data_dir, key)
    return Identity(node_id=node_id, key=key, data_dir=data_dir)


def credentials(cfg: NodeConfig, identity: Identity) -> Security:
    """The node's credentials, and the warning that goes with none."""
    if not cfg.authenticated:
        logger.warning(
            "no --secret-file or TLS: %s; see SECURITY.md to close the swarm",
            f"anyone who can reach --listen {cfg.listen} may join (--open)" if cfg.open
            else "protected mode, serving loopback callers only")
    return build_security(cfg, identity.node_id, identity.key)


def tls_node_id(cfg: NodeConfig) -> str:
    """With mutual TLS the node id is the name its certificate proves, so peers can check every
    id a caller claims against its certificate; "" without TLS."""
    if not cfg.tls_cert:
        return ""
    from neuronode.security.certs import cert_common_name

    name = cert_common_name(Path(cfg.tls_cert))
    if not name:
        raise ConfigError(f"--tls-cert {cfg.tls_cert} names no node (no CN); issue it with "
                          "`neuronode ca issue --name NODE`")
    if cfg.node_id and cfg.node_id != name:
        raise ConfigError(f"--node-id {cfg.node_id} differs from the node named in --tls-cert ({name}); "
                          "drop --node-id or use that node's certificate")
    return name


def build_security(cfg: NodeConfig, node_id: str, key: NodeKey) -> Security:
    """Load and check the secret and TLS files now, so a mistake stops the start with one line."""
    secret = b""
    if cfg.secret_file:
        secret = load_secret(cfg.secret_file)
        warning = permissions_warning(cfg.secret_file)
        if warning:
            logger.warning("%s", warning)
    tls = None
    if cfg.tls_cert:
        from neuronode.security.certs import cert_hosts
        from neuronode.security.tls import load_node_tls

        load_node_tls(Path(cfg.tls_cert), Path(cfg.tls_key), Path(cfg.tls_ca))
        host = cfg.advertise_address.rpartition(":")[0].strip("[]")
        hosts = cert_hosts(Path(cfg.tls_cert))
        if host and host not in hosts:  # a learned address is checked when it is learned
            raise ConfigError(f"--tls-cert is valid for {', '.join(hosts)} but peers will dial "
                              f"{host}; issue a certificate with --host {host}")
        tls = (cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    return Security(node_id=node_id, swarm_id=cfg.swarm_id, secret=secret, tls_files=tls, key=key)


def load_or_create_node_id(data_dir: Path, key: NodeKey) -> str:
    """The node id kept in the data dir, so restarts keep their identity; a new data dir takes
    the id its key derives (neuronode.security.identity), which no other key can speak as."""
    path = data_dir / "node_id"
    if path.exists():
        node_id = path.read_text().strip()
        if node_id:
            return node_id
    node_id = key.derived_id
    tmp = path.with_suffix(".tmp")
    tmp.write_text(node_id + "\n")
    tmp.replace(path)
    return node_id


def run_async(main: Callable[[], Coroutine[Any, Any, T]], *, use_uvloop: bool | None = None) -> T:
    """Run `main` on uvloop where it is installed (or asked for), else on asyncio's loop."""
    if use_uvloop is not False:
        try:
            import uvloop
        except ImportError:
            if use_uvloop:
                raise
        else:
            return uvloop.run(main())
    return asyncio.run(main())
