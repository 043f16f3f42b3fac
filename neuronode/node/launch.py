"""`neuronode start --local-workers K`: start the K processes of one member through torch's
elastic agent, in this process (what `torchrun --standalone --nproc-per-node K -m neuronode start`
does, without needing a `torchrun` on PATH), and stop them cleanly.

The agent starts `python -m neuronode start ARGS` K times with the rank variables set (each
process becomes a rank: neuronode.node.member), watches them, stops them all when one fails, and
restarts them from the member's checkpoint up to --max-restarts times.

Network: every store of the member listens on 127.0.0.1 only (torch's listen on every
interface, whatever address they are given): the agent's rendezvous (`loopback_rendezvous`),
and the ranks' own, which rank 0 serves (neuronode.node.member.attempt_store) instead of the
store the agent would share with them.

Signals: SIGTERM or SIGINT to this launcher is passed on to every rank, which stop together at
the next step boundary, rank 0 writing a checkpoint; the launcher then exits 0 as they do. A
second signal stops them the agent's way (SIGTERM, then SIGKILL after 30 s). Stock torchrun
handles the first signal that second way and exits non-zero (docs/multi-gpu.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import Sequence
from types import FrameType
from typing import Any

from neuronode.config import NodeConfig
from neuronode.errors import ConfigError
from neuronode.events import fields

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30  # after a second signal: SIGTERM to the ranks, SIGKILL after this
LOOPBACK = "127.0.0.1"  # where the member's stores listen: its ranks run on this machine


def launch_member(cfg: NodeConfig, argv: Sequence[str]) -> int:
    """Run `neuronode ARGV` as the cfg.local_workers ranks of one member; their exit status."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("--local-workers needs torch.distributed, which this torch build lacks; "
                          "install a torch with distributed support, or start one process per member")
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    # The first SIGTERM/SIGINT is ours (below); the agent keeps SIGHUP and SIGQUIT.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    # No store of the agent's for the ranks: torch would start it on `*:PORT`. Rank 0 starts
    # theirs, on loopback (neuronode.node.member.attempt_store), at the port the agent picks.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    handler = loopback_rendezvous(uuid.uuid4().hex)
    spec = WorkerSpec(role="neuronode", local_world_size=cfg.local_workers, entrypoint=sys.executable,
                      args=("-m", "neuronode", *argv), rdzv_handler=handler,
                      max_restarts=cfg.max_restarts, monitor_interval=0.1)
    with tempfile.TemporaryDirectory(prefix="neuronode-agent-") as logs:  # the agent's error files, if any
        agent = LocalElasticAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=logs), start_method="spawn",
                                  shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        try:
            return supervise(agent, cfg)
        finally:
            spec.rdzv_handler.shutdown()  # its keep-alive thread would hold up our exit


def loopback_rendezvous(run_id: str) -> Any:
    """The agent's rendezvous (one node: this machine) over a store that listens on loopback
    only. torch's own (`--rdzv-endpoint 127.0.0.1:0`) listens on every interface, whatever the
    endpoint names, and takes anyone who connects: here only this machine's processes can."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from neuronode.node.member import listening_socket

    listener = listening_socket(LOOPBACK, 0)
    try:
        store = dist.TCPStore(LOOPBACK, listener.getsockname()[1], is_master=True, multi_tenant=True,
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    finally:
        listener.detach()  # the store owns the socket now
    return DynamicRendezvousHandler.from_backend(run_id=run_id, store=store, backend=C10dRendezvousBackend(store, run_id),
                                                 min_nodes=1, max_nodes=1, local_addr=LOOPBACK)


def supervise(agent: Any, cfg: NodeConfig) -> int:
    """Run the agent until the member ends; pass a first SIGTERM/SIGINT on to every rank."""
    from torch.distributed.elastic.multiprocessing import SignalException

    signals = 0

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            raise SignalException(f"signal {signum} again: stopping the member's processes", signal.Signals(signum))
        # A stop is not a failure: no restart after it (the agent reads this attribute only).
        agent._remaining_restarts = 0  # noqa: SLF001 - the agent has no public way to say it
        for worker in agent.get_worker_group().workers:
            if worker.id is not None:
                try:
                    os.kill(int(worker.id), signum)
                except ProcessLookupError:
                    pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    logger.info("starting a member of %d processes (restarts: %d)", cfg.local_workers, cfg.max_restarts,
                extra=fields("member_starting", local_workers=cfg.local_workers, max_restarts=cfg.max_restarts))
    try:
        result = agent.run()
    except SignalException as exc:
        logger.warning("%s", exc, extra=fields("member_killed"))
        return 128 + int(exc.sigval)
    if result.is_failed():
        failures = {rank: f.exitcode for rank, f in sorted(result.failures.items())}
        logger.error("the member failed: exit status by rank %s", failures,
                     extra=fields("member_failed", exit_codes={str(k): v for k, v in failures.items()}))
        return next((code for code in failures.values() if 0 < code < 128), 1)
    return 0
