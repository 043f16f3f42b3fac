"""What every averaging protocol offers a node: prepare a round, exchange it, or listen to it.

`prepare` runs when the node's inner steps end (the model may move on once it returns): it
fixes what the round needs (reduce-scatter: its members) and encodes our contribution on the
encoder's thread. `exchange` sends it, collects the others', averages and returns the average.
`listen` averages a round we do not contribute to (we adopted the swarm's state at its start,
or stood aside). All three return the one averaged pseudo-gradient the outer step applies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from neuronode.averaging.agreement import (
    Decision,
    Receipt,
    Statement,
    decide,
    listed,
    receipt_of,
    statement_of,
)
from neuronode.averaging.book import majority_lineage
from neuronode.averaging.lateness import cut_grace
from neuronode.averaging.sortition import DEFAULT_MAKERS
from neuronode.averaging.transport import Transport
from neuronode.clock import Clock
from neuronode.codec import Contribution, ContributionEncoder, Phase, VectorEncoder
from neuronode.codec.contribution import Aggregate
from neuronode.diloco.hosts import by_host
from neuronode.events import fields
from neuronode.quorum import majority, quorum, voice, voices

logger = logging.getLogger(__name__)

# A member publishes its receipt when it closes the phase: up to one --sync-timeout after it
# began collecting, which was no later than our own start (it sent us its contribution when it
# began) or its previous phase's end. Waiting twice that long keeps us from giving up on a
# receipt that is still coming (unless the receipts' cut comes first: `wait_for_receipts`).
RECEIPT_WAIT_TIMEOUTS = 2
UPDATE_BYTES_PER_ELEMENT = 4  # a round's averaged update on the wire: fp32, so it applies bit for bit
UPDATE_NAMES_AT_MOST = 256  # contributors an update's header names (none beyond: neuronode.swarm.wire)


@dataclass(frozen=True)
class AveragingConfig:
    """What a protocol needs besides its transport: who we are, the swarm's codec and size,
    the deadline of one phase and --min-peers."""

    node_id: str
    codec: str
    n_elements: int
    sync_timeout_s: float = 60.0
    min_contributors: int = 1  # --min-peers
    max_weight: float = 0.0  # --max-weight: what one host's ids weigh together at most (0: their sum)
    makers: int = DEFAULT_MAKERS  # --gather-makers: contributions a gather round averages at most


@dataclass
class Prepared:
    """Our encoded contribution of one round, ready to exchange."""

    round_id: int
    parts: list[Contribution]  # one, or one shard per member (reduce-scatter)
    compensated: torch.Tensor  # the pseudo-gradient they encode, error feedback included
    members: tuple[str, ...] = ()  # reduce-scatter: the reducers, one shard each
    senders: tuple[str, ...] = ()  # reduce-scatter: every member of the round (the reducers and those nobody can dial)
    ranges: list[tuple[int, int]] = field(default_factory=list)
    encode_s: float = 0.0
    base_digest: str = ""  # the parameters the round starts from (gather: a member that sends nothing)


@dataclass
class Average:
    """A round's averaged pseudo-gradient and who is in it."""

    vector: torch.Tensor
    contributors: list[str]  # sorted
    fewest: int  # the fewest contributions any part of `vector` averages (0: a part got none)
    encode_s: float = 0.0
    exchange_s: float = 0.0  # waiting for the network (both phases under reduce-scatter)
    average_s: float = 0.0  # aggregating and decoding (reducing and assembling too)
    sent: list[Contribution] = field(default_factory=list)  # every encode of the round that we sent
    # What each contribution weighed (its samples), by sender; all-to-all only (a reducer sees
    # slices, the others only averaged shards).
    weights: dict[str, float] = field(default_factory=dict)


