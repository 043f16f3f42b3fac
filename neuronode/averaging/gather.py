"""Gather averaging (`--averaging gather`): every member trains every round, and a round averages
the whole contributions of at most K makers (`--gather-makers`), spread down a tree by
forwarding, so what one member sends, receives and computes per round stays flat as the swarm
grows (docs/protocol.md, "Gather"; neuronode.averaging.sortition says who makes and who forwards).

Round r at a member:
- `prepare`: the round's makers are the K lowest tickets of the members it knows (seeded by the
  parameters the round starts from). A maker encodes its pseudo-gradient with the rounds it
  carried; any other member carries this round's into its error feedback
  (ContributionEncoder.carry) and encodes nothing.
- `exchange`: a maker sends its contribution to its children in its own tree; every member's
  transport forwards what it receives to its children in the maker's tree (the transports call
  `sortition.Draw.children`). Each member collects the makers' contributions (the round book's
  rules: every maker, or the cut once a majority of the makers' hosts delivered), then the
  makers publish receipts and every member decides from them what counts (the agreement's
  two-listing rule, neuronode.averaging.agreement), keeps the K lowest tickets of that
  (`sortition.lowest`), fetches what counts that it lacks, and averages it with the swarm's
  aggregator in sorted sender order, as all-to-all does: every replica ends on one digest.

With at most K members (the live members we know, us included) every member is a maker: the
round runs all-to-all's code (`everyone`), which is what a swarm of 2-30 members averaged
before gather was the default, --min-peers, catching up and replaying included. Of what its
receipts agree on, the K lowest tickets still count (`counting`), so a member whose view of the
swarm's size differs from ours ends on the same vector.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import replace

import torch

from neuronode.averaging.agreement import Decision, lineage_hash
from neuronode.averaging.alltoall import AllToAll, weights
from neuronode.averaging.book import majority_lineage, same_lineage
from neuronode.averaging.protocol import Average, AveragingConfig, Prepared, elapsed
from neuronode.averaging.sortition import Draw, Draws, lowest, round_seed
from neuronode.averaging.transport import Transport
from neuronode.clock import Clock
from neuronode.codec import Contribution, ContributionEncoder, Phase
from neuronode.codec.contribution import Aggregate
from neuronode.events import fields

logger = logging.getLogger(__name__)

MEMBERS_POLL_S = 0.5  # how often the wait for --min-peers members looks again without news


class Gather(AllToAll):
    """The gather protocol (module docstring): all-to-all's agreement and average over the
    round's makers only."""

    def __init__(self, cfg: AveragingConfig, *, transport: Transport, encoder: ContributionEncoder,
                 encoder_pool: Executor, aggregate: Aggregate, executor: Executor, clock: Clock | None = None) -> None:
        super().__init__(cfg, transport=transport, encoder=encoder, encoder_pool=encoder_pool, aggregate=aggregate,
                         executor=executor, clock=clock)
        self.draws = Draws(cfg.makers)
        self.seeds: dict[int, str] = {}  # round -> its seed, for `counting`

    def draw(self, round_id: int, base_digest: str, *, with_us: bool = True) -> Draw:
        """The round's draw over the members we know (and us, when we are one of them)."""
        self.seeds[round_id] = round_seed(round_id, base_digest)
        for old in [r for r in self.seeds if r < round_id - 4]:
            del self.seeds[old]
        me = {self.cfg.node_id} if with_us else set()
        return self.draws.get(round_id, base_digest, lambda: self.transport.round_peers(round_id) | me)

    def everyone(self) -> bool:
        """Every member we know (the live ones and us) is a maker: at most K of them."""
        return len(self.transport.alive()) + 1 <= self.cfg.makers

    async def prepare(self, round_id: int, delta: torch.Tensor, *, base_digest: str, weight: float,
                      give_up: Callable[[], bool] = lambda: False) -> Prepared:
        if self.cfg.min_contributors > self.cfg.makers:  # the draw is made from --min-peers members at least
            await self.enough_members(round_id, give_up)
        if self.everyone():
            self.draw(round_id, base_digest)  # the round's seed, for `counting`
            return await super().prepare(round_id, delta, base_digest=base_digest, weight=weight, give_up=give_up)
        started = time.perf_counter()
        makers = self.draw(round_id, base_digest).makers
        loop = asyncio.get_running_loop()
        if self.cfg.node_id not in makers:  # ours goes with a later round of ours
            await loop.run_in_executor(self.encoder_pool, self.encoder.carry, delta)
            return Prepared(round_id=round_id, parts=[], compensated=delta, members=makers, base_digest=base_digest,
                            encode_s=elapsed(started))
        # It leaves at the upload rate / our tree's fan-out.
        link = self.transport.link_rate() / max(1, min(self.cfg.makers, len(self.transport.alive())))
        enc = await loop.run_in_executor(self.encoder_pool, lambda: self.encoder.contribution(
            delta, [(0, delta.numel())], link, weight=weight, round_id=round_id, base_digest=base_digest,
            host=self.transport.own_host()))
        return Prepared(round_id=round_id, parts=enc.parts, compensated=enc.compensated, members=makers,
                        base_digest=base_digest, encode_s=elapsed(started))

    async def enough_members(self, round_id: int, give_up: Callable[[], bool]) -> None:
        """The round is drawn from the members we know: with --min-peers above K, wait until we
        know --min-peers of them (us included), or `give_up()`, so that members starting
        together draw from one view (at most K: all-to-all waits in the round, as it always did)."""
        said = False
        while not give_up():
            changed = self.transport.book.changed()
            known = len(self.transport.round_peers(round_id)) + 1
            if known >= self.cfg.min_contributors:
                return
            if not said:
                said = True
                logger.warning("round %d: %d of --min-peers %d members; waiting for more before drawing the "
                               "round's makers", round_id, known, self.cfg.min_contributors,
                               extra=fields("waiting_for_members", round_id=round_id))
            await self.clock.wait(changed, MEMBERS_POLL_S)

    async def exchange(self, prepared: Prepared) -> Average:
        if not prepared.members:  # prepared by all-to-all (`everyone`)
            return await super().exchange(prepared)
        round_id, makers, me = prepared.round_id, set(prepared.members), self.cfg.node_id
        book, base = self.transport.book, prepared.base_digest
        started = time.perf_counter()
        own = prepared.parts[0] if prepared.parts else None
        on_extend = None
        if own is not None:
            book.add_own(own)
            children = self.draw(round_id, base).children(me, me, self.cfg.makers)
            logger.info("round %d: %s ready, sending to %d members (one of %d makers)", round_id, own.phase.label,
                        len(children), len(makers), extra=fields("contribution_ready", round_id=round_id,
                                                                phase=own.phase.name.lower(), peers=len(children)))
            # (members=(): every live peer; (me,): nobody, when we know no other member)
            on_extend = self.transport.send(round_id, Phase.WHOLE, own, members=tuple(children) or (me,)).extend
        lineage = lineage_hash(base, ())
        got = await book.collect(
            round_id, phase=Phase.WHOLE, expected=lambda: self.present(round_id, makers),
            timeout_s=self.cfg.sync_timeout_s, min_contributors=min(self.cfg.min_contributors, len(makers)),
            on_extend=on_extend, fetchable=self.held_elsewhere(round_id, Phase.WHOLE, lineage),
            reached=self.held_elsewhere(round_id, Phase.WHOLE, lineage, at_least=1), voice=self.transport.voice)
        got = same_lineage(got, (base, ()))
        got = await self.agree(round_id, Phase.WHOLE, got, lambda: makers | set(got) | self.receipted(round_id),
                               lineage=lineage, publish=own is not None)
        waited = elapsed(started)
        sent = [own] if own is not None else []
        if not got:
            return replace(self.nothing_heard(round_id), encode_s=prepared.encode_s, exchange_s=waited, sent=sent)
        started = time.perf_counter()
        vector = await self.mean(got)
        return Average(vector=vector, contributors=sorted(got), fewest=len(got), encode_s=prepared.encode_s,
                       exchange_s=waited, average_s=elapsed(started), sent=sent, weights=weights(got))

    def present(self, round_id: int, makers: set[str]) -> set[str]:
        """The makers we wait for: live ones (and us)."""
        views = self.transport.member_views(round_id, Phase.WHOLE, makers)
        return {v.member for v in views if v.present} | (makers & {self.cfg.node_id})

    def counting(self, round_id: int, decision: Decision) -> Decision:
        """Of what the receipts agree on, the K lowest tickets (sortition.lowest): the same ones
        at every replica, whatever its view of the swarm."""
        seed = self.seeds.get(round_id)
        if seed is None or len(decision.agreed) <= self.cfg.makers:
            return decision
        keep = lowest({sender for sender, _ in decision.agreed}, seed, self.cfg.makers)
        dropped = sorted({sender for sender, _ in decision.agreed} - keep)
        logger.info("round %d: %d agreed contributions, averaging the %d lowest tickets (not %s)", round_id,
                    len(decision.agreed), self.cfg.makers, ", ".join(dropped),
                    extra=fields("beyond_makers", round_id=round_id, senders=dropped))
        return replace(decision, agreed={slot: s for slot, s in decision.agreed.items() if slot[0] in keep})

    async def listen(self, round_id: int, *, base_digest: str | None) -> Average:
        """A round we only listen to: we are in nobody's tree, so we wait for the makers' receipts
        and fetch what they decided (as `replay`). Without `base_digest` (--overlap, we adopted a
        state after the round began) we follow the start most of what reached us shares."""
        if self.everyone():
            if base_digest is not None:
                self.draw(round_id, base_digest, with_us=False)
            return await super().listen(round_id, base_digest=base_digest)
        if base_digest is None:  # what reached us already (we are in no tree of the round)
            heard = await self.transport.book.collect(round_id, phase=Phase.WHOLE, expected=set, timeout_s=0.0,
                                                      min_contributors=0, voice=self.transport.voice)
            heard = majority_lineage(heard, None, self.transport.voice)
            if not heard:
                return self.nothing_heard(round_id)
            base_digest = next(iter(heard.values())).base_digest
        got = await self.decided(round_id, base_digest, with_us=False)
        if not got:
            return self.nothing_heard(round_id)
        return Average(vector=await self.mean(got), contributors=sorted(got), fewest=len(got), weights=weights(got))

    async def replay(self, round_id: int, *, base_digest: str) -> Average | None:
        if self.everyone():
            self.draw(round_id, base_digest)
            return await super().replay(round_id, base_digest=base_digest)
        got = await self.decided(round_id, base_digest, with_us=True)
        if not got:
            return Average(vector=torch.zeros(self.cfg.n_elements), contributors=[], fewest=0)
        return Average(vector=await self.mean(got), contributors=sorted(got), fewest=len(got), weights=weights(got))

    async def decided(self, round_id: int, base_digest: str, *, with_us: bool) -> dict[str, Contribution]:
        """What the makers' receipts decided for a round we hold nothing of, fetched from holders
        (each checked against its maker's signed statement): a quorum of the makers' hosts must
        have published receipts."""
        makers = set(self.draw(round_id, base_digest, with_us=with_us).makers)
        return await self.agree(round_id, Phase.WHOLE, {}, lambda: makers | self.receipted(round_id),
                                lineage=lineage_hash(base_digest, ()), publish=False)

    def receipted(self, round_id: int) -> set[str]:
        """Members that published a receipt of the round: makers in their own view. Counted among
        the round's members, so that a member whose view of the makers differs (it fell behind,
        or knows other members) still finds the quorum of hosts whose receipts decided."""
        return {r.maker for r in self.transport.receipts(round_id, Phase.WHOLE)}
