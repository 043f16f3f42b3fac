"""Reduce-scatter averaging (docs/protocol.md): member i averages everyone's shard i and sends the
averaged shard to all, so each node sends about 2 x one contribution whatever the swarm size.

Round r: the members are the sorted ids of the round's peers and us, fixed when our inner steps
end (`prepare`); the reducers are the members peers can dial (all of them, unless some are
behind NAT), and the vector is cut into one block-aligned shard per reducer. Each member sends
shard j to reducer j (scatter); each reducer reduces the slices of its own shard (sorted by node
id) and sends the averaged shard to every member and to the round's listeners (gather; over
their sessions to members nobody can dial). Every member publishes a receipt of
the averaged shards it received, and applies the shards the receipts agree on
(neuronode.averaging.agreement), fetching those it missed from members that hold them, so a
reducer dying mid-send, or sending to some members only, leaves no replica apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

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
        senders, reducers = await self.members(round_id, give_up=give_up)
        ranges = shard_ranges(self.cfg.n_elements, max(1, len(reducers)), self.cfg.codec)
        started = time.perf_counter()
        enc = await asyncio.get_running_loop().run_in_executor(self.encoder_pool, lambda: self.encoder.contribution(
            delta, ranges, self.transport.link_rate(), weight=weight, round_id=round_id, phase=Phase.SHARD,
            base_digest=base_digest, members=reducers, host=self.transport.own_host()))
        return Prepared(round_id=round_id, parts=enc.parts, compensated=enc.compensated, members=reducers,
                        senders=senders, ranges=ranges, encode_s=elapsed(started))

    async def members(self, round_id: int, *, give_up: Callable[[], bool]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The round's peers and us, sorted, once there are at least --min-peers of them and one
        of them peers can dial (or `give_up()` says stop waiting); and those peers can dial, the
        reducers (a member nobody can dial sends its slices and hears the averaged shards over
        its sessions)."""
        book, said = self.transport.book, ""
        while True:
            changed = book.changed()
            members = self.transport.round_peers(round_id) | {self.cfg.node_id}
            reducers = self.transport.reducers(members) or ({self.cfg.node_id} if members == {self.cfg.node_id} else set())
            if (len(members) >= self.cfg.min_contributors and reducers) or give_up():
                return tuple(sorted(members)), tuple(sorted(reducers))
            if len(members) < self.cfg.min_contributors and said != "members":
                said = "members"
                logger.warning("round %d: %d of --min-peers %d members; waiting for more", round_id,
                               len(members), self.cfg.min_contributors,
                               extra=fields("waiting_for_members", round_id=round_id))
            elif len(members) >= self.cfg.min_contributors and not reducers and said != "reducers":
                said = "reducers"
                logger.warning("round %d: no member of the round can be dialed by the others (all are behind NAT, "
                               "or still learning their address), and reduce-scatter needs one to reduce; waiting. "
                               "Forward a port to one member (docs/volunteer.md)", round_id,
                               extra=fields("waiting_for_reducers", round_id=round_id))
            await self.clock.wait(changed, MEMBERS_POLL_S)

    async def exchange(self, prepared: Prepared) -> Average:
        round_id, reducers, me = prepared.round_id, prepared.members, self.cfg.node_id
        senders = prepared.senders or reducers
        if not reducers:  # we gave up waiting for one: nobody could reduce anything
            return replace(self.nothing_heard(round_id), encode_s=prepared.encode_s, sent=[])
        base_digest = prepared.parts[0].base_digest
        started = time.perf_counter()
        reduce_s = 0.0
        if me in reducers:
            index = reducers.index(me)
            own = prepared.parts[index]
            outs = {m: prepared.parts[j] for j, m in enumerate(reducers) if m != me}
            pieces = await self.phase(own, outs, to=reducers, expect=senders)
            scatter_s = elapsed(started)
            started = time.perf_counter()
            reduced = await asyncio.get_running_loop().run_in_executor(self.encoder_pool, lambda: self.encoder.reduce(
                self.aggregator(pieces), pieces, self.transport.link_rate(), round_id=round_id,
                n_elements=self.cfg.n_elements, base_digest=base_digest, members=reducers, shard_index=index,
                host=own.host))
            reduce_s = elapsed(started)
            started = time.perf_counter()
            gathered = await self.phase(reduced, reduced, to=senders, expect=reducers)
            sent = [*prepared.parts, reduced]
        else:  # peers cannot dial us: our slices go to the reducers, their averages come over our sessions
            gathered = await self.hear(prepared, reducers)
            scatter_s, sent = 0.0, list(prepared.parts)
        averaged = await self.agree(round_id, Phase.AVERAGED, gathered, lambda: senders,
                                    lineage=lineage_hash(base_digest, reducers), publish=True)
        skipped = sorted(c.shard_index for sender, c in gathered.items() if sender not in averaged)
        if skipped:
            logger.warning("round %d: shards %s reached too few members; no update for them this round, on every "
                           "member alike", round_id, skipped, extra=fields("shards_skipped", round_id=round_id, shards=skipped))
        gather_s = elapsed(started)
        started = time.perf_counter()
        vector, contributors = await self.assemble(averaged, reducers, prepared.ranges, round_id)
        complete = len(averaged) == len(reducers)  # a missing shard is zeros: no full average there
        fewest = min(len(c.contributors) for c in averaged.values()) if complete else 0
        return Average(vector=vector, contributors=contributors, fewest=fewest, encode_s=prepared.encode_s,
                       exchange_s=scatter_s + gather_s, average_s=reduce_s + elapsed(started), sent=sent)

    async def phase(self, own: Contribution, outs: Contribution | dict[str, Contribution], *,
                    to: tuple[str, ...], expect: tuple[str, ...]) -> dict[str, Contribution]:
        """One phase of a reducer (scatter or gather): send to `to`, then collect from the
        members of `expect` still alive."""
        book, round_id, me = self.transport.book, own.round_id, self.cfg.node_id
        book.add_own(own)
        logger.info("round %d: %s ready, sending to %d peers", round_id, own.phase.label, len(set(to) - {me}),
                    extra=fields("contribution_ready", round_id=round_id, phase=own.phase.name.lower(),
                                 peers=len(set(to) - {me})))
        sending = self.transport.send(round_id, own.phase, outs, members=to)
        gather = own.phase == Phase.AVERAGED  # the averaged shards go to every member: others hold what we miss
        got = await book.collect(
            round_id, phase=own.phase, expected=lambda: ((set(expect) - {me}) & self.transport.alive()) | {me},
            timeout_s=self.cfg.sync_timeout_s, min_contributors=1, on_extend=sending.extend,
            fetchable=self.held_elsewhere(round_id, own.phase, lineage_hash(*own.lineage)) if gather else set,
            voice=self.transport.voice)
        return same_lineage(got, own.lineage)

    async def hear(self, prepared: Prepared, reducers: tuple[str, ...]) -> dict[str, Contribution]:
        """A member peers cannot dial: send our slices to the reducers, collect their averaged
        shards (they come over the sessions we hold)."""
        round_id = prepared.round_id
        outs = {m: prepared.parts[j] for j, m in enumerate(reducers)}
        logger.info("round %d: slices ready, sending to %d reducers", round_id, len(outs),
                    extra=fields("contribution_ready", round_id=round_id, phase="shard", peers=len(outs)))
        sending = self.transport.send(round_id, Phase.SHARD, outs, members=reducers)
        got = await self.transport.book.collect(
            round_id, phase=Phase.AVERAGED, expected=lambda: set(reducers) & self.transport.alive(),
            timeout_s=self.cfg.sync_timeout_s, min_contributors=0, on_extend=sending.extend,
            fetchable=self.held_elsewhere(round_id, Phase.AVERAGED, lineage_hash(prepared.parts[0].base_digest, reducers)),
            voice=self.transport.voice)
        return same_lineage(got, prepared.parts[0].lineage)

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
