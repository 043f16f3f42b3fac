"""`neuronode bench membership`: what the membership protocol itself (Hellos: heartbeats,
announcements, peer exchange, receipts) costs one member of an N-member swarm, measured on real
nodes (grpc.aio servers on 127.0.0.1, all in this process, no training).

It runs the swarm twice: the reference, where every heartbeat greets every peer and every Hello
says everything (`SwarmConfig.sampled_membership` False: the protocol before issue 18), then
today's protocol (sampled heartbeats and peer exchange, receipts and echoes sent to each peer
until it has them). Each run forms the swarm, then for `--rounds` rounds every member moves to
the next round and publishes a receipt listing every other member's signed statement (as after
an all-to-all round), and waits until every member holds every receipt; then it counts the
bytes of Hellos and answers each member sends over `--heartbeats` quiet heartbeats.

JSON keys: `members`, `heartbeat_s`, `fanout` (peers a heartbeat greets),
`control_bytes_per_member_per_heartbeat` and `hellos_per_member_per_heartbeat` (quiet),
`control_bytes_per_member_per_round` (the round's announcements and receipts),
`members_that_lost_a_peer` (members that saw a live peer die during the count: the process could
not keep up, and the figures undercount), the same four under `reference_...`, and
`heartbeat_bytes_ratio` (today / reference); when the reference cannot run at that size in one
process, `reference_error` says why instead.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from neuronode.bench.common import BenchError, check, entry_points

SWARM_ID = "bench-membership"
FORM_TIMEOUT_S = 120.0


async def start_members(n: int, *, sampled: bool, heartbeat_s: float, executor: ThreadPoolExecutor) -> list[Any]:
    from neuronode.averaging import RoundState
    from neuronode.security.identity import NodeKey
    from neuronode.swarm.guard.proofs import Security
    from neuronode.swarm.node import SwarmConfig, SwarmNode

    members: list[Any] = []
    for i in range(n):
        cfg = SwarmConfig(node_id=f"m{i:04d}", swarm_id=SWARM_ID, manifest_hash="b2" * 32, n_elements=1000,
                          listen="127.0.0.1:0", advertise="", heartbeat_s=heartbeat_s,
                          peers=(members[0].advertise,) if members else (), max_ids_per_host=n + 1,
                          sampled_membership=sampled)
        node = SwarmNode(cfg, executor=executor, state=RoundState(),
                         security=Security(node_id=cfg.node_id, swarm_id=SWARM_ID, key=NodeKey.generate()))
        await node.start()
        members.append(node)
    return members


async def wait_for(what: str, predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise BenchError(f"membership bench: still waiting after {timeout_s:.0f} s for {what}; "
                             "try fewer --members or a longer --heartbeat-s")
        await asyncio.sleep(0.05)


async def one_round(members: list[Any], round_id: int, timeout_s: float) -> None:
    """Every member moves to `round_id` and publishes a receipt listing every member's statement
    of the round (its own included, as receipt_of does: everyone then lists the same); returns
    once every member holds every other member's receipt."""
    from neuronode.averaging.agreement import Receipt, Statement
    from neuronode.codec import Phase

    statements = {}
    for m in members:
        s = Statement(round_id=round_id, sender=m.cfg.node_id, phase=Phase.WHOLE, shard_index=0,
                      lineage=bytes(32), body=round_id.to_bytes(32, "big"))
        statements[m.cfg.node_id] = replace(s, signature=m.ctx.security.sign_statement(s),
                                            public_key=m.ctx.security.key.public)
    for m in members:
        m.ctx.state.round = round_id
        listed = tuple(s for _, s in sorted(statements.items()))
        m.transport.publish_receipt(Receipt(round_id, Phase.WHOLE, m.cfg.node_id, listed))
    n = len(members)
    await wait_for(f"every member to hold round {round_id}'s receipts",
                   lambda: all(len(m.receipts.makers(round_id, Phase.WHOLE)) == n - 1 for m in members), timeout_s)


def sent(members: list[Any]) -> tuple[int, int]:
    return (sum(m.ctx.counters.control_bytes_sent for m in members),
            sum(m.ctx.counters.control_messages_sent for m in members))


