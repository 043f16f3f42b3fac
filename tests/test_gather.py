"""Gather averaging (neuronode.averaging.gather, .sortition) over the in-process transport on a
ManualClock: a round averages the K makers' contributions, spread down each maker's tree by
forwarding; the others carry theirs in error feedback. Every replica ends on one vector; a
forwarder that drops, a maker that equivocates or a member that sends without being drawn
changes nothing."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from neuronode.averaging import AllToAll, Average, AveragingConfig, Gather, RoundState
from neuronode.averaging.local import LocalSwarm
from neuronode.averaging.sortition import draw, lowest, round_seed
from neuronode.clock import ManualClock
from neuronode.codec import ContributionEncoder, EncoderConfig, Phase, VectorEncoder
from neuronode.diloco import average

pytestmark = pytest.mark.timeout(30)

N = 2000
TIMEOUT_S = 60.0
BASE = "d0"


@pytest.fixture
def pools() -> Iterator[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]:
    encode, codec = ThreadPoolExecutor(1), ThreadPoolExecutor(2)
    yield encode, codec
    encode.shutdown()
    codec.shutdown()


def delta(name: str, round_id: int) -> torch.Tensor:
    seed = sum(map(ord, name)) * 100 + round_id
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)) * 1e-2


class Swarm:
    """Members of one LocalSwarm running `kind` (gather with K makers), on one ManualClock."""

    def __init__(self, pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor], names: list[str], *, k: int,
                 kind: type[AllToAll] = Gather) -> None:
        self.clock = ManualClock()
        self.local = LocalSwarm(clock=self.clock, gather_makers=k if kind is Gather else 0)
        self.k, self.names = k, names
        self.protocols: dict[str, AllToAll] = {}
        self.encoders: dict[str, ContributionEncoder] = {}
        for name in names:
            transport = self.local.join(name, state=RoundState())
            encoder = self.encoders[name] = ContributionEncoder(
                EncoderConfig(codec="fp32", chunk_bytes=4096, zstd_level=0, byte_shuffle=False),
                n_elements=N, sender_id=name)
            self.protocols[name] = kind(
                AveragingConfig(node_id=name, codec="fp32", n_elements=N, sync_timeout_s=TIMEOUT_S, makers=k),
                transport=transport, encoder=encoder, encoder_pool=pools[0], aggregate=average,
                executor=pools[1], clock=self.clock)

    async def drive(self, running: asyncio.Future[list[Average]]) -> None:
        """Let `running` work; once every member waits on the clock (nothing moved for a few
        polls), move the clock one second, as a cut or deadline would come."""
        seen, still = None, 0
        while not running.done():
            await asyncio.sleep(0.005)
            now = (self.clock.waiting, sum(m.delivered for m in self.local.members.values()), self.local.fetches)
            still = still + 1 if now == seen else 0
            seen = now
            if still >= 4 and self.clock.waiting:
                self.clock.advance(1.0)
                still = 0

    def makers(self, round_id: int) -> list[str]:
        return sorted(draw(round_id, BASE, self.names, self.k).makers)

    async def round(self, round_id: int, names: list[str] | None = None) -> dict[str, Average]:
        names = self.names if names is None else names
        prepared = await asyncio.gather(*(self.protocols[n].prepare(round_id, delta(n, round_id), base_digest=BASE,
                                                                    weight=1.0) for n in names))
        running = asyncio.gather(*(self.protocols[n].exchange(p) for n, p in zip(names, prepared, strict=True)))
        await self.drive(running)
        results = running.result()
        for m in self.local.members.values():
            m.state.round = round_id + 1
        return dict(zip(names, results, strict=True))


def same(results: dict[str, Average]) -> Average:
    first = next(iter(results.values()))
    for name, r in results.items():
        assert r.contributors == first.contributors, name
        assert torch.equal(r.vector, first.vector), name
    return first


def names(n: int) -> list[str]:
    return [f"m{i:02d}" for i in range(n)]


def test_every_member_gets_each_makers_contribution_once_and_forwards_about_k() -> None:
    """The trees of sortition: at N = 100 and K = 8 every member receives each maker's
    contribution exactly once, and sends at most 2K copies a round (a maker's own K, and about
    K for the one tree it forwards in); the draw follows the seed, and `lowest` keeps K."""
    members = names(100)
    d = draw(5, BASE, members, 8)
    up: collections.Counter[str] = collections.Counter()
    for maker in d.makers:
        reached, frontier = {maker}, [maker]
        while frontier:
            children = [c for x in frontier for c in d.children(maker, x, 8)]
            for x in frontier:
                up[x] += len(d.children(maker, x, 8))
            assert not reached & set(children) and len(set(children)) == len(children), maker
            reached |= set(children)
            frontier = children
        assert reached == set(members), maker
    assert max(up.values()) <= 16 and sorted(up.values())[50] == 8
    assert draw(6, BASE, members, 8).makers != d.makers  # another round, other makers
    assert lowest(members, round_seed(5, BASE), 8) == set(d.makers)


async def test_a_round_averages_the_k_makers_bit_identically_and_the_others_carry(pools) -> None:  # noqa: ANN001
    """10 members, K = 4: every member ends on one vector averaging the round's 4 makers; the
    others carried theirs, and a member that carried one round sends the mean of both."""
    swarm = Swarm(pools, names(10), k=4)
    first = same(await swarm.round(0))
    makers = swarm.makers(0)
    assert first.contributors == makers
    expected = average({m: (delta(m, 0), 1.0) for m in makers})
    assert torch.equal(first.vector, expected)
    assert all(swarm.encoders[n].carried_rounds == (0.0 if n in makers else 1.0) for n in swarm.names)
    second = same(await swarm.round(1))
    assert second.contributors == swarm.makers(1)
    sent = {m: delta(m, 1) if m in makers else torch.add(delta(m, 1), delta(m, 0)) / 2.0 for m in swarm.makers(1)}
    assert torch.equal(second.vector, average({m: (v, 1.0) for m, v in sent.items()}))
    assert swarm.local.fetches == 0  # the trees reached everyone


async def test_with_at_most_k_members_gather_averages_what_all_to_all_does(pools) -> None:  # noqa: ANN001
    """5 members, K = 8: everyone is a maker and each tree is a star: the same vector and
    contributors as all-to-all, bit for bit."""
    gathered = same(await Swarm(pools, names(5), k=8).round(0))
    reference = same(await Swarm(pools, names(5), k=8, kind=AllToAll).round(0))
    assert gathered.contributors == reference.contributors == names(5)
    assert torch.equal(gathered.vector, reference.vector)


async def test_a_forwarder_that_drops_what_it_should_forward_changes_nothing(pools) -> None:  # noqa: ANN001
    """A member that forwards nothing: its children lack some makers' contributions, fetch them
    from members whose receipts list them, and end on the swarm's vector."""
    swarm = Swarm(pools, names(20), k=3)
    d = draw(0, BASE, swarm.names, 3)
    liar = next(m for m in d.order if m not in d.makers and any(d.children(mk, m, 3) for mk in d.makers))
    for child in swarm.names:
        swarm.local.cut.add((liar, child, None))
    result = same(await swarm.round(0))
    assert result.contributors == swarm.makers(0)
    assert torch.equal(result.vector, average({m: (delta(m, 0), 1.0) for m in swarm.makers(0)}))
    assert swarm.local.fetches > 0


