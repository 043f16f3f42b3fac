"""What the parts of a SwarmNode share: its settings, credentials, peer table, round book and
round state, channels, counters, fault seam, upload limiter and the owner of its tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from neuronode.averaging import RoundBook, RoundState
from neuronode.clock import Clock
from neuronode.codec import SPARSE, codec_spec, get_codec, shard_ranges
from neuronode.config import NodeConfig
from neuronode.events import Throttled
from neuronode.swarm.faults import Faults
from neuronode.swarm.guard.bans import Bans
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.guard.ratelimit import UploadLimiter, UploadMeter
from neuronode.swarm.guard.replay import SpentRequests
from neuronode.swarm.membership.table import MAX_IDS_PER_HOST, MAX_MEMBERS, MIN_FANOUT, PeerTable
from neuronode.swarm.server import Channels, Counters

logger = logging.getLogger(__name__)


MAX_WEIGHT = 1e15  # the bound of a swarm built without a config (in-process tests, benchmarks)


@dataclass(frozen=True)
class Settings:
    """What every member of a swarm must run alike besides the model (NodeInfo.settings): a
    member with other settings is refused at Hello, naming the flag and both values."""

    codec: str = "fp32"
    averaging: str = "all-to-all"
    aggregator: str = "mean"  # canonical: name, then ":" and sorted K=V options
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    overlap: bool = False
    # The most processes a member may train with (--local-workers): nobody can count another
    # member's ranks, so a claimed weight is bounded by this many times one process's samples.
    max_local_workers: int = 1
    # The task's own settings, (name, value) in the order compared (Task.settings: sizes,
    # tokenizer, sequence length); compared after the flags above, before the parameter manifest.
    task: tuple[tuple[str, str], ...] = ()
    max_weight: float = MAX_WEIGHT  # the most samples one contribution may claim (--max-weight)
    # The sparse codec's: its defaults under --codec sparse (0 given), 0 under any other codec.
    sparse_k: int = 0
    sparse_bits: int = 0
    sparse_block: int = 0
    sparse_decay: float = 0.0
    # --gather-makers under --averaging gather (0 under the others): contributions a round averages.
    gather_makers: int = 0

    FLAGS: ClassVar[dict[str, str]] = {"codec": "--codec", "averaging": "--averaging", "aggregator": "--aggregator/--aggregator-option",
             "outer_lr": "--outer-lr", "outer_momentum": "--outer-momentum", "overlap": "--overlap",
             "max_local_workers": "--max-local-workers",
             "sparse_k": "--sparse-k", "sparse_bits": "--sparse-bits", "sparse_block": "--sparse-block",
             "sparse_decay": "--sparse-decay", "gather_makers": "--gather-makers"}
    # Compared after the task's settings: its default follows sizes the task names first.
    DERIVED: ClassVar[dict[str, str]] = {"max_weight": "--max-weight"}
    # What a person needs to fix a mismatch of a setting whose default is derived.
    HINTS: ClassVar[dict[str, str]] = {
        "--max-weight": " (by default --inner-steps x --batch-size x --grad-accum x --max-local-workers; members "
                        "that differ in those need one --max-weight given to all)",
        "initial weights": " (the parameters a member starts from: build the model the same way on every member, "
                           "from the same seed or the same saved weights)"}

    def __post_init__(self) -> None:
        sparse = self.codec == SPARSE
        for name in ("sparse_k", "sparse_bits", "sparse_block", "sparse_decay"):
            default = getattr(NodeConfig, name)
            object.__setattr__(self, name, (getattr(self, name) or default) if sparse else type(default)(0))
        gather = self.averaging == "gather"
        object.__setattr__(self, "gather_makers", (self.gather_makers or NodeConfig.gather_makers) if gather else 0)

    @classmethod
    def from_config(cls, cfg: NodeConfig, *, task: tuple[tuple[str, str], ...] = (),
                    samples_per_batch: int | None = None) -> Settings:
        """The settings `cfg` runs; the task's `samples_per_batch` (default --batch-size) sets
        the default --max-weight."""
        outer_lr, outer_momentum = cfg.outer()
        return cls(codec=cfg.codec, averaging=cfg.averaging,
                   aggregator=canonical_aggregator(cfg.aggregator, cfg.aggregator_option),
                   outer_lr=outer_lr, outer_momentum=outer_momentum, overlap=cfg.overlap,
                   max_local_workers=cfg.max_local_workers, task=task,
                   max_weight=cfg.weight_bound(cfg.batch_size if samples_per_batch is None else samples_per_batch),
                   sparse_k=cfg.sparse_k, sparse_bits=cfg.sparse_bits, sparse_block=cfg.sparse_block,
                   sparse_decay=cfg.sparse_decay, gather_makers=cfg.gather_makers)

    @property
    def codec_spec(self) -> str:
        """The codec with its parameters, as `get_codec` takes it: what fixes the geometry."""
        return codec_spec(self.codec, k=self.sparse_k, bits=self.sparse_bits, block=self.sparse_block)

    def mismatch(self, theirs: Settings) -> tuple[str, str, str] | None:
        """(flag or setting name, their value, ours) of the first setting that differs, else None."""
        for name, flag in self.FLAGS.items():
            if getattr(theirs, name) != getattr(self, name):
                return flag, str(getattr(theirs, name)), str(getattr(self, name))
        ours, their_task = dict(self.task), dict(theirs.task)
        for name in [*ours, *(n for n in their_task if n not in ours)]:
            if ours.get(name) != their_task.get(name):
                return name, their_task.get(name, "(not set)"), ours.get(name, "(not set)")
        for name, flag in self.DERIVED.items():
            if getattr(theirs, name) != getattr(self, name):
                return flag, str(getattr(theirs, name)), str(getattr(self, name))
        return None


def canonical_aggregator(name: str, options: tuple[str, ...]) -> str:
    """One string for an aggregator and its options, equal on nodes that aggregate alike."""
    return f"{name}:{','.join(sorted(options))}" if options else name


@dataclass(frozen=True)
class SwarmConfig:
    """What the swarm layer needs to know; built by the daemon from NodeConfig."""

    node_id: str
    swarm_id: str
    manifest_hash: str
    n_elements: int
    listen: str
    advertise: str
    peers: tuple[str, ...] = ()
    sync_timeout_s: float = 60.0
    min_contributors: int = 1
    heartbeat_s: float = 2.0
    zstd_level: int = 1
    fault_file: str = ""
    max_upload_mbps: float = 0.0
    max_relay_mbps: float = 0.0  # what we forward for members nobody can dial (0: no cap of its own)
    # How far a peer's reported round may trail a round it will still contribute to: 1, or 2
    # under --overlap (a node contributes to round r while round r-1's sync is still in flight).
    round_lag: int = 1
    settings: Settings = Settings()
    max_ids_per_host: int = MAX_IDS_PER_HOST
    reachable: str = "auto"  # --reachable
    # False: every heartbeat greets every peer and every Hello says everything (receipts, echoes,
    # all known peers): the protocol before issue 18, which `bench membership` measures against.
    sampled_membership: bool = True


class Tasks:
    """Owns every background task of a node: a task that fails is logged, stop() cancels all."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task %s failed: %r", task.get_name(), task.exception(),
                         exc_info=task.exception())

    def supervise(self, factory: Callable[[], Coroutine[Any, Any, Any]], name: str, *,
                  restart_after_s: float = 1.0) -> asyncio.Task[Any]:
        """A task that must not stop (heartbeats): when it fails it is logged and started again."""

        async def keep_running() -> None:
            while True:
                try:
                    await factory()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - logged; one bad input must not end heartbeats
                    logger.error("%s failed (%r); restarting it in %.0f s", name, exc, restart_after_s,
                                 exc_info=exc)
                    await asyncio.sleep(restart_after_s)

        return self.spawn(keep_running(), name)

    def named(self, prefix: str) -> list[asyncio.Task[Any]]:
        return [t for t in self._tasks if t.get_name().startswith(prefix)]

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# A contribution stream that sends no chunk for this long (or --sync-timeout, if longer) is
# aborted and its buffer freed; so is one still streaming when its round closes.
STREAM_IDLE_MIN_S = 10.0


