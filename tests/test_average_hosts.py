"""A host is one member in the average (issue 37, finding 3): every aggregator weighs the ids of
one host as one member (neuronode.diloco.hosts), under both averagings, and every replica still
computes the same bits.

The liar of the issue: ids on one host sending their pseudo-gradient x -1. Six of them against
five honest hosts made norm-clip leave the HONEST members out as "the opposed minority"; five
against four turned every aggregator's result against the honest direction (the first test shows
both on the rule without hosts). An IPv6 host is its /64: forty ids in one /64 are one member.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from helpers import Nodes, chunks_of, encode, hides_refusal, key_of

from neuronode.averaging import (
    AllToAll,
    Average,
    AveragingConfig,
    Gather,
    ReduceScatter,
    RoundState,
)
from neuronode.averaging.local import LocalSwarm
from neuronode.averaging.sortition import draw
from neuronode.clock import ManualClock
from neuronode.codec import ContributionEncoder, EncoderConfig
from neuronode.diloco.aggregate import Aggregator, NormClip, Weighted
from neuronode.diloco.aggregators import get_aggregator
from neuronode.diloco.hosts import HostMean, by_host
from neuronode.events import record_fields
from neuronode.quorum import voice
from neuronode.swarm.context import Settings
from neuronode.swarm.guard.proofs import Security
from neuronode.swarm.membership.hosts import canonical_ip, host_claim_refusal, is_canonical_ip
from neuronode.swarm.wire import PROTOCOL_VERSION, settings_to_pb
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

P = 2000
W = 8.0  # every member's weight, and the swarm's --max-weight
AGGREGATORS = {
    "mean": {}, "norm-clip": {}, "trimmed-mean": {}, "median": {}, "centered-clip": {},
    "median+cosine": {"cosine_threshold": 0.0},
}


def aggregator(name: str) -> Aggregator:
    return get_aggregator(name.split("+")[0], **AGGREGATORS[name])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.double() @ b.double() / (a.double().norm() * b.double().norm()))


def swarm(honest: int, liars: int, *, seed: int = 0, liar_host: str = "203.0.113.9",
          lie: float = -1.0) -> tuple[dict[str, Weighted], dict[str, str], torch.Tensor]:
    """`honest` members on hosts of their own around one descent direction, and `liars` ids on
    `liar_host` sending theirs times `lie`: (contributions, host keys as the averaging layer
    makes them, the honest members' mean)."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(P, generator=g)
    contributions: dict[str, Weighted] = {}
    hosts: dict[str, str] = {}
    for i in range(honest):
        contributions[f"h{i}"] = (direction + 0.5 * torch.randn(P, generator=g), W)
        hosts[f"h{i}"] = voice(f"h{i}", f"198.51.100.{i + 1}")
    for i in range(liars):
        contributions[f"x{i:02d}"] = (lie * (direction + 0.5 * torch.randn(P, generator=g)), W)
        hosts[f"x{i:02d}"] = voice(f"x{i:02d}", liar_host)
    honest_mean = torch.stack([contributions[f"h{i}"][0] for i in range(honest)]).mean(0)  # type: ignore[misc]
    return contributions, hosts, honest_mean


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
def test_every_aggregator_weighs_five_ids_of_one_host_as_one_member(name: str) -> None:
    """Four honest hosts and five ids of a fifth sending x -1: without hosts every rule follows
    the five (the code before); with them, the five are one member weighing what one member may,
    and every rule keeps the honest direction. The grouped call is exactly the rule over four
    members and one: the five ids' weighted mean, weighing --max-weight."""
    contributions, hosts, honest_mean = swarm(4, 5)
    assert cosine(aggregator(name)(contributions), honest_mean) < 0  # ids counted: the liar wins
    grouped = aggregator(name)(by_host(contributions, hosts, max_weight=W))
    assert cosine(grouped, honest_mean) > 0.9
    liars = [f"x{i:02d}" for i in range(5)]
    five = torch.zeros(P)
    for peer_id in liars:  # their mean, added in sorted id order as `average` adds
        five.add_(contributions[peer_id][0], alpha=1 / 5)  # type: ignore[arg-type]
    as_one = {**{p: c for p, c in contributions.items() if p.startswith("h")}, " ".join(liars): (five, W)}
    assert torch.equal(grouped, aggregator(name)(as_one))


def test_forty_ids_in_one_ipv6_64_are_one_member() -> None:
    """Over IPv6 one /64 held 40 live ids (one voice, 40 contributions). Their voices are one
    (neuronode.quorum.voice), so they weigh as one member: norm-clip leaves them out as the
    opposed one of six, and the result is the five honest members' alone."""
    contributions, hosts, honest_mean = swarm(5, 0)
    flipped = -honest_mean
    for i in range(40):
        peer_id = f"v6-{i:02d}"
        contributions[peer_id] = (flipped.clone(), W)
        hosts[peer_id] = voice(peer_id, f"2001:db8:0:7::{i + 1:x}")
    assert len({hosts[p] for p in hosts if p.startswith("v6-")}) == 1
    grouped = by_host(contributions, hosts, max_weight=W)
    assert len(grouped) == 6 and grouped[" ".join(f"v6-{i:02d}" for i in range(40))][1] == W
    honest_only = {p: c for p, c in contributions.items() if p.startswith("h")}
    assert torch.equal(NormClip()(grouped), NormClip()(honest_only))
    assert cosine(NormClip()(contributions), honest_mean) < 0  # forty ids: the forty win


def left_out(records: list[logging.LogRecord]) -> list[list[str]]:
    """The `peers` of every opposed_left_out event among `records`."""
    return [record_fields(r)["peers"] for r in records if getattr(r, "event", "") == "opposed_left_out"]


def test_norm_clips_opposed_rule_counts_hosts(caplog: pytest.LogCaptureFixture) -> None:
    """Six ids x -1 against five honest hosts: counting ids, norm-clip left out the five HONEST
    members as the opposed minority. Counting hosts the six are one member pointing against the
    five: it is left out (event `opposed_left_out` names the host's ids), and the result is
    norm-clip over the honest members as if the six had never sent."""
    contributions, hosts, _ = swarm(5, 6)
    with caplog.at_level(logging.WARNING, logger="neuronode.diloco.aggregate"):
        NormClip()(contributions)
        by_ids = left_out(caplog.records)
        caplog.clear()
        grouped = NormClip()(by_host(contributions, hosts, max_weight=W))
        by_hosts = left_out(caplog.records)
    assert by_ids == [[f"h{i}" for i in range(5)]]  # the code before
    assert by_hosts == [[" ".join(f"x{i:02d}" for i in range(6))]]
    honest_only = {p: c for p, c in contributions.items() if p.startswith("h")}
    assert torch.equal(grouped, NormClip()(honest_only))


def test_a_kept_nudged_host_moves_norm_clip_by_one_members_share_at_most() -> None:
    """Ids that keep inside the opposed rule (their update nudged toward the honest direction)
    pulled norm-clip to cosine 0.56 with the attacker's target when counted by id. Counted by
    host, the six are one member: the result moves from the honest members' by at most what one
    member may move it, clip radius x its weight share (the bound NormClip's docstring states)."""
    contributions, hosts, honest_mean = swarm(5, 0)
    g = torch.Generator().manual_seed(7)
    target = torch.randn(P, generator=g)
    target -= (target @ honest_mean) / (honest_mean @ honest_mean) * honest_mean  # orthogonal to honest
    nudged = target / target.norm() + 0.3 * honest_mean / honest_mean.norm()
    honest_norms = sorted(float(v.norm()) for v, _ in contributions.values())  # type: ignore[union-attr]
    nudged = nudged / nudged.norm() * honest_norms[2]  # the median honest norm: never clipped
    for i in range(6):
        contributions[f"x{i:02d}"] = (nudged.clone(), W)
        hosts[f"x{i:02d}"] = voice(f"x{i:02d}", "203.0.113.9")
    by_ids, grouped = NormClip()(contributions), NormClip()(by_host(contributions, hosts, max_weight=W))
    honest_only = NormClip()({p: c for p, c in contributions.items() if p.startswith("h")})
    assert cosine(by_ids, target) > 0.5  # the code before: the attacker steers
    # One member of six moves the mean of the others by (its vector - their mean) / 6 at most.
    assert float((grouped - honest_only).norm()) <= (float(nudged.norm()) + float(honest_only.norm())) / 6 + 1e-3
    assert cosine(grouped, target) < 0.25 < cosine(by_ids, target) - 0.25


def test_hosts_of_one_id_change_nothing_bit_for_bit() -> None:
    """Where every id is a host of its own (distinct addresses, or loopback: per id) the mapping
    passes through as it is, so every aggregator's result is bit for bit what it was."""
    contributions, hosts, _ = swarm(7, 0)
    loopback = {p: voice(p, "127.0.0.1") for p in contributions}
    for keys in (hosts, loopback, {}):
        grouped = by_host(contributions, keys, max_weight=W)
        assert set(grouped) == set(contributions)
        assert all(grouped[p][0] is contributions[p][0] and grouped[p][1] == W for p in contributions)
        for name in sorted(AGGREGATORS):
            assert torch.equal(aggregator(name)(grouped), aggregator(name)(contributions)), name


def test_a_hosts_weight_is_its_ids_sum_capped_at_max_weight() -> None:
    contributions = {"a": (torch.ones(4), 3.0), "b": (torch.full((4,), 3.0), 1.0), "c": (torch.zeros(4), 2.0)}
    hosts = {"a": "host:x", "b": "host:x", "c": "host:y"}
    capped = by_host(contributions, hosts, max_weight=2.0)
    assert {k: w for k, (_, w) in capped.items()} == {"a b": 2.0, "c": 2.0}
    assert {k: w for k, (_, w) in by_host(contributions, hosts).items()} == {"a b": 4.0, "c": 2.0}
    mean = capped["a b"][0]
    assert isinstance(mean, HostMean) and torch.equal(mean(), torch.full((4,), 1.5))  # (3*1 + 1*3) / 4
    assert mean() is mean()  # computed once: norm-clip asks three times


def test_a_host_sending_nan_is_dropped_whole_by_the_robust_rules() -> None:
    contributions, hosts, honest_mean = swarm(4, 3)
    contributions["x00"] = (torch.full((P,), math.nan), W)
    for name in ("norm-clip", "median", "trimmed-mean", "centered-clip"):
        assert cosine(aggregator(name)(by_host(contributions, hosts, max_weight=W)), honest_mean) > 0.9, name


# ---- the host a contribution names, and when a receiver takes it (neuronode.swarm.membership.hosts) ------


def test_a_receiver_takes_the_host_it_sees_or_another_where_nobody_else_runs() -> None:
    seen = voice("a", "198.51.100.7")
    assert host_claim_refusal(seen=seen, claimed=seen, others=[seen]) == ""  # two ids of one host, named alike
    # Another name than the one we see (a LAN address, another address family): taken alone...
    assert host_claim_refusal(seen=seen, claimed=voice("a", "203.0.113.5"), others=[voice("b", "192.0.2.1")]) == ""
    # ...never where another id runs at the host we see it at (ids of one host naming hosts of
    # their own, per id too), nor naming the host of another member (to dilute its share).
    assert host_claim_refusal(seen=seen, claimed=voice("a", "203.0.113.5"), others=[seen])
    assert host_claim_refusal(seen=seen, claimed=voice("a", ""), others=[seen])
    assert host_claim_refusal(seen=seen, claimed=voice("a", "192.0.2.1"), others=[voice("b", "192.0.2.1")])
    # An IPv6 host is its /64: another address in it is the same host.
    v6 = voice("a", "2001:db8:0:7::1")
    assert host_claim_refusal(seen=v6, claimed=voice("a", "2001:db8:0:7::99"), others=[v6]) == ""


def test_only_canonical_ip_literals_are_host_names() -> None:
    assert is_canonical_ip("203.0.113.5") and is_canonical_ip("2001:db8::1")
    for spelling in ("203.0.113.005", "2001:DB8::1", "2001:db8:0:0::1", "x1.203.0.113.5.nip.io", "", "[::1]"):
        assert not is_canonical_ip(spelling), spelling
    assert canonical_ip("[2001:DB8::1]") == "2001:db8::1" and canonical_ip("localhost") == ""


# ---- under both averagings, over the in-process transport -----------------------------------


@pytest.fixture
def pools() -> Iterator[tuple[ThreadPoolExecutor, ThreadPoolExecutor]]:
    encode, codec = ThreadPoolExecutor(1), ThreadPoolExecutor(2)
    yield encode, codec
    encode.shutdown()
    codec.shutdown()


async def one_round(pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor], kind: type[AllToAll | ReduceScatter],
                    hosts: dict[str, str], vectors: dict[str, torch.Tensor], *, makers: int = 32) -> dict[str, Average]:
    """Every member of a LocalSwarm (calling from `hosts`, which each names in its contributions)
    prepares and exchanges round 0 with norm-clip (gather: `makers` of them make it); their
    averages by id."""
    local = LocalSwarm(clock=ManualClock(), gather_makers=makers if kind is Gather else 0)
    local.hosts.update(hosts)
    protocols = {}
    for node_id in sorted(vectors):
        transport = local.join(node_id, state=RoundState())
        encoder = ContributionEncoder(EncoderConfig(codec="fp32", chunk_bytes=4096, zstd_level=0, byte_shuffle=False),
                                      n_elements=P, sender_id=node_id)
        protocols[node_id] = kind(AveragingConfig(node_id=node_id, codec="fp32", n_elements=P, sync_timeout_s=60.0,
                                                  min_contributors=min(len(vectors), makers), max_weight=W,
                                                  makers=makers),
                                  transport=transport, encoder=encoder, encoder_pool=pools[0], aggregate=NormClip(),
                                  executor=pools[1], clock=local.clock)

    async def member(node_id: str) -> Average:
        prepared = await protocols[node_id].prepare(0, vectors[node_id], base_digest="d0", weight=W)
        return await protocols[node_id].exchange(prepared)

    results = await asyncio.wait_for(asyncio.gather(*(member(n) for n in sorted(vectors))), timeout=30)
    return dict(zip(sorted(vectors), results, strict=True))


