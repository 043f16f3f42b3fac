"""State transfer between real SwarmNodes: verified, served with the daemon's default (auto)
zstd level, fetched from every donor at once, each chunk checked against the vouched chunk
list as it arrives; a donor that is cut, late or lies is dropped at that chunk and the download
goes on from the others, never fetching a verified chunk again (issue 39, item 3; issue 37,
finding 6)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
import torch
from adversary import published
from helpers import Nodes, swarm_config, wait_until

from neuronode.events import record_fields
from neuronode.state import GlobalState
from neuronode.swarm.node import SwarmConfig, SwarmNode
from neuronode.swarm.statesync import download as statedownload
from neuronode.swarm.statesync import statesync
from neuronode.swarm.wire import Refusal
from neuronode.v1 import node_pb2 as pb


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zstd_level", [-1, 0, 3])
async def test_fetch_state_verified(zstd_level: int) -> None:
    n = 300_000
    params = torch.randn(n, generator=torch.Generator().manual_seed(1))
    momentum = torch.randn(n, generator=torch.Generator().manual_seed(2))
    import hashlib

    digest = hashlib.sha256(params.numpy().astype("<f4").tobytes()).hexdigest()
    state = GlobalState(round=7, param_digest=digest, params=params, momentum=momentum, inner_steps_total=350)

    def cfg(node_id: str, peers: tuple[str, ...] = ()) -> SwarmConfig:
        return swarm_config(node_id, n_elements=n, peers=peers, zstd_level=zstd_level)

    with ThreadPoolExecutor(2) as pool:
        donor = SwarmNode(cfg("donor"), executor=pool, state_provider=lambda: state)
        address = await donor.start()
        joiner = SwarmNode(cfg("joiner", (address,)), executor=pool)
        await joiner.start()
        try:
            for _ in range(100):
                if joiner.table.alive() and donor.table.alive():
                    break
                await asyncio.sleep(0.1)
            got = await joiner.fetch_state(["donor"])
        finally:
            await joiner.stop()
            await donor.stop()
    assert got is not None
    assert got.round == 7 and got.inner_steps_total == 350 and got.param_digest == digest
    assert torch.equal(got.params, params) and got.momentum is not None and torch.equal(got.momentum, momentum)


@pytest.mark.timeout(60)
async def test_a_donor_that_lies_about_its_state_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    """A donor publishes the swarm's round-7 param_digest but serves other parameters (with a
    header that vouches for them). The joiner compares with what the rest of the lineage
    published for round 7, refuses that state and downloads the honest donor's."""
    import hashlib

    n = 50_000
    honest = torch.randn(n, generator=torch.Generator().manual_seed(1))
    forged = honest + 0.5

    def state_of(params: torch.Tensor) -> GlobalState:
        digest = hashlib.sha256(params.numpy().astype("<f4").tobytes()).hexdigest()
        return GlobalState(round=7, param_digest=digest, params=params, momentum=None, inner_steps_total=70)

    good, bad = state_of(honest), state_of(forged)

    def cfg(node_id: str, peers: tuple[str, ...] = ()) -> SwarmConfig:
        return swarm_config(node_id, n_elements=n, peers=peers)

    with ThreadPoolExecutor(2) as pool:
        liar = SwarmNode(cfg("a-liar"), executor=pool, state_provider=lambda: bad)
        address = await liar.start()
        donor = SwarmNode(cfg("b-honest", (address,)), executor=pool, state_provider=lambda: good)
        joiner = SwarmNode(cfg("joiner", (address,)), executor=pool)
        await donor.start()
        await joiner.start()
        for node in (liar, donor):
            published(node, good)  # both publish the swarm's digests for round 7
        try:
            for _ in range(100):
                if all(7 in p.digests for p in joiner.table.alive()) and len(joiner.table.alive()) == 2:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail("the joiner never saw both donors publish round 7")
            got = await joiner.fetch_state(["a-liar", "b-honest"])
        finally:
            for node in (joiner, donor, liar):
                await node.stop()
    assert got is not None and got.param_digest == good.param_digest
    assert torch.equal(got.params, honest)
    rejected = [record_fields(r) for r in caplog.records if getattr(r, "event", "") == "donor_rejected"]
    assert [r["peer_id"] for r in rejected] == ["a-liar"]
    assert rejected[0]["reason"].startswith("its round-7 state (parameters "), rejected