async def measure(args: argparse.Namespace, *, sampled: bool) -> dict[str, float]:
    from neuronode.swarm.membership.table import MAX_MEMBERS, MIN_FANOUT, fanout, rotation

    n = args.members
    executor = ThreadPoolExecutor(2, thread_name_prefix="bench")
    members: list[Any] = []
    try:
        members = await start_members(n, sampled=sampled, heartbeat_s=args.heartbeat_s, executor=executor)
        await wait_for("the swarm to form (every member knowing every other)",
                       lambda: all(m.alive_count() == n - 1 for m in members), FORM_TIMEOUT_S)
        bytes_before, _ = sent(members)
        for round_id in range(1, args.rounds + 1):
            await one_round(members, round_id, FORM_TIMEOUT_S)
        round_bytes = (sent(members)[0] - bytes_before) / n / args.rounds
        # Let the round's news settle before counting quiet heartbeats: each peer is greeted
        # once a rotation, and that first greeting after a round carries our echoes of it.
        await asyncio.sleep((rotation(n - 1, MIN_FANOUT if sampled else MAX_MEMBERS) + 2) * args.heartbeat_s)
        bytes_before, messages_before = sent(members)
        started = time.monotonic()
        await asyncio.sleep(args.heartbeats * args.heartbeat_s)
        beats = (time.monotonic() - started) / args.heartbeat_s
        bytes_after, messages_after = sent(members)
        # Members that lost a live peer meanwhile: the process could not keep up (the reference
        # at a few dozen members on 2 cores); its figures then undercount what it would send.
        lost = sum(m.alive_count() < n - 1 for m in members)
    finally:
        await asyncio.gather(*(m.stop(grace_s=0.2) for m in members), return_exceptions=True)
        executor.shutdown()
    return {
        "fanout": min(n - 1, fanout(n - 1, MIN_FANOUT if sampled else MAX_MEMBERS)),
        "control_bytes_per_member_per_heartbeat": round((bytes_after - bytes_before) / n / beats, 1),
        "hellos_per_member_per_heartbeat": round((messages_after - messages_before) / n / beats, 2),
        "control_bytes_per_member_per_round": round(round_bytes, 1),
        "members_that_lost_a_peer": lost,
    }


async def both(args: argparse.Namespace) -> tuple[dict[str, float] | None, str, dict[str, float]]:
    """The reference (or why it could not run at this size in one process), then today's."""
    try:
        reference: dict[str, float] | None = await measure(args, sampled=False)
        failed = ""
    except BenchError as exc:
        reference, failed = None, str(exc)
    return reference, failed, await measure(args, sampled=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the `bench membership` flags; returns the JSON object."""
    check((args.members >= 2, f"--members {args.members}: a swarm needs at least 2 members"),
          (args.members <= 500, f"--members {args.members}: at most 500 (all run in this process)"),
          (args.rounds >= 1, f"--rounds {args.rounds}: run at least 1 round"),
          (args.heartbeats >= 1, f"--heartbeats {args.heartbeats}: count at least 1"),
          (args.heartbeat_s > 0, f"--heartbeat-s {args.heartbeat_s}: must be positive"))
    started = time.perf_counter()
    reference, failed, today = asyncio.run(both(args))  # one event loop: grpc.aio binds to the first
    result: dict[str, Any] = {"members": args.members, "heartbeat_s": args.heartbeat_s, "rounds": args.rounds,
                              **today}
    if reference is not None:
        result.update({f"reference_{k}": v for k, v in reference.items() if k != "fanout"})
        result["heartbeat_bytes_ratio"] = round(today["control_bytes_per_member_per_heartbeat"]
                                                / max(1.0, reference["control_bytes_per_member_per_heartbeat"]), 3)
    else:
        result["reference_error"] = failed
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--members", type=int, default=32, help="members, all in this process (default: 32)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of receipts before the quiet heartbeats are counted (default: 2)")
    parser.add_argument("--heartbeats", type=int, default=5, help="quiet heartbeats counted (default: 5)")
    parser.add_argument("--heartbeat-s", type=float, default=2.0,
                        help="seconds between heartbeats, as the daemon's --heartbeat-s (default: 2)")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")


add_parser, main = entry_points("membership", "N real members in this process: bytes and Hellos of the "
                                "membership protocol per member, against the greet-everyone reference",
                                configure, run)

if __name__ == "__main__":
    sys.exit(main(None))
