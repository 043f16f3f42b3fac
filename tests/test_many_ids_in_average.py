"""Five ids on one host sending their pseudo-gradients x -1 against four honest hosts (issue 37,
"Done when" (a)), on a real network: every member in its own network namespace (tests/netns.py),
the five ids on a fifth host, every node listening on 0.0.0.0 without --advertise, with the
default aggregator (norm-clip), as in tests/test_two_ids_on_one_host.py, whose harness this uses.

Counting ids, the five were a majority of nine: norm-clip left the four HONEST members out as
"the opposed minority" and applied the liars' flipped update. Counting hosts, the five are one
member weighing what one member may (--max-weight): the one member pointing against the other
four, left out. The honest four end --rounds 6 with one digest, and their val_loss is within 10%
of the same swarm whose five extra ids are honest. The two swarms run at the same time, each on a
network of its own, so the load on the machine falls on both alike.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from netns import open_net
from test_two_ids_on_one_host import HONEST, QUICK, Attacker, Figures, HostNode, check_honest, run

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]

IDS = tuple(f"a-x{i}" for i in range(1, 6))
FLIPPED = Attacker("", IDS, fault=(("byzantine_scale", -1.0),))  # honest code, its Δ x -1 (--fault-file)
HONEST_IDS = Attacker("", IDS)  # the same five ids, honest


def swarm(base: Path, name: str, attacker: Attacker) -> tuple[dict[str, HostNode], Figures]:
    with open_net(name) as net:
        nodes = run(net, base / name, QUICK, attacker)
    return nodes, check_honest(nodes)


def test_five_ids_of_one_host_flipping_their_updates_weigh_as_one_member(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.getbasetemp() / "many-ids"
    with ThreadPoolExecutor(2) as runs:  # nodes fork from the forkserver, not from these threads
        reference = runs.submit(swarm, base, "honestids", HONEST_IDS)
        nodes, got = runs.submit(swarm, base, "flipped", FLIPPED).result()
        _, ref = reference.result()
    print(f"five honest ids: {ref}; five flipping: {got}")
    assert abs(got.val_loss - ref.val_loss) <= 0.10 * ref.val_loss, (got, ref)
    # Each honest member's norm-clip left the host out as one member (its ids together: all five,
    # or those of them in the round when one was late to it), never an honest member.
    left_out = {name: [set(peers.split()) for e in nodes[name].events("opposed_left_out") for peers in e["peers"]]
                for name in HONEST}
    assert all(groups and set(IDS) in groups and all(g <= set(IDS) for g in groups)
               for groups in left_out.values()), left_out