def big_state(n: int = 4 << 20, *, round_id: int = 7) -> GlobalState:
    """Parameters and momentum of n random floats each (zstd keeps their size): 2 x n / 2^18
    chunks of 1 MiB (32 at the default)."""
    import hashlib

    params = torch.randn(n, generator=torch.Generator().manual_seed(5))
    momentum = torch.randn(n, generator=torch.Generator().manual_seed(6))
    return GlobalState(round=round_id, param_digest=hashlib.sha256(params.numpy().tobytes()).hexdigest(), params=params,
                       momentum=momentum, inner_steps_total=70)


async def start_donors(nodes: Nodes, executor: ThreadPoolExecutor, joiner: SwarmNode, names: list[str],
                       served: Callable[[str], GlobalState], vouched: GlobalState) -> list[SwarmNode]:
    """Donors `names` serving `served(name)`, each publishing `vouched` (what witnesses vouch
    for), once the joiner heard them all publish it."""
    donors = [SwarmNode(replace(joiner.cfg, node_id=name, peers=(joiner.advertise,)), executor=executor,
                        state_provider=lambda name=name: served(name)) for name in names]
    for donor in donors:
        await donor.start()
        nodes.running.append(donor)
        published(donor, vouched)
    await wait_until(lambda: {p.node_id for p in joiner.table.alive() if vouched.round in p.digests} >= set(names),
                     what="the joiner to hear every donor publish its round", timeout_s=20)
    return donors


async def donors_and_joiner(nodes: Nodes, executor: ThreadPoolExecutor, state: GlobalState,
                            names: list[str]) -> tuple[SwarmNode, list[SwarmNode]]:
    joiner = await nodes.start("joiner", n_elements=state.params.numel())
    return joiner, await start_donors(nodes, executor, joiner, names, lambda _: state, state)


class Served:
    """What a donor's FetchState served, per request: the chunks asked for and the chunk
    messages written; `on_chunk(record, msg)` may change, hold or cut a chunk before it goes."""

    def __init__(self, donor: SwarmNode, on_chunk: Callable[[Served, Any], Awaitable[Any]] | None = None) -> None:
        self.requests: list[dict[str, Any]] = []
        self.written = 0  # chunk messages, every request
        honest, self.on_chunk = donor.donor.serve, on_chunk

        async def serve(caller: str, write: Callable[[Any], Awaitable[None]], **kw: Any) -> None:
            request = kw.get("request") or pb.StateRequest()
            record: dict[str, Any] = {"asked": list(request.chunks), "header_only": request.header_only, "sent": []}
            self.requests.append(record)

            async def counted(msg: Any) -> None:
                if not msg.HasField("header"):
                    if self.on_chunk is not None:
                        msg = await self.on_chunk(self, msg) or msg
                    self.written += 1
                    record["sent"].append(msg.chunk_index)
                await write(msg)

            await honest(caller, counted, **kw)

        donor.donor.serve = serve  # type: ignore[method-assign]

    @property
    def chunks_asked(self) -> list[int]:
        return [i for r in self.requests for i in r["asked"]]


@pytest.fixture(autouse=True)
def download_events(caplog: pytest.LogCaptureFixture) -> None:
    """The joiner's events at INFO (state_downloaded among them)."""
    caplog.set_level(logging.INFO, logger=statesync.__name__)