class Averaging:
    """Base of AllToAll and ReduceScatter: what they share."""

    def __init__(self, cfg: AveragingConfig, *, transport: Transport, encoder: ContributionEncoder,
                 encoder_pool: Executor, aggregate: Aggregate, executor: Executor, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.encoder = encoder  # used on encoder_pool's one thread only
        self.encoder_pool = encoder_pool
        self.aggregate = aggregate
        self.executor = executor  # decoding and averaging
        self.clock = clock or Clock()
        self.late_receipts: set[str] = set()  # members whose receipt a deadline passed without
        self.agreed: dict[int, dict[str, Contribution]] = {}  # round -> the whole contributions it averaged
        self.fetched: dict[int, int] = {}  # round -> payload bytes we fetched of it (missed contributions, updates)
        # The round we resumed at from a checkpoint (-1: none). Our previous run may have published a
        # receipt of it before it stopped; one that differs would be equivocation (a ban), so we
        # publish none of it and decide it on the others' receipts, as a listener does.
        self.resumed_at = -1

    async def prepare(self, round_id: int, delta: torch.Tensor, *, base_digest: str, weight: float,
                      give_up: Callable[[], bool] = lambda: False) -> Prepared:
        raise NotImplementedError

    def held_elsewhere(self, round_id: int, phase: Phase, lineage: bytes, *,
                       at_least: int | None = None) -> Callable[[], set[str]]:
        """For RoundBook.collect, in a phase whose contributions go to every member: the senders
        whose contributions other members list as held: by as many makers as `decide` needs
        (`at_least` None, `fetchable`), they count toward --min-peers; by one
        (`reached`), their makers reached other members, so at the round's cut we stop waiting
        for their push to us: what counts of them is fetched, and the rest counts nowhere, on
        every member alike."""
        return lambda: listed(self.transport.receipts(round_id, phase), lineage, at_least=at_least)

    async def exchange(self, prepared: Prepared) -> Average:
        raise NotImplementedError

    async def listen(self, round_id: int, *, base_digest: str | None) -> Average:
        """The average of a round we only listen to. With `base_digest` (the parameters at its
        start, which we hold ourselves) only contributions made from those count, whatever
        anyone claims; None (--overlap: the round started before the state we adopted) follows
        the start most senders share."""
        raise NotImplementedError

    async def replay(self, round_id: int, *, base_digest: str) -> Average | None:
        """The average of a round the swarm closed while we were away, computed ourselves from
        its contributions and receipts; None where the protocol cannot (reduce-scatter's
        members hold averaged shards only: such a node catches up by state transfer)."""
        return None

    async def listened(self, round_id: int, phase: Phase, base_digest: str | None) -> dict[str, Contribution]:
        """What the others sent of a round we only listen to, made from `base_digest` (the
        parameters we know the round started from), for the members most of them name."""
        logger.info("round %d: listening to the swarm's %s (we contribute from round %d on)",
                    round_id, phase.label, round_id + 1, extra=fields("listening", round_id=round_id, phase=phase.name.lower()))
        got = await self.transport.book.collect(round_id, phase=phase, timeout_s=self.cfg.sync_timeout_s,
                                                expected=lambda: self.transport.round_peers(round_id),
                                                min_contributors=0, voice=self.transport.voice)
        return majority_lineage(got, base_digest, self.transport.voice)

    async def agree(self, round_id: int, phase: Phase, held: dict[str, Contribution],
                    members: Callable[[], Iterable[str]], *, lineage: bytes, publish: bool) -> dict[str, Contribution]:
        """What the round's `phase` averages (neuronode.averaging.agreement): we publish our
        receipt of `held` (a listener, `publish=False`, publishes none), wait for the receipts of
        the round's `members`, keep what the receipts agree on, and fetch what they agree on that
        we lack. Returns the agreed contributions by sender."""
        me, transport = self.cfg.node_id, self.transport
        publish = publish and round_id != self.resumed_at
        ours = receipt_of(round_id, phase, me, held.values()) if publish else None
        if ours is not None:  # what our receipt lists, a member that missed it may fetch from now on
            transport.retain(round_id, phase, held.values(), for_s=RECEIPT_WAIT_TIMEOUTS * self.cfg.sync_timeout_s)
            # Our word on a round is the first receipt we published of it (a round run again after
            # a repair keeps it: a second one would be equivocation), and we decide on that word.
            ours = transport.publish_receipt(ours)
        await self.wait_for_receipts(round_id, phase, members, ours=publish)
        receipts = [*transport.receipts(round_id, phase), *([ours] if ours is not None else [])]
        if ours is None and not self.decided_by_quorum(round_id, receipts, members()):
            return {}
        decision = self.counting(round_id, decide(receipts, [statement_of(c) for c in held.values()], lineage=lineage))
        for member, proof in sorted(decision.equivocators.items()):
            logger.warning("round %d: %s signed two different %ss for one slot; leaving all of its out of "
                           "this round and banning it", round_id, member, phase.label,
                           extra=fields("equivocation", round_id=round_id, peer_id=member, phase=phase.name.lower()))
            transport.equivocated(member, proof)
        kept = {c.sender_id: c for c in held.values()
                if decision.agreed.get((c.sender_id, c.shard_index)) == statement_of(c)}
        left_out = sorted(set(held) - set(kept))
        if left_out:
            logger.warning("round %d: leaving out the %s of %s: too few other members hold it (or its maker "
                           "equivocated); every member leaves it out alike", round_id, phase.label,
                           ", ".join(left_out), extra=fields("left_out", round_id=round_id, phase=phase.name.lower(),
                                                             senders=left_out))
        have = {(c.sender_id, c.shard_index) for c in kept.values()}
        missing = [s for slot, s in decision.agreed.items() if slot not in have]
        fetched = await self.fetch_missing(round_id, missing, decision)
        agreed = kept | fetched
        self.retain(round_id, phase, agreed)
        if phase == Phase.WHOLE:  # what `keep` keeps, held only when it is fewer bytes than the round's update
            self.agreed = {r: a for r, a in self.agreed.items() if round_id - 2 <= r < round_id}
            if sum(c.data.size_bytes for c in agreed.values()) < UPDATE_BYTES_PER_ELEMENT * self.cfg.n_elements:
                self.agreed[round_id] = agreed
        return agreed

    def counting(self, round_id: int, decision: Decision) -> Decision:
        """What of a decision the round averages: all of it (gather keeps its K lowest tickets)."""
        return decision

    def decided_by_quorum(self, round_id: int, receipts: list[Receipt], members: Iterable[str]) -> bool:
        """A listener (it stood aside, or adopted the swarm's state at the round's start) averages
        only what a quorum of the round's hosts decided: the receipts it holds must come from a
        strict majority of the voices of the round's members (neuronode.quorum). Otherwise ids
        on one host, whose word made us listen, could decide alone what we average."""
        voice_of = self.transport.voice
        round_voices = voices(members, voice_of) - {voice_of(self.cfg.node_id)}
        deciding = voices((r.maker for r in receipts), voice_of) & round_voices
        if len(deciding) >= quorum(len(round_voices)):
            return True
        logger.warning("round %d: only %d of the round's %d hosts published a receipt; a listener averages "
                       "nothing a quorum of hosts did not decide", round_id, len(deciding), len(round_voices),
                       extra=fields("listener_without_quorum", round_id=round_id, hosts=len(round_voices),
                                    deciding=len(deciding)))
        return False

    async def wait_for_receipts(self, round_id: int, phase: Phase, members: Callable[[], Iterable[str]], *,
                                ours: bool = True) -> None:
        """Until every member still in the round published its receipt, the receipts' cut, or the
        deadline. The cut is the contributions' rule (neuronode.averaging.lateness): once receipts of
        a strict majority of the round's hosts are in (ours included, when `ours`: we published
        one), a grace more. A member whose receipt missed the cut or the deadline is late: no round
        waits for its receipt until one comes while we wait. Nor do we wait for a member whose
        contribution was late to this phase (its receipt counts if it comes). The grace is twice
        the contributions' (RECEIPT_WAIT_TIMEOUTS, as for the deadline): a member that waited out
        its own cut for a contribution it lacked publishes within it. Deciding without a
        receipt is safe where the receipt would not change what counts: every honest member
        lists what it holds, so a missing receipt matters only for a contribution that reached
        a bare two members (in a swarm of two or three whose links fail both ways, members may
        then decide on different sets of receipts and part; the repair rule reconciles them)."""
        book, voice_of = self.transport.book, self.transport.voice
        opened = self.clock.now()
        deadline, cut = opened + RECEIPT_WAIT_TIMEOUTS * self.cfg.sync_timeout_s, None
        while True:
            changed = book.changed()
            views = self.transport.member_views(round_id, phase, members())
            self.late_receipts -= {v.member for v in views if v.has_receipt}  # it came in time
            late = self.late_receipts | book.lateness.excused(phase)
            waiting = sorted(v.member for v in views if v.present and not v.has_receipt and not v.past_round
                             and v.member not in late)
            now = self.clock.now()
            if not waiting:
                return
            if cut is None:
                me = [self.cfg.node_id] if ours else []
                said = [*me, *(v.member for v in views if v.has_receipt)]
                if majority(said, [*me, *(v.member for v in views if v.present or v.has_receipt)], voice_of):
                    # twice a phase's grace, as for the deadline
                    grace = max(cut_grace(self.cfg.sync_timeout_s, now - opened), book.lateness.grace(round_id, phase))
                    cut = now + RECEIPT_WAIT_TIMEOUTS * grace
            end = deadline if cut is None else min(cut, deadline)
            if now >= end:
                logger.warning("round %d: no receipt from %s by the %s; deciding on the receipts we have (no "
                               "round waits for theirs again until one comes in time)", round_id, ", ".join(waiting),
                               "deadline" if end == deadline else "receipts' cut",
                               extra=fields("receipt_deadline", round_id=round_id, waiting=waiting, cut=end < deadline))
                self.late_receipts |= set(waiting)
                return
            await self.clock.wait(changed, end - now)

    async def fetch_missing(self, round_id: int, missing: list[Statement], decision: Decision) -> dict[str, Contribution]:
        """The agreed contributions we lack, each from a member that holds it, within one --sync-timeout."""
        if not missing:
            return {}
        me = self.cfg.node_id
        logger.info("round %d: fetching %d agreed contributions we missed (%s)", round_id, len(missing),
                    ", ".join(s.sender for s in missing), extra=fields("fetching", round_id=round_id,
                                                                      senders=[s.sender for s in missing]))
        results = await asyncio.gather(*(
            self.transport.fetch(s, [h for h in decision.holders[s.slot] if h != me], timeout_s=self.cfg.sync_timeout_s)
            for s in missing))
        got = {s.sender: c for s, c in zip(missing, results, strict=True) if c is not None}
        self.count_fetched(round_id, got.values())
        failed = sorted(s.sender for s, c in zip(missing, results, strict=True) if c is None)
        if failed:
            logger.warning("round %d: could not fetch the contributions of %s that other members average; this "
                           "replica may end the round apart (the repair rule reconciles it)", round_id,
                           ", ".join(failed), extra=fields("fetch_failed", round_id=round_id, senders=failed))
        return got

    def retain(self, round_id: int, phase: Phase, agreed: dict[str, Contribution]) -> None:
        """Keep serving what we average, until we retain the phase's next round (2 x
        --sync-timeout at most): to members whose receipt lacks it (they fetch it), and to a
        member that comes back one round behind and replays the round (`replay`), its own
        contribution included when it crashed after sending it. The rest of what we held for
        the round is let go."""
        self.transport.retain(round_id, phase, agreed.values(), for_s=RECEIPT_WAIT_TIMEOUTS * self.cfg.sync_timeout_s)

    def aggregator(self, got: Mapping[str, Contribution]) -> Aggregate:
        """The aggregator over `got`'s pieces with every host one member (neuronode.diloco.hosts):
        the ids of one host combined first, weighing --max-weight at most together. A host is
        the one each contribution's maker signed into it (`Contribution.host`), which every
        replica averaging these contributions reads alike, whatever host it sees a maker at
        (a member behind NAT is seen at its router by its carriers, under a carrier's host by
        the members it reaches through a relay). Every receiver that sees a maker itself checked
        that name when the contribution came in (neuronode.swarm.membership.hosts): several ids it sees at
        one host cannot name several."""
        hosts = {sender: voice(sender, c.host) for sender, c in got.items()}
        aggregate, max_weight = self.aggregate, self.cfg.max_weight
        return lambda pieces: aggregate(by_host(pieces, hosts, max_weight=max_weight))

    async def keep(self, round_id: int, average: Average, *, base_digest: str) -> None:
        """Keep what a member catching up needs of a round we applied `average` in (made from
        `base_digest`): its agreed contributions when they are fewer bytes than the update (a
        compact codec, few members), else the averaged update itself, fp32 so that it applies
        bit for bit (neuronode.swarm.streams.missed keeps a few rounds of either)."""
        agreed = self.agreed.pop(round_id, {})  # held only when fewer bytes than the update (`agree`)
        if agreed and sorted(agreed) == average.contributors:
            self.transport.keep_round(round_id, agreed.values())
            return
        encoder = VectorEncoder(codec="fp32", chunk_bytes=self.encoder.cfg.chunk_bytes, zstd_level=0, byte_shuffle=False)
        update = await asyncio.get_running_loop().run_in_executor(self.executor, lambda: encoder.encode(
            average.vector, 0.0, weight=1.0, round_id=round_id, sender_id=self.cfg.node_id, phase=Phase.UPDATE,
            base_digest=base_digest,
            contributors=tuple(average.contributors) if len(average.contributors) <= UPDATE_NAMES_AT_MOST else ()))
        update.frames = []  # its payloads are in `data` (what a holder serves); the frames would copy them
        self.transport.keep_round(round_id, [update])

    async def replay_update(self, round_id: int, holders: list[str], *, base_digest: str) -> Average | None:
        """The averaged update of a round the swarm closed while we were away, as one of
        `holders` (members that applied it from `base_digest`, the parameters we hold) applied
        it: None if none serves one. Checking that it is the swarm's is the caller's (the digests
        a quorum of hosts published after the round)."""
        update = await self.transport.fetch_update(round_id, holders, base_digest=base_digest,
                                                   timeout_s=self.cfg.sync_timeout_s)
        if update is None:
            return None
        self.count_fetched(round_id, [update])
        vector = await asyncio.get_running_loop().run_in_executor(self.executor, update.data.decode)
        return Average(vector=vector, contributors=sorted(update.contributors), fewest=len(update.contributors))

    def count_fetched(self, round_id: int, got: Iterable[Contribution]) -> None:
        """Add what we fetched of `round_id` (payload bytes, before zstd) to `fetched` (a few rounds kept)."""
        self.fetched = {r: n for r, n in self.fetched.items() if r > round_id - 8}
        self.fetched[round_id] = self.fetched.get(round_id, 0) + sum(c.data.size_bytes for c in got)

    def nothing_heard(self, round_id: int) -> Average:
        logger.warning("round %d: heard no contribution; our outer step uses a zero average", round_id,
                       extra=fields("zero_average", round_id=round_id))
        return Average(vector=torch.zeros(self.cfg.n_elements), contributors=[], fewest=0)


def elapsed(since: float) -> float:
    return time.perf_counter() - since
