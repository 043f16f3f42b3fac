"""The composition root: wires training, the swarm and checkpoints; owns tasks and signals.

One asyncio process. Training, encoding, averaging, hashing and checkpoint writes run in
worker threads, so the event loop keeps answering RPCs during inner steps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from neuronode import checkpoint
from neuronode.codec import shard_ranges
from neuronode.config import NodeConfig, check_data_dir
from neuronode.errors import CheckpointError, ConfigError
from neuronode.memory import empty_floats, keep_freed_buffers
from neuronode.metrics import Metrics, Snapshot
from neuronode.security.auth import load_secret, permissions_warning
from neuronode.swarm.node import Outgoing, SwarmConfig, SwarmNode
from neuronode.swarm.rounds import Contribution
from neuronode.swarm.security import Security
from neuronode.trainer import Encoded, Trainer
from neuronode.v1 import node_pb2 as pb

logger = logging.getLogger(__name__)
T = TypeVar("T")


def run_daemon(cfg: NodeConfig) -> int:
    """Validate what needs the file system, build the trainer, run until done or stopped."""
    keep_freed_buffers()  # before any thread allocates (neuronode/memory.py)
    cfg.check_exposure()
    data_dir = check_data_dir(cfg.data_dir)
    setup_logging(cfg.log_format, cfg.log_level)
    node_id = tls_node_id(cfg) or cfg.node_id or load_or_create_node_id(data_dir)
    trainer = Trainer(cfg, node_id=node_id)
    if not cfg.authenticated:
        logger.warning(
            "no --secret-file or TLS: %s; see SECURITY.md to close the swarm",
            f"anyone who can reach --listen {cfg.listen} may join (--open)" if cfg.open
            else "protected mode, serving loopback callers only")
    daemon = Daemon(cfg, trainer=trainer, node_id=node_id, data_dir=data_dir)
    daemon.security = build_security(cfg, node_id)
    daemon.restore()
    return run_async(daemon.run)


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


def build_security(cfg: NodeConfig, node_id: str) -> Security:
    """Load and check the secret and TLS files now, so a mistake stops the start with one line."""
    secret = b""
    if cfg.secret_file:
        secret = load_secret(cfg.secret_file)
        warning = permissions_warning(cfg.secret_file)
        if warning:
            logger.warning("%s", warning)
    tls = None
    if cfg.tls_cert:
        from neuronode.security.certs import cert_hosts, load_node_tls

        load_node_tls(Path(cfg.tls_cert), Path(cfg.tls_key), Path(cfg.tls_ca))
        host = cfg.advertise_address.rpartition(":")[0].strip("[]")
        hosts = cert_hosts(Path(cfg.tls_cert))
        if host not in hosts:
            raise ConfigError(f"--tls-cert is valid for {', '.join(hosts)} but peers will dial "
                              f"{host}; issue a certificate with --host {host}")
        tls = (cfg.tls_cert, cfg.tls_key, cfg.tls_ca)
    return Security(node_id=node_id, swarm_id=cfg.swarm_id, secret=secret, tls_files=tls)


def run_async(main: Callable[[], Awaitable[T]], *, use_uvloop: bool | None = None) -> T:
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


def load_or_create_node_id(data_dir: Path) -> str:
    """A node id generated once and kept in the data dir, so restarts keep their identity."""
    path = data_dir / "node_id"
    if path.exists():
        node_id = path.read_text().strip()
        if node_id:
            return node_id
    node_id = f"node-{uuid.uuid4().hex[:12]}"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(node_id + "\n")
    tmp.replace(path)
    return node_id


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class LogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Clears the live progress line before a log line, so the two never share a line."""

    progress: Progress | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.progress is not None:
            self.progress.clear()
        super().emit(record)


def setup_logging(fmt: str, level: str) -> None:
    handler = LogHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("grpc").setLevel(logging.WARNING)


