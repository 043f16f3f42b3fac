"""The composition root of a running node: wires the trainer, the encoder, the swarm and the
averaging protocol; owns the worker pools, signals, checkpoints, status and metrics.

One asyncio process. Training, encoding, averaging, hashing and checkpoint writes run in
worker threads (neuronode.node.pools), so the event loop keeps answering RPCs during inner steps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from neuronode.averaging import PROTOCOLS, Averaging, AveragingConfig, NodePhase, RoundState
from neuronode.codec import ContributionEncoder, EncoderConfig
from neuronode.config import NodeConfig
from neuronode.errors import CheckpointError
from neuronode.events import fields
from neuronode.node import checkpoint
from neuronode.node.catchup import CatchUp
from neuronode.node.console import Progress, attach_progress, download_line, progress_line
from neuronode.node.metrics import Metrics, Snapshot
from neuronode.node.pools import Pools
from neuronode.node.rounds import Rounds
from neuronode.node.trainer import Trainer, make_aggregator
from neuronode.swarm.context import Settings
from neuronode.swarm.node import SwarmConfig, SwarmNode
from neuronode.swarm.security import Security
from neuronode.swarm.statesync import TransferProgress

logger = logging.getLogger(__name__)


class Daemon:
    """Runs rounds until --rounds or a stop: join, then train, average, outer step, checkpoint."""

    def __init__(self, cfg: NodeConfig, *, trainer: Trainer, node_id: str, data_dir: Path) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.node_id = node_id
        self.data_dir = data_dir
        self.state = RoundState()
        self.security = Security(node_id=node_id, swarm_id=cfg.swarm_id)  # run_daemon sets the real one
        self.pools = Pools()
        self.encoder = ContributionEncoder(
            EncoderConfig(codec=cfg.codec, chunk_bytes=cfg.chunk_bytes, zstd_level=cfg.zstd_level,
                          byte_shuffle=cfg.byte_shuffle, capped=cfg.max_upload_mbps > 0),
            n_elements=trainer.n_params, sender_id=node_id)
        self.restored_meta: dict[str, Any] = {}
        self.last_contributors: list[str] = []
        self.metrics = Metrics(self.metrics_snapshot)
        self.stop_flag = threading.Event()  # seen by the training thread between steps
        self.progress = Progress(enabled=sys.stderr.isatty() and cfg.log_format == "text")
        attach_progress(self.progress)
        self.writing: asyncio.Future[Any] | None = None
        self.swarm: SwarmNode | None = None
        self.rounds: Rounds | None = None

    @property
    def engine(self) -> Any:
        return self.trainer.engine

    def restore(self) -> None:
        """Resume from the newest good checkpoint in the data dir, if any."""
        loaded = checkpoint.load_latest(self.data_dir)
        if loaded is None:
            return
        if loaded.meta.get("manifest_hash") != self.engine.manifest_hash():
            raise CheckpointError(
                f"checkpoint {loaded.path} is for another model (different task or size flags); "
                "use another --data-dir or the flags it was made with")
        self.trainer.load_state_dict(loaded.state)
        if "feedback" in loaded.state:  # error feedback belongs to the encoder (its own thread)
            self.pools.encode.submit(self.encoder.load_state_dict, loaded.state["feedback"]).result()
        self.restored_meta = loaded.meta
        self.last_contributors = list(loaded.meta.get("last_round_contributor_ids", []))
        logger.info("resumed from %s (round %d)", loaded.path.name, self.engine.round,
                    extra=fields("resumed", round_id=self.engine.round, checkpoint=loaded.path.name))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()

        def request_stop() -> None:
            if not stopped.is_set():
                logger.info("stop requested; finishing cleanly", extra=fields("stopping"))
            stopped.set()
            self.stop_flag.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, request_stop)
        self.state.start(self.engine.round, await self.pools.run(self.pools.train, self.engine.param_digest))
        if self.engine.round == 0:
            await self.pools.run(self.pools.train, self.trainer.validate)
            logger.info("round 0: val_loss %.4f before training", self.trainer.val_loss,
                        extra=fields("validated", round_id=0, val_loss=self.trainer.val_loss))
        swarm = self.swarm = SwarmNode(self.swarm_config(), executor=self.pools.codec, state=self.state,
                                       status_provider=self.status, state_provider=self.trainer.snapshot,
                                       security=self.security, on_download=self.on_download,
                                       loopback_only=not self.cfg.authenticated and not self.cfg.open)
        swarm.restore_counters(bytes_sent=int(self.restored_meta.get("bytes_sent", 0)),
                               bytes_received=int(self.restored_meta.get("bytes_received", 0)))
        rounds = self.rounds = self.build_rounds(swarm)
        if self.cfg.metrics_port:
            self.metrics.serve(self.cfg.listen.rpartition(":")[0].strip("[]"), self.cfg.metrics_port)
        try:
            await swarm.start()
        except BaseException:
            self.metrics.close()
            raise
        try:
            await self.join(stopped)
            while not stopped.is_set() and not rounds.finished():
                if not await rounds.one(stopped):
                    break
            await rounds.flush(stopped)
        finally:
            await rounds.cancel_pending()
            await self.shutdown(stopped)
        logger.info("stopped at round %d; param_digest %s", self.state.round, self.state.param_digest[:16],
                    extra=fields("stopped", round_id=self.state.round, param_digest=self.state.param_digest))
        return 0

    def build_rounds(self, swarm: SwarmNode) -> Rounds:
        cfg = self.cfg
        averaging: Averaging = PROTOCOLS[cfg.averaging](
            AveragingConfig(node_id=self.node_id, codec=cfg.codec, n_elements=self.trainer.n_params,
                            sync_timeout_s=cfg.sync_timeout, min_contributors=cfg.min_peers),
            transport=swarm.transport, encoder=self.encoder, encoder_pool=self.pools.encode,
            aggregate=make_aggregator(cfg), executor=self.pools.codec)
        catch_up = CatchUp(cfg=cfg, trainer=self.trainer, encoder=self.encoder, state=self.state, swarm=swarm,
                           pools=self.pools, save=self.save_checkpoint)
        return Rounds(cfg=cfg, trainer=self.trainer, state=self.state, swarm=swarm, averaging=averaging,
                      catch_up=catch_up, pools=self.pools, stop=self.stop_flag, save=self.save_checkpoint,
                      on_step=self.on_step, on_sync=self.metrics.sync_seconds.observe)

    async def shutdown(self, stopped: asyncio.Event) -> None:
        assert self.swarm is not None and self.rounds is not None
        self.progress.clear()
        self.state.phase = NodePhase.STOPPING
        if self.engine.steps_this_round and not self.rounds.finished():
            # Keep the inner steps of the interrupted round; a restart resumes them (or
            # catches up with the swarm if it moved on meanwhile).
            await self.save_checkpoint()
        await self.flush_checkpoint()
        await self.drain(stopped)
        await self.swarm.stop()
        self.metrics.close()
        self.pools.shutdown()

    async def drain(self, stopped: asyncio.Event) -> None:
        """Let our last pushes finish: up to --sync-timeout after a normal finish, at most 5 s
        once a stop was requested (before or during the wait)."""
        assert self.swarm is not None
        grace_s = 5.0
        drain = asyncio.ensure_future(self.swarm.drain(timeout_s=grace_s if stopped.is_set() else self.cfg.sync_timeout))
        stop_wait = asyncio.ensure_future(stopped.wait())
        await asyncio.wait({drain, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not drain.done():
            await asyncio.wait({drain}, timeout=grace_s)
            drain.cancel()
        await asyncio.gather(drain, stop_wait, return_exceptions=True)

    async def join(self, stopped: asyncio.Event) -> None:
        """With --peers: wait for first contact (or a stop), catch up with the swarm, check that
        peers can dial us back; then say SERVING on the health service."""
        assert self.swarm is not None and self.rounds is not None
        if self.cfg.peers:
            self.state.phase = NodePhase.JOINING
            contact = asyncio.ensure_future(
                self.swarm.wait_first_contact(timeout_s=max(10.0, 3 * self.cfg.heartbeat_s)))
            stop_wait = asyncio.ensure_future(stopped.wait())
            await asyncio.wait({contact, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            for task in (contact, stop_wait):
                task.cancel()
            await asyncio.gather(contact, stop_wait, return_exceptions=True)
            if stopped.is_set():
                return
            await self.rounds.maybe_catch_up(stopped)
            if stopped.is_set():
                return
            await self.swarm.check_reachable()  # at once: whether peers dial us, or we open sessions
        await self.swarm.set_serving(True)
        logger.info("node %s: %d parameters, task %s, codec %s, round %d%s", self.node_id,
                    self.trainer.n_params, self.cfg.task, self.cfg.codec, self.state.round,
                    f" of {self.cfg.rounds}" if self.cfg.rounds else "", extra=fields("joined", n_params=self.trainer.n_params))

    def on_step(self, trainer: Trainer) -> None:
        """Called in the training thread after each inner step: live progress on a TTY."""
        if not self.progress.enabled:
            return
        eng = trainer.engine
        self.progress.show(progress_line(
            round_id=eng.round, rounds=self.cfg.rounds, step=eng.steps_this_round, inner_steps=self.cfg.inner_steps,
            loss=trainer.loss, lr=eng.inner_config.lr_at(max(eng.inner_steps_total - 1, 0)),
            tokens_per_s=trainer.tokens_per_s, tokens_per_batch=trainer.task.tokens_per_batch,
            peers=self.swarm.alive_count() if self.swarm is not None else 0))

    def on_download(self, progress: TransferProgress) -> None:
        """A state download moved: live progress on a TTY."""
        if progress.total_bytes:
            self.progress.show(download_line(donor=progress.donor, done_bytes=progress.verified_bytes,
                                             total_bytes=progress.total_bytes, bytes_per_s=progress.bytes_per_s,
                                             eta_s=progress.eta_s))
        else:
            self.progress.clear()

    def swarm_config(self) -> SwarmConfig:
        return SwarmConfig(
            node_id=self.node_id, swarm_id=self.cfg.swarm_id, manifest_hash=self.engine.manifest_hash(),
            n_elements=self.trainer.n_params, listen=self.cfg.listen, advertise=self.cfg.advertise,
            peers=self.cfg.peers, sync_timeout_s=self.cfg.sync_timeout, min_contributors=self.cfg.min_peers,
            heartbeat_s=self.cfg.heartbeat_s, zstd_level=self.cfg.zstd_level, fault_file=self.cfg.fault_file,
            max_upload_mbps=self.cfg.max_upload_mbps, max_relay_mbps=self.cfg.relay_mbps(),
            round_lag=2 if self.cfg.overlap else 1,
            settings=Settings.from_config(self.cfg), max_ids_per_host=self.cfg.max_ids_per_host,
            reachable=self.cfg.reachable,
        )

    def status(self) -> dict[str, Any]:
        """Daemon-side status fields (the swarm adds peers, bytes and agreement)."""
        rounds = self.rounds
        contributors = rounds.last_contributors if rounds is not None and rounds.last_contributors else self.last_contributors
        return {
            "round": self.state.round, "phase": self.state.phase.value, "param_digest": self.state.param_digest,
            "state_digest": self.trainer.state_digest,
            "loss": finite_or(self.trainer.loss), "val_loss": finite_or(self.trainer.val_loss),
            "last_round_contributors": len(contributors), "last_round_contributor_ids": contributors,
            "inner_steps": self.engine.inner_steps_total, "tokens_per_s": self.trainer.tokens_per_s,
            "utilization": rounds.utilization if rounds is not None else 0.0,
        }

    def metrics_snapshot(self) -> Snapshot:
        """Read at scrape time, from the metrics thread: plain attribute reads and dict copies."""
        swarm, status = self.swarm, self.status()
        sent, received, refusals = swarm.traffic() if swarm is not None else ({}, {}, {})
        return Snapshot(
            rounds=self.state.round, inner_steps=self.engine.inner_steps_total,
            loss=self.trainer.loss, val_loss=self.trainer.val_loss, tokens_per_s=self.trainer.tokens_per_s,
            contributors=status["last_round_contributors"], utilization=status["utilization"],
            peers_alive=swarm.alive_count() if swarm is not None else 0,
            bytes_sent=sent, bytes_received=received, refusals=refusals,
            bytes_relayed=int(status.get("bytes_relayed", 0)),
            control_bytes_sent=int(status.get("control_bytes_sent", 0)),
            control_bytes_received=int(status.get("control_bytes_received", 0)),
        )

    async def save_checkpoint(self) -> None:
        """Snapshot the state in the training thread (a quick copy) and the error feedback in the
        encoder's, then serialize, fsync and rename in the writer thread, so training goes on
        while the disk works. One write at a time: the next save, and shutdown, wait for the one
        before."""
        assert self.swarm is not None
        await self.flush_checkpoint()
        meta = {**self.status(), **self.swarm.snapshot(), "phase": NodePhase.STOPPED.value,
                "manifest_hash": self.engine.manifest_hash(), "saved_at": time.time()}
        state = await self.pools.run(self.pools.train, self.trainer.state_dict)
        feedback = await self.pools.run(self.pools.encode, self.encoder.state_dict)
        if feedback is not None:
            state["feedback"] = feedback  # where release 0.1 kept it: its checkpoints load as ever
        self.writing = asyncio.get_running_loop().run_in_executor(
            self.pools.writer, lambda: checkpoint.save(self.data_dir, meta["round"], meta, state,
                                                       keep=self.cfg.keep_checkpoints))

    async def flush_checkpoint(self) -> None:
        if self.writing is not None:
            await self.writing
            self.writing = None


def finite_or(value: float, default: float = float("nan")) -> float:
    return value if math.isfinite(value) else default
