"""`neuronode start`: build the trainer (task, model, the built-in inner optimizer), start the
node around it through the same API a person's own loop uses (neuronode.library.Swarm), and
train until done or stopped."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from neuronode.config import NodeConfig
from neuronode.events import fields
from neuronode.memory import keep_freed_buffers
from neuronode.node.console import setup_logging
from neuronode.node.startup import (  # noqa: F401 - where callers have found them
    Identity,
    build_security,
    identify,
    load_or_create_node_id,
    run_async,
    tls_node_id,
)

if TYPE_CHECKING:
    from neuronode.library import Swarm
    from neuronode.node.member import Member

logger = logging.getLogger(__name__)


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
    setup_logging(cfg.log_format, cfg.log_level)
    identity = identify(cfg)
    stop = threading.Event()  # a signal while we start up stops the node as soon as it runs
    swarms: list[Swarm] = []

    def on_signal(*_: Any) -> None:
        stop.set()  # the training loop stops after its step; the node abandons the round in flight
        for swarm in swarms:
            swarm.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_node(cfg, member=member, identity=identity, stop=stop, swarms=swarms)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_node(cfg: NodeConfig, *, member: Member | None, identity: Identity, stop: threading.Event,
             swarms: list[Swarm]) -> int:
    """Rank 0 (or the one process): build the trainer, start the node around it (it resumes
    from the data dir and joins), train until done or stopped."""
    from neuronode.library import Swarm
    from neuronode.node.trainer import Trainer

    node_id = identity.node_id
    if member is not None:
        member.command("start", {"node_id": node_id})
    trainer = Trainer(cfg, node_id=node_id, member=member)
    if member is not None:
        logger.info("rank 0 of member %s ready (%d processes, pid %d)", node_id, member.world, os.getpid(),
                    extra=fields("rank_ready", rank=0, local_workers=member.world, pid=os.getpid(),
                                 restarts=member.restarts))
    swarm = Swarm.around(trainer, identity=identity, stop=stop, launched=swarms.append,
                         progress=sys.stderr.isatty() and cfg.log_format == "text")
    try:
        trainer.train(swarm.step, stop=stop, finished=lambda: swarm.finished)
    except BaseException:
        swarm.close(abandon=True)
        raise
    swarm.close(abandon=stop.is_set())
    if member is not None:  # (after a failure the others stop on their own: their rank 0 is gone)
        trainer.lead("stop")
        member.close()
    return 0


def join_member(cfg: NodeConfig) -> Member | None:
    """This process's member of several processes when torchrun (or the agent of
    `--local-workers`) started it, else None."""
    from neuronode.node.member import Member, launched

    if not launched():
        return None
    from neuronode.node.trainer import pick_device

    return Member.join(cfg, device=pick_device(cfg.device))
