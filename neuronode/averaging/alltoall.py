"""All-to-all averaging: every node sends its whole contribution to every peer of the round and
averages all of them (in sorted node-id order) itself; each node sends (N - 1) contributions.
Which ones the round averages is agreed from the members' receipts (neuronode.averaging.agreement):
a contribution that reached only some members is fetched by the others, or left out by all."""

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
from neuronode.codec import Contribution, Phase
from neuronode.events import fields

logger = logging.getLogger(__name__)


class AllToAll(Averaging):
    async def prepare(self, round_id: int, delta: torch.Tensor, *, base_digest: str, weight: float,
                      give_up: Callable[[], bool] = lambda: False) -> Prepared:
        started = time.perf_counter()
        # This encoding goes to every peer: it leaves at the upload rate / fan-out.
        link = self.transport.link_rate() / max(1, len(self.transport.alive()))
        enc = await asyncio.get_running_loop().run_in_executor(self.encoder_pool, lambda: self.encoder.contribution(
            delta, [(0, delta.numel())], link, weight=weight, round_id=round_id, base_digest=base_digest,
            host=self.transport.own_host()))
        return Prepared(round_id=round_id, parts=enc.parts, compensated=enc.compensated,
                        encode_s=elapsed(started))

    async def exchange(self, prepared: Prepared) -> Average:
        (own,) = prepared.parts
        round_id, book = own.round_id, self.transport.book
        started = time.perf_counter()
        book.add_own(own)
        logger.info("round %d: %s ready, sending to %d peers", round_id, own.phase.label,
                    len(self.transport.alive()), extra=fields("contribution_ready", round_id=round_id, phase=own.phase.name.lower(),
                                 peers=len(self.transport.alive())))
        sending = self.transport.send(round_id, Phase.WHOLE, own)
        lineage = lineage_hash(*own.lineage)
        got = await book.collect(
            round_id, phase=Phase.WHOLE, expected=lambda: self.transport.round_peers(round_id) | {self.cfg.node_id},
            timeout_s=self.cfg.sync_timeout_s, min_contributors=self.cfg.min_contributors,
            on_extend=sending.extend, moved_past=lambda: self.transport.moved_past(round_id), fetchable=self.held_elsewhere(round_id, Phase.WHOLE, lineage),
            reached=self.held_elsewhere(round_id, Phase.WHOLE, lineage, at_least=1), voice=self.transport.voice)
        got = same_lineage(got, own.lineage)
        # The round's members as it closed: one that appears later (a joiner, a ghost) has no receipt to wait for.
        members = self.transport.round_peers(round_id) | set(got)
        got = await self.agree(round_id, Phase.WHOLE, got, lambda: members, lineage=lineage, publish=True)
        waited = elapsed(started)
        if not got:  # not even ours counts (it reached too few members): no update, as for everyone
            return replace(self.nothing_heard(round_id), encode_s=prepared.encode_s, exchange_s=waited, sent=[own])
        started = time.perf_counter()
        vector = await self.mean(got)
        return Average(vector=vector, contributors=sorted(got), fewest=len(got), encode_s=prepared.encode_s,
                       exchange_s=waited, average_s=elapsed(started), sent=[own], weights=weights(got))

    async def listen(self, round_id: int, *, base_digest: str | None) -> Average:
        """The others' contributions to a round we only listen to, averaged."""
        got = await self.listened(round_id, Phase.WHOLE, base_digest)
        if not got:
            # Nobody pushed it to us (we adopted the state its members started from after they
            # closed it): what they averaged, from their receipts and the holders.
            replayed = await self.replay(round_id, base_digest=base_digest) if base_digest is not None else None
            return replayed if replayed is not None and replayed.contributors else self.nothing_heard(round_id)
        members = self.transport.round_peers(round_id) | set(got)
        got = await self.agree(round_id, Phase.WHOLE, got, lambda: members,
                               lineage=lineage_hash(*next(iter(got.values())).lineage), publish=False)
        if not got:
            return self.nothing_heard(round_id)
        return Average(vector=await self.mean(got), contributors=sorted(got), fewest=len(got), weights=weights(got))

    async def replay(self, round_id: int, *, base_digest: str) -> Average | None:
        """A round the swarm closed while we were away (one round behind): its contributions as
        the members' receipts decided them, fetched from holders (each checked against its
        maker's signed statement) and averaged as every member did. The members alive now stand
        for the round's: a quorum of their hosts must have published receipts of it."""
        got = await self.agree(round_id, Phase.WHOLE, {}, lambda: self.transport.alive(),
                               lineage=lineage_hash(base_digest, ()), publish=False)
        if not got:
            return Average(vector=torch.zeros(self.cfg.n_elements), contributors=[], fewest=0)
        return Average(vector=await self.mean(got), contributors=sorted(got), fewest=len(got), weights=weights(got))

    async def mean(self, got: dict[str, Contribution]) -> torch.Tensor:
        """The aggregator over the round's contributions, a host's ids as one member, in sorted
        order (decoded lazily)."""
        pieces = {sender: (c.data, c.weight) for sender, c in got.items()}
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.aggregator(got), pieces)


def weights(got: dict[str, Contribution]) -> dict[str, float]:
    return {sender: got[sender].weight for sender in sorted(got)}