class Daemon:
    """Runs rounds: train H steps, encode, exchange, average, outer step, checkpoint."""

    def __init__(self, cfg: NodeConfig, *, trainer: Trainer, node_id: str, data_dir: Path) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.node_id = node_id
        self.data_dir = data_dir
        self.phase = "starting"
        self.param_digest = ""
        self.last_contributors: list[str] = []
        self.restored_meta: dict[str, Any] = {}
        self.last_repair_round = -(10**9)
        self.utilization = 0.0
        self.pending: tuple[int, asyncio.Task[SyncResult]] | None = None  # --overlap: sync in flight
        self.last_sync_s = 0.0
        self.metrics = Metrics(self.metrics_snapshot)
        self.stop_flag = threading.Event()  # seen by the training thread between steps
        self.progress = Progress(enabled=sys.stderr.isatty() and cfg.log_format == "text")
        for handler in logging.getLogger().handlers:
            if isinstance(handler, LogHandler):
                handler.progress = self.progress
        # One thread trains (torch state is not thread-safe); another encodes/decodes chunks.
        self.train_pool = ThreadPoolExecutor(1, thread_name_prefix="train")
        self.codec_pool = ThreadPoolExecutor(2, thread_name_prefix="codec")
        self.writer_pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.writing: asyncio.Future[Any] | None = None

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
        self.restored_meta = loaded.meta
        self.last_contributors = list(loaded.meta.get("last_round_contributor_ids", []))
        logger.info("resumed from %s (round %d)", loaded.path.name, self.engine.round)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()

        def request_stop() -> None:
            if not stopped.is_set():
                logger.info("stop requested; finishing cleanly")
            stopped.set()
            self.stop_flag.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, request_stop)
        self.param_digest = await self.off_loop(self.train_pool, self.engine.param_digest)
        if self.engine.round == 0:
            await self.off_loop(self.train_pool, self.trainer.validate)
            logger.info("round 0: val_loss %.4f before training", self.trainer.val_loss)
        self.swarm = SwarmNode(self.swarm_config(), executor=self.codec_pool, status_provider=self.status,
                               state_provider=self.trainer.snapshot, security=self.security)
        self.swarm.loopback_only = not self.cfg.authenticated and not self.cfg.open
        self.swarm.counters.bytes_sent = int(self.restored_meta.get("bytes_sent", 0))
        self.swarm.counters.bytes_received = int(self.restored_meta.get("bytes_received", 0))
        if self.cfg.metrics_port:
            self.metrics.serve(self.cfg.listen.rpartition(":")[0].strip("[]"), self.cfg.metrics_port)
        try:
            await self.swarm.start()
        except BaseException:
            self.metrics.close()
            raise
        self.swarm.record_round(self.engine.round - 1, self.param_digest)
        try:
            await self.join(stopped)
            while not stopped.is_set() and not self.finished():
                if not await self.one_round(stopped):
                    break
            if self.pending is not None and not stopped.is_set():
                await self.finish_sync(*self.pending, stopped)  # --overlap: the last round's sync
                self.pending = None
        finally:
            if self.pending is not None:
                self.pending[1].cancel()
                await asyncio.gather(self.pending[1], return_exceptions=True)
                self.pending = None
            self.progress.clear()
            self.phase = "stopping"
            if self.engine.steps_this_round and not self.finished():
                # Keep the inner steps of the interrupted round; a restart resumes them (or
                # catches up with the swarm if it moved on meanwhile).
                await self.save_checkpoint()
            await self.flush_checkpoint()
            await self.drain(stopped)
            await self.swarm.stop()
            self.metrics.close()
            self.train_pool.shutdown(wait=True)
            self.codec_pool.shutdown(wait=True)
            self.writer_pool.shutdown(wait=True)
        logger.info("stopped at round %d; param_digest %s", self.engine.round, self.param_digest[:16])
        return 0

    async def drain(self, stopped: asyncio.Event) -> None:
        """Let our last pushes finish: up to --sync-timeout after a normal finish, at most 5 s
        once a stop was requested (before or during the wait)."""
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
        if self.cfg.peers:
            self.phase = "joining"
            contact = asyncio.ensure_future(
                self.swarm.wait_first_contact(timeout_s=max(10.0, 3 * self.cfg.heartbeat_s)))
            stop_wait = asyncio.ensure_future(stopped.wait())
            await asyncio.wait({contact, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            for task in (contact, stop_wait):
                task.cancel()
            await asyncio.gather(contact, stop_wait, return_exceptions=True)
            if stopped.is_set():
                return
            await self.maybe_catch_up()
            if self.cfg.advertise:
                await self.swarm.check_reachable()
        await self.swarm.set_serving(True)
        logger.info("node %s: %d parameters, task %s, codec %s, round %d%s", self.node_id,
                    self.trainer.n_params, self.cfg.task, self.cfg.codec, self.engine.round,
                    f" of {self.cfg.rounds}" if self.cfg.rounds else "")

    def finished(self) -> bool:
        """--rounds counts rounds trained; with --overlap the last one's sync is flushed after."""
        return bool(self.cfg.rounds) and self.rounds_trained() >= self.cfg.rounds

    def rounds_trained(self) -> int:
        return self.engine.round + (1 if self.pending is not None else 0)

    async def off_loop(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def one_round(self, stopped: asyncio.Event) -> bool:
        """One DiLoCo round; False when a stop interrupted it (nothing half-applied).

        Without --overlap: train, exchange, outer step. With --overlap the exchange of round r
        runs in the background while round r+1 trains; its outer step is applied at the end of
        round r+1 (one-round-delayed outer step), and round r+2 starts from the result.
        """
        plan = self.swarm.catch_up_plan()
        if plan is not None and self.pending is not None and self.repair_due(plan):
            # --overlap: our sync in flight belongs to a lineage we are about to leave.
            self.pending[1].cancel()
            await asyncio.gather(self.pending[1], return_exceptions=True)
            self.pending = None
        if self.pending is None:
            await self.maybe_catch_up()
        round_id = self.rounds_trained()
        started = time.monotonic()
        self.phase = "training"
        await self.off_loop(self.train_pool, self.trainer.train_round, self.stop_flag, self.on_step)
        train_s = time.monotonic() - started
        if not self.trainer.round_complete():
            return False
        self.phase = "encoding"
        if self.swarm.faults.path:
            plan = self.swarm.faults.refresh()
            self.trainer.lie = (plan.byzantine_scale, plan.byzantine_noise)
        if not self.cfg.overlap:
            if self.swarm.contributes_from > round_id:  # we adopted this round (maybe_catch_up)
                sync = self.listened(round_id)
            elif closed := self.swarm.closed_without_us(round_id):
                # Contributing now would leave us, or the members still in the round, outside the
                # average those peers applied. Listening gives us exactly theirs (docs/fault-tolerance.md).
                logger.warning("round %d: %s closed it before we could contribute (we joined or trained "
                               "late); listening to it instead", round_id, ", ".join(closed))
                self.swarm.stand_aside(round_id)
                sync = self.listened(round_id)
            else:
                sync = await self.prepare_sync(round_id)
            if not await self.finish_sync(round_id, self.start_sync(round_id, sync), stopped):
                return False
        else:
            sync = await self.prepare_sync(round_id)
            previous, self.pending = self.pending, None
            if previous is not None and not await self.finish_sync(*previous, stopped):
                return False
            if previous is None:  # nothing to apply yet: round r+1 starts from the global params
                await self.off_loop(self.train_pool, self.trainer.restart_from_global)
            # ... shifted to where they will be if round r+1's average equals our contribution.
            await self.off_loop(self.train_pool, self.trainer.look_ahead)
            self.pending = (round_id, self.start_sync(round_id, sync))
        self.utilization = train_s / max(time.monotonic() - started, 1e-9)
        return True

    def link_rate(self) -> float:
        """Bytes/s our pushes reach (capped by --max-upload-mbps), for the zstd level choice."""
        link = self.swarm.push_rate
        if self.swarm.upload.enabled:
            link = min(link or self.swarm.upload.bytes_per_s, self.swarm.upload.bytes_per_s)
        return link

    async def prepare_sync(self, round_id: int) -> Awaitable[SyncResult]:
        """Encode this round's contribution (in the training thread, before the model moves on)
        and return the coroutine that exchanges and averages it."""
        base = self.trainer.param_digest  # the parameters this round started from
        if self.cfg.averaging == "reduce-scatter":
            members = await self.swarm.members(round_id, self.cfg.min_peers, give_up=self.stop_flag.is_set)
            ranges = shard_ranges(self.trainer.n_params, len(members), self.cfg.codec)
            shards = await self.off_loop(self.train_pool, self.trainer.encode_shards, ranges, self.link_rate())
            return self.reduce_scatter(round_id, members, ranges, shards, base)
        # All-to-all sends this encoding to every peer: it leaves at the upload rate / fan-out.
        fanout = max(1, len(self.swarm.table.alive()))
        enc = await self.off_loop(self.train_pool, self.trainer.encode, self.link_rate() / fanout)
        out = self.outgoing(round_id, enc, base)
        own = Contribution(self.node_id, round_id, self.cfg.codec, enc.weight, enc.own, base_digest=base)
        return self.all_to_all(out, own)

    def outgoing(self, round_id: int, enc: Encoded, base: str, **shard: Any) -> Outgoing:
        return Outgoing(round_id=round_id, codec=self.cfg.codec, frames=enc.frames, digest=enc.digest,
                        n_elements=self.trainer.n_params, chunk_elements=enc.chunk_elements,
                        weight=enc.weight, shuffled=enc.shuffled, base_digest=base, **shard)

    async def all_to_all(self, out: Outgoing, own: Contribution) -> SyncResult:
        contributions = await self.swarm.exchange(out, own)
        by_node = {c.sender_id: (c.data, c.weight) for c in contributions.values()}
        return SyncResult(contributions=by_node, contributors=sorted(by_node))

    async def reduce_scatter(self, round_id: int, members: tuple[str, ...], ranges: list[tuple[int, int]],
                             shards: list[Encoded], base: str) -> SyncResult:
        """Member i averages everyone's shard i and sends the averaged shard to all: each node
        sends about 2x one contribution whatever the swarm size (docs/protocol.md)."""
        me = members.index(self.node_id)
        outs = {m: self.outgoing(round_id, shards[j], base, phase=pb.PHASE_SHARD, shard_index=j, members=members)
                for j, m in enumerate(members) if m != self.node_id}
        own = Contribution(self.node_id, round_id, self.cfg.codec, shards[me].weight, shards[me].own,
                           base_digest=base, members=members, shard_index=me)
        pieces = await self.swarm.exchange(outs, own, members=members)
        by_node = {c.sender_id: (c.data, c.weight) for c in pieces.values()}
        reduced = await self.off_loop(self.codec_pool, self.trainer.reduce_shard, by_node, self.link_rate())
        contributors = tuple(sorted(by_node))
        out = self.outgoing(round_id, reduced, base, phase=pb.PHASE_AVERAGED, shard_index=me,
                            members=members, contributors=contributors)
        own_avg = Contribution(self.node_id, round_id, self.cfg.codec, reduced.weight, reduced.own,
                               base_digest=base, members=members, contributors=contributors, shard_index=me)
        averaged = await self.swarm.exchange(out, own_avg, members=members)
        averaged = await self.swarm.keep_agreed_shards(round_id, members, averaged)
        return await self.off_loop(self.codec_pool, assemble_shards, averaged, members, ranges,
                                   self.trainer.n_params, round_id)

    async def listened(self, round_id: int) -> SyncResult:
        """The average of a round we only listen to (see maybe_catch_up)."""
        if self.cfg.averaging != "reduce-scatter":
            got = await self.swarm.listen(round_id)
            by_node = {c.sender_id: (c.data, c.weight) for c in got.values()}
            if by_node:
                return SyncResult(contributions=by_node, contributors=sorted(by_node))
        else:
            averaged = await self.swarm.listen(round_id, phase=pb.PHASE_AVERAGED)
            if averaged:
                members = next(iter(averaged.values())).members
                averaged = await self.swarm.keep_agreed_shards(round_id, members, averaged, publish=False)
                ranges = shard_ranges(self.trainer.n_params, len(members), self.cfg.codec)
                return await self.off_loop(self.codec_pool, assemble_shards, averaged, members, ranges,
                                           self.trainer.n_params, round_id)
        logger.warning("round %d: heard no contribution; our outer step uses a zero average", round_id)
        return SyncResult(contributors=[], average=torch.zeros(self.trainer.n_params))

    def start_sync(self, round_id: int, sync: Awaitable[SyncResult]) -> asyncio.Task[SyncResult]:
        started = time.monotonic()
        task = asyncio.get_running_loop().create_task(sync, name=f"sync-{round_id}")  # type: ignore[arg-type]
        # How long the exchange itself took (with --overlap it ends long before we read it).
        task.add_done_callback(lambda _: setattr(self, "last_sync_s", time.monotonic() - started))
        return task

    async def finish_sync(self, round_id: int, exchange: asyncio.Task[SyncResult], stopped: asyncio.Event) -> bool:
        """Wait for a round's exchange (or a stop), then average and take the outer step."""
        self.phase = "syncing"
        waited = time.monotonic()
        stop_wait = asyncio.ensure_future(stopped.wait())
        await asyncio.wait({exchange, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not exchange.done():
            exchange.cancel()
            await asyncio.gather(exchange, return_exceptions=True)
            return False
        result = exchange.result()
        sync_s = self.last_sync_s
        self.metrics.sync_seconds.observe(sync_s)
        self.phase = "outer step"
        if result.average is not None:
            self.param_digest = await self.off_loop(self.train_pool, self.trainer.apply_average, result.average)
        else:
            self.param_digest = await self.off_loop(self.train_pool, self.trainer.apply, result.contributions)
        self.last_contributors = result.contributors
        self.swarm.record_round(round_id, self.param_digest)
        await self.save_checkpoint()
        self.progress.clear()
        logger.info(
            "round %d done: loss %.4f val_loss %.4f contributors %d sync %.1fs waited %.1fs digest %s from %s",
            self.engine.round, self.trainer.loss, self.trainer.val_loss, len(result.contributors), sync_s,
            time.monotonic() - waited, self.param_digest[:12], ",".join(self.last_contributors))
        return True

    async def maybe_catch_up(self) -> None:
        """Before a round: if we are behind the swarm's winning lineage, or outside it, download
        the global state from one of its members and continue from there."""
        plan = self.swarm.catch_up_plan()
        if plan is None or not self.repair_due(plan):
            return
        self.phase = "catching up"
        started = time.monotonic()
        logger.info("%s (round %d, swarm at round %d): downloading the global state from %s",
                    "behind the swarm" if plan.reason == "behind" else "diverged from the swarm",
                    self.engine.round, plan.target_round, ", ".join(plan.donors[:3]))
        state = await self.swarm.fetch_state(plan.donors)
        if state is None:
            logger.warning("no donor delivered the state; training on and trying again next round")
            return
        self.param_digest = await self.off_loop(self.train_pool, self.trainer.adopt, state)
        # Under --overlap the swarm made its round-R contributions from the parameters before
        # the ones we adopted at round R: we listen to round R (apply its average at the end of
        # our first round, like everyone) and contribute from round R + 1 on. Under
        # reduce-scatter each member fixes round R's membership when its inner steps end, and
        # whether our announcement reached it by then is a race: members that disagree drop
        # each other's slices and all wait out the deadline. Listening to round R keeps every
        # member's view of it the same; we are a member from R + 1 on (docs/protocol.md).
        listen = self.cfg.overlap or self.cfg.averaging == "reduce-scatter"
        self.swarm.adopt(state.round, self.param_digest, contributes_from=state.round + 1 if listen else 0)
        if self.cfg.overlap:
            self.pending = (state.round, self.start_sync(state.round, self.listened(state.round)))
        if plan.reason == "diverged":  # only repairs count toward the cooldown, not catch-ups
            self.last_repair_round = self.engine.round
        await self.save_checkpoint()
        logger.info("adopted the swarm's state at round %d in %.1fs (digest %s, val_loss %.4f)",
                    state.round, time.monotonic() - started, self.param_digest[:12], self.trainer.val_loss)

    def repair_due(self, plan: Any) -> bool:
        """Catching up is never delayed; a diverged replica repairs at most once per cooldown."""
        if plan.reason == "diverged" and self.engine.round - self.last_repair_round < self.cfg.repair_cooldown:
            self.swarm.say("repair-cooldown", logging.WARNING, "diverged from the swarm, but repaired "
                           "at round %d; next repair after %d rounds", self.last_repair_round,
                           self.cfg.repair_cooldown)
            return False
        return True

    def on_step(self, trainer: Trainer) -> None:
        """Called in the training thread after each inner step: live progress on a TTY."""
        if not self.progress.enabled:
            return
        eng = trainer.engine
        h = self.cfg.inner_steps
        lr = eng.inner_config.lr_at(max(eng.inner_steps_total - 1, 0))
        filled = round(20 * eng.steps_this_round / h)
        step_s = (trainer.task.tokens_per_batch / trainer.tokens_per_s) if trainer.tokens_per_s else 0.0
        left_steps = h - eng.steps_this_round
        if self.cfg.rounds:
            left_steps += (self.cfg.rounds - eng.round - 1) * h
        total = f"/{self.cfg.rounds}" if self.cfg.rounds else ""
        self.progress.show(
            f"round {eng.round + 1}{total} [{'#' * filled}{'.' * (20 - filled)}] "
            f"step {eng.steps_this_round}/{h} loss {trainer.loss:.3f} lr {lr:.2e} "
            f"{trainer.tokens_per_s:,.0f} tok/s peers {len(self.swarm.table.alive())} "
            f"ETA {format_eta(left_steps * step_s)}")

    def swarm_config(self) -> SwarmConfig:
        return SwarmConfig(
            node_id=self.node_id, swarm_id=self.cfg.swarm_id, manifest_hash=self.engine.manifest_hash(),
            n_elements=self.trainer.n_params, listen=self.cfg.listen, advertise=self.cfg.advertise,
            peers=self.cfg.peers, sync_timeout_s=self.cfg.sync_timeout, min_contributors=self.cfg.min_peers,
            heartbeat_s=self.cfg.heartbeat_s, first_round=self.engine.round,
            zstd_level=self.cfg.zstd_level, fault_file=self.cfg.fault_file,
            max_upload_mbps=self.cfg.max_upload_mbps, round_lag=2 if self.cfg.overlap else 1,
        )

    def status(self) -> dict[str, Any]:
        """Daemon-side status fields (the swarm adds peers, bytes and agreement)."""
        return {
            "round": self.engine.round, "phase": self.phase, "param_digest": self.param_digest,
            "loss": finite_or(self.trainer.loss), "val_loss": finite_or(self.trainer.val_loss),
            "last_round_contributors": len(self.last_contributors),
            "last_round_contributor_ids": self.last_contributors,
            "inner_steps": self.engine.inner_steps_total, "tokens_per_s": self.trainer.tokens_per_s,
            "utilization": self.utilization,
        }

    def metrics_snapshot(self) -> Snapshot:
        """Read at scrape time, from the metrics thread: plain attribute reads and dict copies."""
        swarm = getattr(self, "swarm", None)
        counters = swarm.counters if swarm is not None else None
        return Snapshot(
            rounds=self.engine.round, inner_steps=self.engine.inner_steps_total,
            loss=self.trainer.loss, val_loss=self.trainer.val_loss, tokens_per_s=self.trainer.tokens_per_s,
            contributors=len(self.last_contributors), utilization=self.utilization,
            peers_alive=len(swarm.table.alive()) if swarm is not None else 0,
            bytes_sent=dict(counters.per_peer_sent) if counters else {},
            bytes_received=dict(counters.per_peer_received) if counters else {},
            refusals=dict(counters.refusals) if counters else {},
        )

    async def save_checkpoint(self) -> None:
        """Snapshot the state in the training thread (a quick copy), then serialize, fsync and
        rename in the writer thread, so training goes on while the disk works. One write at a
        time: the next save, and shutdown, wait for the one before."""
        await self.flush_checkpoint()
        meta = {**self.status(), **self.swarm.snapshot(), "phase": "stopped",
                "manifest_hash": self.engine.manifest_hash(), "saved_at": time.time()}
        state = await self.off_loop(self.train_pool, self.trainer.state_dict)
        self.writing = asyncio.get_running_loop().run_in_executor(
            self.writer_pool, lambda: checkpoint.save(self.data_dir, meta["round"], meta, state,
                                                      keep=self.cfg.keep_checkpoints))

    async def flush_checkpoint(self) -> None:
        if self.writing is not None:
            await self.writing
            self.writing = None


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


@dataclass
class SyncResult:
    """A finished exchange: the contributions to average (all-to-all), or the average itself
    (reduce-scatter, assembled from the averaged shards)."""

    contributors: list[str]
    contributions: dict[str, tuple[Any, float]] = field(default_factory=dict)
    average: torch.Tensor | None = None


def assemble_shards(averaged: dict[str, Contribution], members: tuple[str, ...],
                    ranges: list[tuple[int, int]], n_params: int, round_id: int) -> SyncResult:
    """Concatenate the averaged shards. A shard missing here (its reducer is gone, or not every
    member received it: SwarmNode.keep_agreed_shards) gets no update this round (zeros), on every member
    alike."""
    avg = empty_floats(n_params)
    contributors: set[str] = set()
    for c in averaged.values():
        start, stop = ranges[c.shard_index]
        c.data.decode_into(avg[start:stop])
        contributors.update(c.contributors)
    missing = sorted(set(members) - {c.sender_id for c in averaged.values()})
    for index, member in enumerate(members):
        if member in missing:
            start, stop = ranges[index]
            avg[start:stop].zero_()
    if missing:
        logger.warning("round %d: no averaged shard from %s; those parameters get no update this round",
                       round_id, ", ".join(missing))
    return SyncResult(contributors=sorted(contributors), average=avg)


def finite_or(value: float, default: float = float("nan")) -> float:
    return value if math.isfinite(value) else default


class Progress:
    """A single status line rewritten in place on a terminal; silent otherwise."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()

    def show(self, line: str) -> None:
        if self.enabled:
            with self._lock:
                sys.stderr.write("\r\x1b[2K" + line)
                sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            with self._lock:
                sys.stderr.write("\r\x1b[2K")
                sys.stderr.flush()