def downloaded(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    [done] = [record_fields(r) for r in caplog.records if getattr(r, "event", "") == "state_downloaded"]
    return done


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [record_fields(r) for r in caplog.records if getattr(r, "event", "") == name]


def same(got: GlobalState | None, state: GlobalState) -> bool:
    return (got is not None and got.momentum is not None and state.momentum is not None
            and torch.equal(got.params, state.params) and torch.equal(got.momentum, state.momentum))


@pytest.mark.timeout(240)
async def test_a_download_cut_at_half_goes_on_from_the_other_donors_at_once_without_fetching_the_first_half_again(
        nodes: Nodes, executor: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 39, "Done when": a 10M-parameter state (80 chunks, 84 MB). The joiner downloads
    from a, the only donor; at half a is killed (its server stopped, no Leave), b and c having
    joined meanwhile. The joiner goes on from b and c at once, never asking anyone for a chunk
    it verified."""
    state = big_state(10_000_000)
    total = 2 * -(-state.params.numel() // (1 << 18))
    half = asyncio.Event()

    async def cut_at_half(served: Served, msg: Any) -> None:
        if served.written == total // 2:
            half.set()
            await asyncio.Event().wait()  # a sends nothing more: it is killed meanwhile

    joiner, (a,) = await donors_and_joiner(nodes, executor, state, ["a"])
    from_a = Served(a, cut_at_half)
    fetching = asyncio.ensure_future(joiner.fetch_state(["a", "b", "c"]))
    await asyncio.wait({fetching, asyncio.ensure_future(half.wait())}, return_when=asyncio.FIRST_COMPLETED)
    assert half.is_set(), fetching
    b, c = await start_donors(nodes, executor, joiner, ["b", "c"], lambda _: state, state)
    from_b, from_c = Served(b), Served(c)
    await a.server.stop(0)  # killed: its streams cut, no Leave
    await a.ctx.tasks.stop()
    got = await asyncio.wait_for(fetching, timeout=120)
    assert same(got, state)
    done = downloaded(caplog)
    assert done["chunks_by_donor"]["a"] == from_a.written == total // 2, done
    assert done["chunks_by_donor"]["b"] + done["chunks_by_donor"]["c"] == total // 2, done
    assert min(done["chunks_by_donor"]["b"], done["chunks_by_donor"]["c"]) >= 1 and done["donors_at_once"] >= 2, done
    first_half = set(range(total // 2))
    assert not first_half & set(from_b.chunks_asked + from_c.chunks_asked), (from_b.requests, from_c.requests)
    assert joiner.counters.bytes_received < 1.1 * 2 * state.params.numel() * 4  # the first half came once


@pytest.mark.timeout(120)
async def test_a_donor_serving_a_bad_chunk_is_dropped_at_that_chunk(
        nodes: Nodes, executor: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture) -> None:
    """Donor a's third chunk is not what the vouched list says (its header is honest): the
    joiner drops a at that chunk, never asks it again, and completes from b and c."""
    state = big_state()
    bad_at: list[int] = []

    async def third_is_bad(served: Served, msg: Any) -> Any:
        if served.written == 2:
            bad_at.append(msg.chunk_index + (0 if msg.part == pb.STATE_PART_PARAMS else 16))
            forged = pb.StateChunk()
            forged.CopyFrom(msg)
            forged.payload = bytes(1 << 20)  # 2^18 zeros: a chunk of its own, of the right size
            forged.compressed = False
            return forged
        return None

    joiner, (a, b, c) = await donors_and_joiner(nodes, executor, state, ["a", "b", "c"])
    from_a = Served(a, third_is_bad)
    got = await joiner.fetch_state(["a", "b", "c"])
    assert same(got, state)
    [rejected] = events(caplog, "donor_rejected")
    assert rejected["peer_id"] == "a" and rejected["chunk"] == bad_at[0], rejected
    assert "does not match its digest" in rejected["reason"]
    done = downloaded(caplog)
    assert done["chunks_by_donor"].get("a", 0) == 2 and sum(done["chunks_by_donor"].values()) == 32, done
    assert len([r for r in from_a.requests if not r["header_only"]]) == 1, from_a.requests  # never asked again


@pytest.mark.timeout(120)
async def test_a_donor_whose_chunk_list_is_its_own_is_refused_before_it_sends_a_chunk(
        nodes: Nodes, executor: ThreadPoolExecutor, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37, finding 6: a donor that says the vouched param_digest but lists (and serves)
    chunks of its own was caught only when its whole download ended, the parameters hashing to
    another digest. Members now publish the root over every chunk digest (chunks_root), so its
    header is refused before any chunk is read, and b and c serve the state."""
    state = big_state(1 << 20)
    forged = GlobalState(round=7, param_digest=state.param_digest, params=state.params + 0.5,
                         momentum=state.momentum, inner_steps_total=70)
    joiner = await nodes.start("joiner", n_elements=state.params.numel())
    liar, b, c = await start_donors(nodes, executor, joiner, ["a-liar", "b", "c"],
                                    lambda name: forged if name == "a-liar" else state, state)
    from_liar = Served(liar)
    got = await joiner.fetch_state(["a-liar", "b", "c"])  # the liar first, as if it led the lineage
    assert same(got, state)
    [rejected] = events(caplog, "donor_rejected")
    assert rejected["peer_id"] == "a-liar" and "0 of the 2 other live hosts" in rejected["reason"], rejected
    assert from_liar.written == 0, from_liar.requests
    assert "a-liar" not in downloaded(caplog)["chunks_by_donor"]


@pytest.mark.timeout(120)
async def test_a_late_donor_is_dropped_at_its_first_late_chunk(
        nodes: Nodes, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Donor a holds its third chunk back longer than a chunk may take (CHUNK_LATE_S, here 1 s):
    the joiner drops a at that chunk and b serves the rest, a's share included. (Without the end
    game, in which b would fetch a's share itself before a is late: the next test.)"""
    monkeypatch.setattr(statedownload, "CHUNK_LATE_S", 1.0)
    monkeypatch.setattr(statedownload, "ENDGAME_COPIES", 1)
    state = big_state()
    late_at: list[int] = []

    async def third_is_late(served: Served, msg: Any) -> None:
        if served.written == 2:
            late_at.append(msg.chunk_index)
            await asyncio.sleep(5)

    joiner, (a, b) = await donors_and_joiner(nodes, executor, state, ["a", "b"])
    Served(a, third_is_late)
    got = await asyncio.wait_for(joiner.fetch_state(["a", "b"]), timeout=60)
    assert same(got, state)
    failed = [e for e in events(caplog, "donor_failed") if e["peer_id"] == "a"]
    assert failed and failed[0]["code"] == "LATE" and failed[0]["chunk"] == late_at[0], failed
    done = downloaded(caplog)
    assert done["chunks_by_donor"]["a"] == 2 and done["chunks_by_donor"]["b"] == 30, done


@pytest.mark.timeout(120)
async def test_a_download_cut_at_half_resumes_from_the_same_donor_without_fetching_the_first_half_again(
        nodes: Nodes, executor: ThreadPoolExecutor) -> None:
    """The only donor cuts the stream at half (UNAVAILABLE): the joiner asks it again, for the
    chunks it lacks only."""
    state = big_state()

    async def cut_once(served: Served, msg: Any) -> None:
        if served.written == 16 and len(served.requests) <= 3:
            raise Refusal("UNAVAILABLE", "cut")

    joiner, (donor,) = await donors_and_joiner(nodes, executor, state, ["donor"])
    served = Served(donor, cut_once)
    got = await joiner.fetch_state(["donor"])
    assert same(got, state)
    asked = served.chunks_asked
    assert sorted(set(asked)) == list(range(32)), served.requests
    assert len(asked) - len(set(asked)) <= 8, served.requests  # at most the batch that was cut, asked again
    assert joiner.counters.bytes_received < 1.05 * 2 * state.params.numel() * 4  # the first half came once


@pytest.mark.timeout(120)
async def test_the_slowest_donor_does_not_set_the_end_of_a_download(
        nodes: Nodes, executor: ThreadPoolExecutor) -> None:
    """Donor a holds its third chunk back (not yet late): once nothing else is left to ask for,
    b is asked for what a still owes, and the download completes while a still holds it."""
    state = big_state()
    released = asyncio.Event()

    async def third_is_slow(served: Served, msg: Any) -> None:
        if served.written == 2:
            await asyncio.sleep(statedownload.CHUNK_LATE_S - 1)
            released.set()

    joiner, (a, b) = await donors_and_joiner(nodes, executor, state, ["a", "b"])
    Served(a, third_is_slow)
    got = await joiner.fetch_state(["a", "b"])
    assert same(got, state)
    assert not released.is_set()  # done before a sent its third chunk
