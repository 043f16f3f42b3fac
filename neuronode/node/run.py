"""Start-up of `neuronode start`: check what needs the file system, load the node's identity and
credentials, build the trainer, restore the newest checkpoint, and run the daemon until done."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from neuronode.config import NodeConfig, check_data_dir
from neuronode.errors import ConfigError
from neuronode.events import fields
from neuronode.memory import keep_freed_buffers
from neuronode.node.console import setup_logging
from neuronode.security.auth import load_secret, permissions_warning
from neuronode.security.identity import NodeKey
from neuronode.swarm.security import Security

if TYPE_CHECKING:
    from neuronode.node.member import Member

logger = logging.getLogger(__name__)
T = TypeVar("T")


def run_daemon(cfg: NodeConfig) -> int:
    """Validate what needs the file system, build the trainer, run until done or stopped. A
    process started by torchrun (or `--local-workers`) is one rank of a member: rank 0 runs
    the node, the others follow it (neuronode.node.member)."""
    keep_freed_buffers()  # before any thread allocates (neuronode/memory.py)
    member = join_member(cfg)
    if member is not None and not member.leader:
        from neuronode.node.follower import run_follower

        setup_logging(cfg.log_format, cfg.log_level)
        return run_follower(cfg, member=member)
    cfg.check_exposure()
    data_dir = check_data_dir(cfg.data_dir)
    setup_logging(cfg.log_format, cfg.log_level)
    key = NodeKey.load_or_create(data_dir)
    node_id = tls_node_id(cfg) or cfg.node_id or load_or_create_node_id(data_dir, key)
    stop = threading.Event()  # a signal while we start up stops the daemon as soon as it runs
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_node(cfg, member=member, node_id=node_id, key=key, data_dir=data_dir, stop=stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_node(cfg: NodeConfig, *, member: Member | None, node_id: str, key: NodeKey, data_dir: Path,
             stop: threading.Event) -> int:
    """Rank 0 (or the one process): build the trainer and the daemon, resume, run."""
    from neuronode.node.daemon import Daemon
    from neuronode.node.trainer import Trainer

    if member is not None:
        member.command("start", {"node_id": node_id})
    trainer = Trainer(cfg, node_id=node_id, member=member)
    if member is not None:
        logger.info("rank 0 of member %s ready (%d processes, pid %d)", node_id, member.world, os.getpid(),
                    extra=fields("rank_ready", rank=0, local_workers=member.world, pid=os.getpid(),
                                 restarts=member.restarts))
    if not cfg.authenticated:
        logger.warning(
            "no --secret-file or TLS: %s; see SECURITY.md to close the swarm",
            f"anyone who can reach --listen {cfg.listen} may join (--open)" if cfg.open
            else "protected mode, serving loopback callers only")
    daemon = Daemon(cfg, trainer=trainer, node_id=node_id, data_dir=data_dir)
    daemon.security = build_security(cfg, node_id, key)
    daemon.stop_flag = stop
    daemon.restore()
    code = run_async(daemon.run)
    if member is not None:  # (after a failure the others stop on their own: their rank 0 is gone)
        trainer.lead("stop")
        member.close()
    return code


def join_member(cfg: NodeConfig) -> Member | None:
    """This process's member of several processes when torchrun (or the agent of
    `--local-workers`) started it, else None."""
    from neuronode.node.member import Member, launched

    if not launched():
        return None
    from neuronode.node.trainer import pick_device

    return Member.join(cfg, device=pick_device(cfg.device))


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
