"""The other ranks of a member (neuronode.node.member): train when rank 0 says, report, restore,
and stop when it says so. No swarm, no files written: rank 0 does that for the member."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

from neuronode.config import NodeConfig
from neuronode.events import fields
from neuronode.node import checkpoint
from neuronode.node.member import Member
from neuronode.node.trainer import Trainer

logger = logging.getLogger(__name__)


def run_follower(cfg: NodeConfig, *, member: Member) -> int:
    """Follow rank 0's commands until it says stop; 0 then. A rank that fails or is gone raises
    MemberLost (exit status 1), so the launcher's agent stops or restarts the member."""
    stop = threading.Event()  # a signal to this rank: agreed with the others at the next step
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    _, start = member.receive()  # rank 0's node id: the member's data streams derive from it
    node_id = start["node_id"]
    trainer = Trainer(cfg, node_id=node_id, member=member)
    logger.info("rank %d of member %s ready (pid %d)", member.rank, node_id, os.getpid(),
                extra=fields("rank_ready", rank=member.rank, local_workers=member.world, pid=os.getpid(),
                             restarts=member.restarts))
    while True:
        op, payload = member.receive()
        trainer.follow(payload)
        if op == "train":
            trainer.train_round(stop)
        elif op == "report":
            member.gather(trainer.report())
        elif op == "restore":
            _, state = checkpoint.read(Path(payload["path"]))
            trainer.load_state_dict(state)
        elif op == "stop":
            break
    logger.info("rank %d stopped at round %d; param_digest %s", member.rank, trainer.engine.round,
                trainer.param_digest[:16], extra=fields("rank_stopped", rank=member.rank, round_id=trainer.engine.round,
                                                         param_digest=trainer.param_digest))
    member.close()
    return 0
