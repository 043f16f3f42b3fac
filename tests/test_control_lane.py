"""Control traffic is never stuck behind bulk data (issue 25), measured on a capped link: two
real SwarmNodes in one network namespace whose only link (lo) is shaped to 40 Mbit/s with tbf,
while one streams a 40 MB contribution to the other (8 s of the link's time).

- dialed: Hellos ride a connection of their own (the control lane), not the one the push fills;
  the reference (the same run, every call on one connection, as before) is measured beside it;
- over a session: the carrier's Hellos (its own and relayed ones) go before the chunks waiting
  in the session (the control lane); the reference queues them behind the chunks.

The test asserts what keeps a member live (every Hello answered within its timeout, the news
over a session delivered within a heartbeat; a newer announcement replaces one still waiting)
and prints the figures. With NEURONODE_LANE_REFERENCE=1 it measures the references too (the
figures in docs/benchmarks.md come from `NEURONODE_LANE_REFERENCE=1 python -m pytest -s
tests/test_control_lane.py`).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from helpers import FORKS, Nodes, encode
from netns import Net, enter_namespace, net_fixture  # noqa: F401

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(900)]

MBIT = 40
N = 10_000_000  # fp32: a 40 MB contribution, 39 chunks of 1 MiB
HEARTBEAT_S = 2.0  # a Hello times out after max(1, heartbeat) s; a member is dead after 6 s of silence


async def alive_both(a: Any, b: Any) -> None:
    deadline = time.monotonic() + 30
    while not (a.table.alive() and b.table.alive()):
        assert time.monotonic() < deadline, "the two nodes never met"
        await asyncio.sleep(0.05)


async def dialed(shared: bool) -> dict[str, Any]:
    """a pushes 40 MB to b; meanwhile a greets b every 0.25 s: the Hello round trips."""
    from neuronode.swarm import server

    if shared:  # the reference: every call on the one (bulk) connection
        honest = server.Channels.channel
        server.Channels.channel = lambda self, address, lane=server.BULK: honest(self, address, server.BULK)  # type: ignore[method-assign]
    with ThreadPoolExecutor(2) as pool:
        nodes = Nodes(pool)
        try:
            a = await nodes.start("a", n_elements=N, heartbeat_s=HEARTBEAT_S, sync_timeout_s=300.0)
            b = await nodes.start("b", peers=[a.advertise], n_elements=N, heartbeat_s=HEARTBEAT_S, sync_timeout_s=300.0)
            await alive_both(a, b)
            from neuronode.swarm.transport import WireCache

            out = encode("a", __import__("torch").randn(N), chunk_bytes=1 << 20)
            a.transport.sign(out)
            started = time.monotonic()
            push = asyncio.ensure_future(a.links.stream("b", a.transport.chunks("b", out, WireCache()), timeout_s=300))
            rtts, failed = [], 0
            while not push.done():
                t0 = time.monotonic()
                failed += not await a.peers.hello(b.advertise, to="b")
                rtts.append(time.monotonic() - t0)
                await asyncio.sleep(0.25)
            await push
            return {"push_s": round(time.monotonic() - started, 1), "hellos": len(rtts), "failed": failed,
                    "rtt_median_s": round(statistics.median(rtts), 3), "rtt_max_s": round(max(rtts), 3)}
        finally:
            await nodes.stop_all()
            if shared:
                server.Channels.channel = honest  # type: ignore[method-assign]


async def over_session(fifo: bool) -> dict[str, Any]:
    """a carries home's session and streams 40 MB over it; meanwhile it announces every 0.25 s:
    how long each announcement takes to reach home."""
    from neuronode.swarm.links import sessions

    if fifo:  # the reference: control messages wait behind the chunks already queued
        honest = sessions.Carried.offer
        sessions.Carried.offer = lambda self, key, msg: (self.data.append((msg, None)), self.ready.set())  # type: ignore[method-assign,assignment,func-returns-value]
    with ThreadPoolExecutor(2) as pool:
        nodes = Nodes(pool)
        try:
            a = await nodes.start("a", n_elements=N, heartbeat_s=HEARTBEAT_S, sync_timeout_s=300.0)
            home = await nodes.start("home", peers=[a.advertise], n_elements=N, heartbeat_s=HEARTBEAT_S,
                                     sync_timeout_s=300.0, reachable="no")
            deadline = time.monotonic() + 30
            while not (home.sessions.open == {"a"} and "home" in a.sessions.carried):
                assert time.monotonic() < deadline, "no session"
                await asyncio.sleep(0.05)
            sent: dict[str, float] = {}
            delays: list[float] = []
            honest_answer = home.hello_answer

            def arrived(carrier: str, address: str, resp: Any) -> bool:
                if resp.observed_address in sent:
                    delays.append(time.monotonic() - sent.pop(resp.observed_address))
                return bool(honest_answer(carrier, address, resp))

            home.hello_answer = arrived
            from helpers import chunks_of

            out = encode("a", __import__("torch").randn(N), chunk_bytes=1 << 20)

            async def chunks() -> Any:
                for chunk in chunks_of(out, swarm_id=a.cfg.swarm_id):
                    yield chunk.SerializeToString()

            started = time.monotonic()
            push = asyncio.ensure_future(a.sessions.push("home", chunks()))
            count = 0
            while not push.done():
                count += 1
                marker = f"mark-{count}"
                sent[marker] = time.monotonic()
                a.sessions.announce(a.peers.session_hello(f"x:{marker}"))
                await asyncio.sleep(0.25)
            await push
            push_s = time.monotonic() - started
            await asyncio.sleep(2.0)
            return {"push_s": round(push_s, 1), "announced": count, "delivered": len(delays),
                    "delay_median_s": round(statistics.median(delays), 3) if delays else None,
                    "delay_max_s": round(max(delays), 3) if delays else None}
        finally:
            await nodes.stop_all()
            if fifo:
                sessions.Carried.offer = honest  # type: ignore[method-assign]


def measure(ns: str, out: Any) -> None:
    """The forked child: into the namespace, then all four measurements."""
    enter_namespace(ns)
    results = {"dialed": asyncio.run(dialed(False)), "session": asyncio.run(over_session(False))}
    if os.environ.get("NEURONODE_LANE_REFERENCE"):
        results |= {"dialed_shared": asyncio.run(dialed(True)), "session_fifo": asyncio.run(over_session(True))}
    out.send(results)


def test_hellos_keep_a_member_live_while_a_40_mb_push_fills_a_capped_link(net: Net) -> None:
    host = net.public_host("lane")
    host.run("ip", "link", "set", "lo", "mtu", "1500")
    host.run("tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{MBIT}mbit", "burst", "16384",
             "latency", "50ms")
    parent, child = FORKS.Pipe()
    process = FORKS.Process(target=measure, args=(host.ns, child), name="control-lane")
    process.start()
    try:
        assert parent.poll(850), "the measurement did not finish"
        results = parent.recv()
    finally:
        process.kill()
        process.join()
    print(json.dumps(results))
    dialed_now, session_now = results["dialed"], results["session"]
    assert dialed_now["push_s"] >= 6  # the link was the bottleneck: 40 MB at 40 Mbit/s is 8 s
    assert dialed_now["failed"] == 0 and dialed_now["rtt_max_s"] < HEARTBEAT_S, results
    assert session_now["delivered"] >= session_now["announced"] / 4 and session_now["delay_max_s"] < HEARTBEAT_S, results