def flipped_hosts() -> tuple[dict[str, torch.Tensor], dict[str, str], torch.Tensor]:
    """Four honest hosts, five ids on one IPv4 host and three in one IPv6 /64, all flipped:
    (vectors by id, the host each calls from, the honest members' mean)."""
    contributions, _, honest_mean = swarm(4, 5)
    vectors = {p: v for p, (v, _) in contributions.items()}  # type: ignore[misc]
    hosts = {f"h{i}": f"198.51.100.{i + 1}" for i in range(4)} | {f"x{i:02d}": "203.0.113.9" for i in range(5)}
    for i in range(3):
        vectors[f"y{i}"] = -honest_mean
        hosts[f"y{i}"] = f"2001:db8:0:7::{i + 1}"
    return vectors, hosts, honest_mean


@pytest.mark.parametrize("kind", [AllToAll, ReduceScatter, Gather])
async def test_replicas_weigh_hosts_alike_under_every_averaging(
        pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor], kind: type[AllToAll | ReduceScatter]) -> None:
    """Four honest hosts, five ids on one IPv4 host and three in one IPv6 /64, all flipped: every
    member (the liars too) ends the round with the same bits, which follow the honest direction;
    all-to-all's are exactly norm-clip over the hosts. Without hosts (every id on loopback, its
    own) the same contributions turn the average around."""
    vectors, hosts, honest_mean = flipped_hosts()
    results = await one_round(pools, kind, hosts, vectors)
    first = next(iter(results.values()))
    assert all(torch.equal(r.vector, first.vector) and r.contributors == sorted(vectors) for r in results.values())
    assert cosine(first.vector, honest_mean) > 0.9
    if kind is not ReduceScatter:
        keys = {p: voice(p, h) for p, h in hosts.items()}
        assert torch.equal(first.vector, NormClip()(by_host({p: (v, W) for p, v in vectors.items()}, keys, max_weight=W)))
    per_id = await one_round(pools, kind, {}, vectors)
    assert cosine(next(iter(per_id.values())).vector, honest_mean) < 0


