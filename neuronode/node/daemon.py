"""The composition root of a running node: wires the replica, the encoder, the swarm and the
averaging protocol; owns the worker pools, checkpoints, status and metrics.

It runs on an event loop of its own (neuronode.library.Swarm gives it a thread), beside a
training loop that steps the model on its own thread and hands the node its turns
(neuronode.node.handoff): that loop is a person's, or `neuronode start`'s. Encoding, averaging,
hashing and checkpoint writes run in worker threads (neuronode.node.pools), so the event loop
keeps answering RPCs during inner steps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

from neuronode.averaging import PROTOCOLS, Averaging, AveragingConfig, NodePhase, RoundState
from neuronode.codec import ContributionEncoder, EncoderConfig
from neuronode.config import NodeConfig
from neuronode.errors import CheckpointError, ConfigError
from neuronode.events import fields
from neuronode.node import checkpoint
from neuronode.node.catchup import CatchUp
from neuronode.node.console import (
    Progress,
    attach_progress,
    download_line,
    progress_line,
    round_seconds,
)
from neuronode.node.handoff import Handoff
from neuronode.node.history import History, RoundRecord
from neuronode.node.member import MemberLost
from neuronode.node.metrics import Metrics, Snapshot
from neuronode.node.page import Page, WarningEvents, shows_addresses
from neuronode.node.pools import Pools
from neuronode.node.replica import Replica
from neuronode.node.rounds import Rounds, finite
from neuronode.node.trainer import make_aggregator
from neuronode.node.web import on_loop
from neuronode.swarm.context import Settings
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.node import SwarmConfig, SwarmNode
from neuronode.swarm.statesync.statesync import TransferProgress

logger = logging.getLogger(__name__)


class Daemon:
    """Runs rounds until --rounds or a stop: join, then train, average, outer step, checkpoint."""

    def __init__(self, cfg: NodeConfig, *, trainer: Replica, node_id: str, data_dir: Path,
                 security: Security | None = None, progress: bool = False) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.node_id = node_id
        self.data_dir = data_dir
        self.state = RoundState()
        self.security = security or Security(node_id=node_id, swarm_id=cfg.swarm_id)
        self.handoff = Handoff()  # the training loop's thread: it trains, and runs our training-thread work
        self.pools = Pools(train=self.handoff)
        self.settings = Settings.from_config(cfg, task=tuple(trainer.settings.items()),
                                             samples_per_batch=trainer.samples_per_batch)
        self.encoder = ContributionEncoder(
            EncoderConfig(codec=self.settings.codec_spec, chunk_bytes=cfg.chunk_bytes, zstd_level=cfg.zstd_level,
                          byte_shuffle=cfg.byte_shuffle, capped=cfg.max_upload_mbps > 0,
                          feedback_decay=self.settings.sparse_decay or 1.0),
            n_elements=trainer.n_params, sender_id=node_id)
        self.restored_meta: dict[str, Any] = {}
        self.last_contributors: list[str] = []
        self.metrics = Metrics(self.metrics_snapshot)
        self.stop_flag = threading.Event()  # a stop was requested (from any thread: request_stop)
        self.stopped: asyncio.Event | None = None  # the same, on our loop once it runs
        self.progress = Progress(enabled=progress)  # the live line on a terminal (`neuronode start`)
        if progress:
            attach_progress(self.progress)
        self.writing: asyncio.Future[Any] | None = None
        self.history = History(data_dir)  # restore() loads the one in the data dir
        self.history_writing: asyncio.Future[Any] | None = None
        self.round_bytes = (0, 0)  # bytes sent and received when the last round closed
        self.events = WarningEvents()  # the status page's recent warnings (with --metrics-port)
        self.swarm: SwarmNode | None = None
        self.rounds: Rounds | None = None
        self.tokens_per_round = cfg.tokens_per_round(trainer.tokens_per_batch)  # the live line, the page
        self.round_s = 0.0  # a whole round's wall time, measured over the last rounds (the live line's ETA)

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
        self.trainer.load_state_dict(loaded.state, path=str(loaded.path))
        if "feedback" in loaded.state:  # error feedback belongs to the encoder (its own thread)
            self.pools.encode.submit(self.encoder.load_state_dict, loaded.state["feedback"]).result()
        self.restored_meta = loaded.meta
        self.history = History.load(self.data_dir, up_to_round=self.engine.round)
        self.last_contributors = list(loaded.meta.get("last_round_contributor_ids", []))
        progress = self.trainer.data_progress()
        logger.info("resumed from %s (round %d)", loaded.path.name, self.engine.round,
                    extra=fields("resumed", round_id=self.engine.round, checkpoint=loaded.path.name,
                                 data_pass=progress.get("data_pass", 0), data_documents=progress.get("data_documents", 0)))

    def request_stop(self) -> None:
        """Stop soon (on our loop): the round in flight is abandoned, pushes get a short grace."""
        if self.stopped is not None and not self.stopped.is_set():
            logger.info("stop requested; finishing cleanly", extra=fields("stopping"))
            self.stopped.set()
        self.stop_flag.set()

    async def run(self) -> int:
        """Join, then run rounds as the training loop finishes them, until --rounds, the loop
        leaves (Handoff.leave) or a stop; then checkpoint, let the last pushes go, leave."""
        stopped = self.stopped = asyncio.Event()
        if self.stop_flag.is_set():  # asked before we ran
            self.request_stop()
        self.state.start(self.engine.round, await self.pools.run(self.pools.train, self.engine.param_digest),
                         self.trainer.momentum_digest)
        if self.engine.round == 0:
            await self.pools.run(self.pools.train, self.trainer.validate)
            logger.info("round 0: val_loss %.4f before training", self.trainer.val_loss,
                        extra=fields("validated", round_id=0, val_loss=self.trainer.val_loss))
        swarm = self.swarm = SwarmNode(self.swarm_config(), executor=self.pools.codec, state=self.state,
                                       status_provider=self.status, state_provider=self.trainer.snapshot,
                                       security=self.security, on_download=self.on_download,
                                       loopback_only=not self.cfg.authenticated and not self.cfg.open)
        self.round_bytes = (int(self.restored_meta.get("bytes_sent", 0)), int(self.restored_meta.get("bytes_received", 0)))
        swarm.restore_counters(bytes_sent=self.round_bytes[0], bytes_received=self.round_bytes[1])
        rounds = self.rounds = self.build_rounds(swarm)
        if self.cfg.metrics_port:
            self.serve_page(swarm)
        try:
            await swarm.start()
        except BaseException:
            self.close_page()
            raise
        try:
            await self.join(stopped)
            while not stopped.is_set() and not rounds.finished():
                if not await rounds.one(stopped):
                    break
            if self.stop_flag.is_set():  # another rank of our member was told to stop
                self.request_stop()
            await rounds.flush(stopped)
        except MemberLost:
            self.request_stop()  # at once: our peers must not wait for a member that lost a process
            raise
        finally:
            await rounds.cancel_pending()
            await self.shutdown(stopped)
        logger.info("stopped at round %d; param_digest %s", self.state.round, self.state.param_digest[:16],
                    extra=fields("stopped", round_id=self.state.round, param_digest=self.state.param_digest))
        return 0

    def build_rounds(self, swarm: SwarmNode) -> Rounds:
        cfg = self.cfg
        averaging: Averaging = PROTOCOLS[cfg.averaging](
            AveragingConfig(node_id=self.node_id, codec=self.settings.codec_spec, n_elements=self.trainer.n_params,
                            sync_timeout_s=cfg.sync_timeout, min_contributors=cfg.min_peers,
                            max_weight=self.trainer.max_weight,
                            makers=cfg.gather_makers),
            transport=swarm.transport, encoder=self.encoder, encoder_pool=self.pools.encode,
            aggregate=make_aggregator(cfg), executor=self.pools.codec)
        if self.restored_meta:  # resumed from a checkpoint: its round may have our receipt already
            averaging.resumed_at = self.engine.round
        catch_up = CatchUp(cfg=cfg, trainer=self.trainer, encoder=self.encoder, state=self.state, swarm=swarm,
                           pools=self.pools, save=self.save_checkpoint)
        return Rounds(cfg=cfg, trainer=self.trainer, state=self.state, swarm=swarm, averaging=averaging,
                      catch_up=catch_up, pools=self.pools, stop=self.stop_flag, train=self.handoff.train,
                      save=self.save_checkpoint, on_sync=self.metrics.sync_seconds.observe,
                      on_round=self.record_round)

    def serve_page(self, swarm: SwarmNode) -> None:
        """--metrics-port: /metrics and the status page (neuronode.node.web)."""
        host = self.cfg.listen.rpartition(":")[0].strip("[]")
        page = Page(cfg=self.cfg, swarm=swarm, state=self.state, history=self.history,
                    show_addresses=shows_addresses(self.cfg, host), events=self.events,
                    tokens_per_round=self.tokens_per_round)
        loop = asyncio.get_running_loop()
        self.metrics.serve(host, self.cfg.metrics_port, shows_addresses=page.show_addresses,
                           api={"/api/status": on_loop(loop, page.status), "/api/history": on_loop(loop, page.history_json)})
        logging.getLogger().addHandler(self.events)

    def close_page(self) -> None:
        self.metrics.close()
        logging.getLogger().removeHandler(self.events)

    async def record_round(self) -> None:
        """Add the round just closed to the history in the data dir (written on the writer thread,
        after the checkpoint it follows)."""
        assert self.swarm is not None and self.rounds is not None
        counters, rounds = self.swarm.counters, self.rounds
        sent, received = counters.bytes_sent, counters.bytes_received
        self.history.add(RoundRecord(
            round=self.state.round, time_s=round(time.time(), 3), loss=finite(self.trainer.loss),
            val_loss=finite(self.trainer.val_loss),
            tokens_per_s=round(finite_or(self.trainer.tokens_per_s, 0.0), 3), sync_s=round(rounds.last_sync_s, 3),
            bytes_sent=max(0, sent - self.round_bytes[0]), bytes_received=max(0, received - self.round_bytes[1]),
            contributors=len(rounds.last_contributors), contributor_ids=tuple(rounds.last_contributors)))
        self.round_bytes = (sent, received)
        self.round_s = round_seconds([r.time_s for r in self.history.records()])
        await self.flush_history()
        self.history_writing = asyncio.get_running_loop().run_in_executor(
            self.pools.writer, save_history, self.history, self.history.records())

    async def flush_history(self) -> None:
        if self.history_writing is not None:
            await self.history_writing
            self.history_writing = None

    async def shutdown(self, stopped: asyncio.Event) -> None:
        assert self.swarm is not None and self.rounds is not None
        self.progress.clear()
        self.state.phase = NodePhase.STOPPING
        if self.engine.steps_this_round and not self.rounds.finished():
            # Keep the inner steps of the interrupted round; a restart resumes them (or
            # catches up with the swarm if it moved on meanwhile).
            await self.save_checkpoint()
        await self.flush_checkpoint()
        await self.flush_history()
        await self.drain(stopped)
        await self.swarm.stop()
        self.close_page()
        self.pools.shutdown()
        self.state.phase = NodePhase.STOPPED

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
            if why := self.swarm.refused():  # training alone, or waiting for --min-peers forever, helps nobody
                raise ConfigError(f"every bootstrap peer refused this node, so it cannot join: {why}")
            await self.rounds.maybe_catch_up(stopped)
            if stopped.is_set():
                return
            await self.swarm.check_reachable()  # at once: whether peers dial us, or we open sessions
        await self.swarm.set_serving(True)
        logger.info("node %s: %d parameters, task %s, codec %s, round %d%s", self.node_id,
                    self.trainer.n_params, self.trainer.task_name, self.settings.codec_spec, self.state.round,
                    f" of {self.cfg.rounds}" if self.cfg.rounds else "", extra=fields("joined", n_params=self.trainer.n_params))

    def on_step(self) -> None:
        """Called in the training thread after each inner step: a fault drill's sleep (--fault-file
        `step_delay_s`: a slower member, read at every step), live progress on a TTY."""
        plan = self.swarm.fault_plan() if self.swarm is not None else None
        if plan is not None and plan.step_delay_s > 0:
            time.sleep(plan.step_delay_s)
        if not self.progress.enabled:
            return
        trainer = self.trainer
        eng = trainer.engine
        self.progress.show(progress_line(
            round_id=eng.round, rounds=self.cfg.rounds, step=eng.steps_this_round, inner_steps=self.cfg.inner_steps,
            loss=trainer.loss, lr=float(eng.inner_optimizer.param_groups[0]["lr"]),
            tokens_per_s=trainer.tokens_per_s, tokens_per_batch=trainer.tokens_per_batch,
            peers=self.swarm.alive_count() if self.swarm is not None else 0,
            tokens_per_round=self.tokens_per_round, round_s=self.round_s))

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
            settings=self.settings, max_ids_per_host=self.cfg.max_ids_per_host,
            reachable=self.cfg.reachable,
        )

    def status(self) -> dict[str, Any]:
        """Daemon-side status fields (the swarm adds peers, bytes and agreement)."""
        rounds = self.rounds
        contributors = rounds.last_contributors if rounds is not None and rounds.last_contributors else self.last_contributors
        rates = self.trainer.rank_tokens_per_s  # one read: the training thread updates them
        return {
            "round": self.state.round, "phase": self.state.phase.value, "param_digest": self.state.param_digest,
            "state_digest": self.trainer.state_digest,
            "loss": finite_or(self.trainer.loss), "val_loss": finite_or(self.trainer.val_loss),
            "last_round_contributors": len(contributors), "last_round_contributor_ids": contributors,
            "inner_steps": self.engine.inner_steps_total, "tokens_per_s": sum(rates),
            "utilization": rounds.utilization if rounds is not None else 0.0,
            "local_workers": self.trainer.local_workers, "rank_tokens_per_s": rates,
            "rank_param_digests": list(self.trainer.rank_digests) or [self.state.param_digest],
            "task": self.trainer.task_name, "n_params": self.trainer.n_params,
            "task_settings": dict(self.trainer.settings), **self.trainer.data_progress(),
            "codec": self.settings.codec_spec, "feedback_norm": self.encoder.residual_norm,
        }

    def metrics_snapshot(self) -> Snapshot:
        """Read at scrape time, from the metrics thread: plain attribute reads and dict copies."""
        swarm, status = self.swarm, self.status()
        sent, received, refusals = swarm.traffic() if swarm is not None else ({}, {}, {})
        return Snapshot(
            rounds=self.state.round, inner_steps=self.engine.inner_steps_total,
            loss=self.trainer.loss, val_loss=self.trainer.val_loss, tokens_per_s=status["tokens_per_s"],
            local_workers=status["local_workers"], rank_tokens_per_s=status["rank_tokens_per_s"],
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
        try:  # first: in a member it collects every rank's stream position and digest
            state = await self.pools.run(self.pools.train, self.trainer.state_dict)
        except MemberLost as exc:
            logger.warning("no checkpoint: %s (a restart resumes from the last one)", exc,
                           extra=fields("checkpoint_skipped", reason=str(exc)))
            return
        meta = {**self.status(), **self.swarm.snapshot(), "phase": NodePhase.STOPPED.value,
                "manifest_hash": self.engine.manifest_hash(), "saved_at": time.time()}
        feedback = await self.pools.run(self.pools.encode, self.encoder.state_dict)
        if feedback is not None:
            state["feedback"] = feedback  # where release 0.1 kept it: its checkpoints load as ever
        self.writing = asyncio.get_running_loop().run_in_executor(self.pools.writer, self.write_checkpoint, meta, state)

    def write_checkpoint(self, meta: dict[str, Any], state: dict[str, Any]) -> None:
        """In the writer thread: serialize, fsync, rename; log how long it took."""
        t0 = time.perf_counter()
        path = checkpoint.save(self.data_dir, meta["round"], meta, state, keep=self.cfg.keep_checkpoints)
        seconds = time.perf_counter() - t0
        logger.debug("checkpoint %s written in %.2f s", path.name, seconds,
                     extra=fields("checkpoint_saved", round_id=meta["round"], checkpoint=path.name,
                                  bytes=path.stat().st_size, seconds=round(seconds, 3)))

    async def flush_checkpoint(self) -> None:
        if self.writing is not None:
            await self.writing
            self.writing = None


def finite_or(value: float, default: float = float("nan")) -> float:
    return value if math.isfinite(value) else default


def save_history(history: History, records: list[RoundRecord]) -> None:
    """On the writer thread: a history that cannot be written is a warning, never a stop."""
    try:
        history.save(records)
    except OSError as exc:
        logger.warning("could not write the round history %s (%s)", history.path, exc.strerror,
                       extra=fields("history_unwritten", file=str(history.path)))
