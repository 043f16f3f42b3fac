"""Reduce-scatter averaging (docs/protocol.md): member i averages everyone's shard i and sends the
averaged shard to all, so each node sends about 2 x one contribution whatever the swarm size.

Round r: the members are the sorted ids of the round's peers and us, fixed when our inner steps
end (`prepare`); the vector is cut into one block-aligned shard per member. Each member sends
shard j to member j (scatter), reduces the slices of its own shard (sorted by node id), sends
the averaged shard to every member and to the round's listeners (gather), publishes a receipt of
the averaged shards it received, and applies the shards the receipts agree on
(neuronode.averaging.agreement), fetching those it missed from members that hold them, so a
reducer dying mid-send, or sending to some members only, leaves no replica apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from neuronode.averaging.agreement import lineage_hash
from neuronode.averaging.book import same_lineage
from neuronode.averaging.protocol import Average, Averaging, Prepared, elapsed
from neuronode.codec import Contribution, Phase, shard_ranges
from neuronode.events import fields
from neuronode.memory import empty_floats

logger = logging.getLogger(__name__)

MEMBERS_POLL_S = 0.5  # how often the wait for --min-peers members looks again without news


def assemble(averaged: dict[str, Contribution], members: tuple[str, ...], ranges: list[tuple[int, int]],
             n_elements: int, round_id: int) -> tuple[torch.Tensor, list[str]]:
    """Concatenate the averaged shards. A shard missing here (its reducer is gone, or too few
    members received it) gets no update this round (zeros), on every member alike."""
    avg = empty_floats(n_elements)
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
                       round_id, ", ".join(missing), extra=fields("shard_missing", round_id=round_id, reducers=missing))
    return avg, sorted(contributors)


class ReduceScatter(Averaging):
    async def prepare(self, round_id: int, delta: torch.Tensor, *, base_digest: str, weight: float,
                      give_up: Callable[[], bool] = lambda: False) -> Prepared:
        members = await self.members(round_id, give_up=give_up)
        ranges = shard_ranges(self.cfg.n_elements, len(members), self.cfg.codec)
        started = time.perf_counter()
        enc = await asyncio.get_running_loop().run_in_executor(self.encoder_pool, lambda: self.encoder.contribution(
            delta, ranges, self.transport.link_rate(), weight=weight, round_id=round_id, phase=Phase.SHARD,
            base_digest=base_digest, members=members))
        return Prepared(round_id=round_id, parts=enc.parts, compensated=enc.compensated, members=members,
                        ranges=ranges, encode_s=elapsed(started))

    async def members(self, round_id: int, *, give_up: Callable[[], bool]) -> tuple[str, ...]:
        """The round's peers and us, sorted, once there are at least --min-peers of them (or
        `give_up()` says stop waiting)."""
        book, said = self.transport.book, False
        while True:
            changed = book.changed()
            members = self.transport.round_peers(round_id) | {self.cfg.node_id}
            if len(members) >= self.cfg.min_contributors or give_up():
                return tuple(sorted(members))
            if not said:
                logger.warning("round %d: %d of --min-peers %d members; waiting for more", round_id,
                               len(members), self.cfg.min_contributors,
                               extra=fields("waiting_for_members", round_id=round_id))
                said = True
            await self.clock.wait(changed, MEMBERS_POLL_S)

    async def exchange(self, prepared: Prepared) -> Average:
        round_id, members, me = prepared.round_id, prepared.members, self.cfg.node_id
        index = members.index(me)
        own = prepared.parts[index]
        started = time.perf_counter()
        outs = {m: prepared.parts[j] for j, m in enumerate(members) if m != me}
        pieces = await self.phase(own, outs, members)
        scatter_s = elapsed(started)
        started = time.perf_counter()
        reduced = await asyncio.get_running_loop().run_in_executor(self.encoder_pool, lambda: self.encoder.reduce(
            self.aggregate, pieces, self.transport.link_rate(), round_id=round_id, n_elements=self.cfg.n_elements,
            base_digest=own.base_digest, members=members, shard_index=index))
        reduce_s = elapsed(started)
        started = time.perf_counter()
        gathered = await self.phase(reduced, reduced, members)
        averaged = await self.agree(round_id, Phase.AVERAGED, gathered, lambda: members,
                                    lineage=lineage_hash(own.base_digest, members), publish=True)
        skipped = sorted(c.shard_index for sender, c in gathered.items() if sender not in averaged)
        if skipped:
            logger.warning("round %d: shards %s reached too few members; no update for them this round, on every "
                           "member alike", round_id, skipped, extra=fields("shards_skipped", round_id=round_id, shards=skipped))
        gather_s = elapsed(started)
        started = time.perf_counter()
        vector, contributors = await self.assemble(averaged, members, prepared.ranges, round_id)
        complete = len(averaged) == len(members)  # a missing shard is zeros: no full average there
        fewest = min(len(c.contributors) for c in averaged.values()) if complete else 0
        return Average(vector=vector, contributors=contributors, fewest=fewest, encode_s=prepared.encode_s,
                       exchange_s=scatter_s + gather_s, average_s=reduce_s + elapsed(started),
                       sent=[*prepared.parts, reduced])

    async def phase(self, own: Contribution, outs: Contribution | dict[str, Contribution],
                    members: tuple[str, ...]) -> dict[str, Contribution]:
        """One phase (scatter or gather): send, then collect from the members still alive."""
        book, round_id, me = self.transport.book, own.round_id, self.cfg.node_id
        book.add_own(own)
        targets = set(members) - {me}
        logger.info("round %d: %s ready, sending to %d peers", round_id, own.phase.label, len(targets),
                    extra=fields("contribution_ready", round_id=round_id, phase=own.phase.name.lower(), peers=len(targets)))
        sending = self.transport.send(round_id, own.phase, outs, members=members)
        got = await book.collect(
            round_id, phase=own.phase, expected=lambda: (targets & self.transport.alive()) | {me},
            timeout_s=self.cfg.sync_timeout_s, min_contributors=1, on_extend=sending.extend)
        return same_lineage(got, own.lineage)

    async def listen(self, round_id: int, *, base_digest: str | None) -> Average:
        """The averaged shards of a round we only listen to (reducers send them to listeners)."""
        got = await self.listened(round_id, Phase.AVERAGED, base_digest)
        if not got:
            return self.nothing_heard(round_id)
        first = next(iter(got.values()))
        members = first.members
        got = await self.agree(round_id, Phase.AVERAGED, got, lambda: members,
                               lineage=lineage_hash(first.base_digest, members), publish=False)
        ranges = shard_ranges(self.cfg.n_elements, len(members), self.cfg.codec)
        vector, contributors = await self.assemble(got, members, ranges, round_id)
        return Average(vector=vector, contributors=contributors, fewest=len(contributors))

    async def assemble(self, averaged: dict[str, Contribution], members: tuple[str, ...],
                       ranges: list[tuple[int, int]], round_id: int) -> tuple[torch.Tensor, list[str]]:
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, assemble, averaged, members, ranges, self.cfg.n_elements, round_id)