async def test_gather_makers_name_their_host_and_replicas_weigh_hosts_by_it(
        pools: tuple[ThreadPoolExecutor, ThreadPoolExecutor]) -> None:
    """Gather with more members than makers (12 members, K = 8: the round's 8 lowest tickets
    make it, down their trees): each maker's contribution names its host, so every replica
    weighs the makers' ids of one host as one member, bit for bit norm-clip over the hosts."""
    vectors, hosts, honest_mean = flipped_hosts()
    results = await one_round(pools, Gather, hosts, vectors, makers=8)
    first = next(iter(results.values()))
    makers = draw(0, "d0", vectors, 8).makers
    assert all(torch.equal(r.vector, first.vector) for r in results.values())
    assert first.contributors == sorted(makers) and len({voice(m, hosts[m]) for m in makers}) < len(makers)
    keys = {p: voice(p, hosts[p]) for p in makers}
    assert torch.equal(first.vector, NormClip()(by_host({p: (vectors[p], W) for p in makers}, keys, max_weight=W)))


# ---- a receiver checks the host a contribution names (real grpc.aio server, raw client) ------


async def push(stub: pb_grpc.NodeStub, chunks: list[pb.ContributionChunk]) -> tuple[grpc.StatusCode, str]:
    async def stream() -> AsyncIterator[pb.ContributionChunk]:
        for chunk in chunks:
            yield chunk

    for _ in range(5):
        try:
            await stub.PushContribution(stream(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            if hides_refusal(exc.code(), exc.details() or ""):
                continue  # helpers.GRPC_EARLY_STATUS_BUG
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""
    raise AssertionError("every push met grpc/grpc#36066")


async def test_a_receiver_refuses_a_host_other_than_the_one_it_sees_ids_of_one_host_at(
        nodes: Nodes, refused_address: str) -> None:
    """Two ids the node sees at one host (their connections come from 203.0.113.9): one that
    names another host for its contribution is refused (PERMISSION_DENIED, naming the host the
    node sees) and nothing is filed; a zero-padded spelling of an IP is no host name
    (INVALID_ARGUMENT); the host the node sees it at is taken, and is what the record names."""
    node = await nodes.start("target")
    async with grpc.aio.insecure_channel(node.advertise) as channel:
        stub = pb_grpc.NodeStub(channel)
        for node_id in ("x1", "x2"):
            request = pb.HelloRequest(info=pb.NodeInfo(
                node_id=node_id, swarm_id=node.cfg.swarm_id, protocol_version=PROTOCOL_VERSION,
                manifest_hash=node.cfg.manifest_hash, advertise=refused_address, settings=settings_to_pb(Settings())))
            Security(node_id=node_id, swarm_id=node.cfg.swarm_id, key=key_of(node_id)).sign_hello(request)
            await stub.Hello(request, timeout=10)
            # What the node saw: here every caller is on 127.0.0.1 (this machine, counted per id),
            # so the test says where the two ids call from, as a node on a network records it.
            peer = node.table.peers[node_id]
            peer.host, peer.seen_directly = "203.0.113.9", True

        def claiming(host: str) -> list[pb.ContributionChunk]:
            contribution = encode("x1", torch.ones(node.cfg.n_elements), weight=1.0)
            contribution.host = host
            return chunks_of(contribution, swarm_id=node.cfg.swarm_id)

        code, details = await push(stub, claiming("203.0.113.77"))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "sees it at 203.0.113.9" in details, (code, details)
        code, details = await push(stub, claiming(""))  # nor "per id", as if it ran on our loopback
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        code, details = await push(stub, claiming("203.0.113.009"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "canonically" in details, (code, details)
        assert "x1" not in node.book.contributors(0)
        code, details = await push(stub, claiming("203.0.113.9"))
        assert code == grpc.StatusCode.OK, details
        assert node.book.close(0)["x1"].host == "203.0.113.9"