async def test_a_maker_that_equivocates_is_left_out_by_everyone(pools) -> None:  # noqa: ANN001
    """A maker sends another contribution to one of its children, which forwards it down its
    subtree: two signed versions of one slot circulate, the receipts show both, and every member
    leaves the maker out alike (and bans it)."""
    swarm = Swarm(pools, names(12), k=4)
    d = draw(0, BASE, swarm.names, 4)
    liar = d.makers[0]
    child = d.children(liar, liar, 4)[0]
    other = VectorEncoder(codec="fp32", chunk_bytes=4096, zstd_level=0, byte_shuffle=False).encode(
        delta(liar, 0) * -5, 0.0, weight=1.0, round_id=0, sender_id=liar, base_digest=BASE)
    swarm.local.forged[(liar, child)] = other
    result = same(await swarm.round(0))
    assert result.contributors == sorted(set(swarm.makers(0)) - {liar})
    assert all(liar in m.banned for name, m in swarm.local.members.items() if name != liar)


async def test_a_member_not_drawn_that_sends_anyway_is_not_averaged(pools) -> None:  # noqa: ANN001
    """A member outside the K lowest tickets pushes its contribution to everyone: the makers hold
    it and list it, and still only the K lowest tickets count, at every member alike."""
    swarm = Swarm(pools, names(10), k=4)
    d = draw(0, BASE, swarm.names, 4)
    liar = d.order[-1]
    forced = VectorEncoder(codec="fp32", chunk_bytes=4096, zstd_level=0, byte_shuffle=False).encode(
        delta(liar, 0) * 100, 0.0, weight=1.0, round_id=0, sender_id=liar, base_digest=BASE)
    swarm.local.by_id[liar].send(0, Phase.WHOLE, forced, members=tuple(set(swarm.names) - {liar}))
    result = same(await swarm.round(0))
    assert result.contributors == swarm.makers(0) and liar not in result.contributors
    assert torch.equal(result.vector, average({m: (delta(m, 0), 1.0) for m in swarm.makers(0)}))


def test_what_a_member_carries_survives_a_checkpoint() -> None:
    """The feedback and the rounds carried are checkpointed with the encoder (a lossless codec
    keeps feedback once it carried): restored, the next contribution is the same, bit for bit;
    a checkpoint of the previous release (no `carried_rounds`) restores carrying nothing."""
    def encoder() -> ContributionEncoder:
        return ContributionEncoder(EncoderConfig(codec="fp32", chunk_bytes=4096, zstd_level=0, byte_shuffle=False),
                                   n_elements=N, sender_id="m")

    def sent(e: ContributionEncoder) -> torch.Tensor:
        return e.contribution(delta("m", 2), [(0, N)], 0.0, weight=1.0, round_id=2).parts[0].data.decode()

    first = encoder()
    assert first.state_dict() is None  # fp32, nothing carried: as before
    first.carry(delta("m", 0))
    first.carry(delta("m", 1))
    state = first.state_dict()
    assert state is not None and float(state["carried_rounds"]) == 2.0
    restored = encoder()
    restored.load_state_dict(state)
    expected = torch.add(delta("m", 2), torch.add(delta("m", 1), delta("m", 0))) / 3.0
    assert torch.equal(sent(restored), expected) and torch.equal(sent(first), expected)
    old = encoder()
    old.load_state_dict({"residual": torch.zeros(N)})  # a lossy codec's feedback of the previous release
    assert old.carried_rounds == 0.0 and torch.equal(sent(old), delta("m", 2))