def sender_bytes_bound(n_elements: int, codec: str, *, window: int) -> int:
    """The most one member may have buffered here: `window` rounds of one whole contribution,
    or of its slice and averaged shard under reduce-scatter (two shards of two members, the
    largest pair), in the codec's encoded form."""
    c = get_codec(codec)
    (a, b), (_, d) = shard_ranges(n_elements, 2, codec) if n_elements >= 2 else ((0, n_elements), (0, n_elements))
    return window * max(c.payload_bytes(n_elements), c.payload_bytes(b - a) + c.payload_bytes(d - b))


def buffered_bytes_bound(cfg: SwarmConfig, members: int) -> int:
    """What the round book may hold at most with `members` live members (docs/protocol.md)."""
    return sender_bytes_bound(cfg.n_elements, cfg.settings.codec_spec, window=2) * min(members, MAX_MEMBERS)


@dataclass
class Context:
    cfg: SwarmConfig
    security: Security
    state: RoundState
    executor: Executor
    clock: Clock = field(default_factory=Clock)
    tasks: Tasks = field(default_factory=Tasks)
    counters: Counters = field(default_factory=Counters)
    loopback_only: bool = False  # protected mode: no authentication and no --open

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.bans = Bans(clock=self.clock)  # the node's one ban list (neuronode.swarm.guard.bans)
        self.spent = SpentRequests(self.clock)  # signed requests used here (each is good once)
        self.table = PeerTable(self_id=cfg.node_id, dead_after_s=max(3 * cfg.heartbeat_s, 5.0), clock=self.clock,
                               max_ids_per_host=cfg.max_ids_per_host,
                               min_fanout=MIN_FANOUT if cfg.sampled_membership else MAX_MEMBERS, bans=self.bans)
        self.book = RoundBook(first_round=self.state.round, clock=self.clock,
                              max_sender_bytes=sender_bytes_bound(cfg.n_elements, cfg.settings.codec_spec, window=2),
                              idle_s=max(STREAM_IDLE_MIN_S, cfg.sync_timeout_s))
        self.channels = Channels(self.security)
        self.faults = Faults(cfg.fault_file or None, self_address=cfg.advertise)
        self.upload = UploadLimiter(cfg.max_upload_mbps)
        self.upload_meter = UploadMeter()
        self.say = Throttled(logging.getLogger("neuronode.swarm"), self.clock)
        self.advertise = cfg.advertise  # "" while a wildcard --listen learns it (neuronode.swarm.membership.reach)
        self.bound_port = 0  # the port the server listens on
        self.reachable = "unknown"  # can peers dial us at `advertise`: "yes", "no" or "unknown"
        self.started = False  # the server is up: announcements may go out
        self.leaving = False
