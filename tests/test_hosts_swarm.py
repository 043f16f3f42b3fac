"""A host is an address the node saw, and nobody takes over a swarm that starts (issue 37,
"Done when" (b) and (c)), on a real network: every member in its own network namespace
(tests/netns.py) with /etc/hosts of the test's own in a mount namespace of its own (as `ip
netns exec` gives one), so names resolve as a liar's DNS would have them.

(b) one host under 20 names and 8 spellings of its IP: a liar one round ahead with a doctored
    state (the adversary harness's `ahead-doctored`) lists `g00.liar.test:7500` ...
    `g19.liar.test:7519` (each a line of the hosts file, all its IP) and zero-padded spellings
    of its IP (`10.X.00.6:7520` ...), and answers Hello on each under a made-up id with a key of
    its own, saying what it says (`named-ghosts`). A Hello answer's host was the name dialed:
    28 voices against 4, so the honest members stood aside for its round and took its state
    (its ids vouched for it). The node now dials the IP a name resolves to and counts that:
    one voice, at most --max-ids-per-host ids, and nobody stands aside or adopts.
(c) one member announcing round 1 with a doctored state of its own lineage (`own-lineage`)
    while four honest members start at round 0. Members at round 0 did not vote and witnesses
    were sought in the donor's lineage only: its lineage won, it had nobody to vouch for it,
    and every member joining took its state on its word. Now members at round 0 vote and
    witnesses are sought among all live hosts: nobody adopts, and the four end with one digest.

Every node trains with one torch thread (helpers.NODE_DEFAULTS).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import adversary
import pytest
import test_two_ids_on_one_host as two
from adversary import apply
from helpers import FORKS, Forked, poll, run_cli
from netns import Host, Net, enter_namespace, open_net, private_hosts

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

ROUNDS = 4
ARGS = ("--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
        "--rounds", str(ROUNDS), "--sync-timeout", "6", "--swarm-id", "hosts", "--device", "cpu", "--open",
        "--min-peers", "5")  # the four honest members and the liar's node: nobody trains ahead alone
HONEST = two.HONEST
LIAR = "a-x1"
GHOST_PORT = 7500
NAMES = 20
SPELLINGS = 8


def spellings(ip: str, count: int) -> list[str]:
    """`count` spellings of IPv4 `ip` with zero-padded octets that resolvers read as `ip` (an
    octet is padded only below 8, where its octal reading is its decimal one)."""
    octets = [[o] if int(o) >= 8 else [("0" * k) + o for k in range(4)] for o in ip.split(".")]
    out = [".".join(parts) for parts in itertools.product(*octets) if ".".join(parts) != ip]
    assert len(out) >= count, f"{ip} has {len(out)} zero-padded spellings"
    return out[:count]


def run_named(ns: str, argv: list[str], log_path: str, behaviours: tuple[str, ...], hosts_file: str,
              named: list[str]) -> None:
    """A forked node's body: into its host's namespace, with the test's hosts file as
    /etc/hosts, lying as `behaviours` say (none for an honest member), then `neuronode ARGV`."""
    enter_namespace(ns)
    private_hosts(Path(hosts_file))
    adversary.NAMED[:] = named
    for behaviour in behaviours:
        apply(behaviour)
    run_cli(argv, log_path)


class NamedNode(two.HostNode):
    """A HostNode resolving names through `hosts_file`."""

    def __init__(self, tmp: Path, host: Host, name: str, *extra: str, hosts_file: Path,
                 behaviours: tuple[str, ...] = (), named: tuple[str, ...] = ()) -> None:
        super().__init__(tmp, host, name, *extra)
        self.hosts_file, self.behaviours, self.named = hosts_file, behaviours, list(named)

    def start(self, *more: str) -> NamedNode:
        args = ["start", "--data-dir", str(self.data_dir), "--listen", f"0.0.0.0:{self.port}", *two.NODE_DEFAULTS,
                *self.extra, *more]
        process = FORKS.Process(target=run_named, args=(self.host.ns, args, str(self.log_path), self.behaviours,
                                                        str(self.hosts_file), self.named), name=f"neuronode-{self.name}")
        process.start()
        self.proc = Forked(process)
        return self


def swarm(net: Net, tmp: Path, training: two.Training, *, ghosts: bool) -> tuple[dict[str, NamedNode], tuple[str, ...]]:
    """The four honest members and the liar, every one resolving through the test's hosts file
    (the liar's 20 names there, all its IP); with `ghosts`, the liar lists its host under those
    names and SPELLINGS spellings of its IP (the addresses listed: the second value)."""
    hosts = {name: net.public_host(name) for name in HONEST}
    liar_host = net.public_host("x")
    named = (*(f"g{n:02d}.liar.test:{GHOST_PORT + n}" for n in range(NAMES)),
             *(f"{s}:{GHOST_PORT + NAMES + i}" for i, s in enumerate(spellings(liar_host.ip, SPELLINGS)))) if ghosts else ()
    hosts_file = tmp / "hosts"
    hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{liar_host.ip} g{n:02d}.liar.test\n" for n in range(NAMES)))
    args = (*ARGS, *training)
    bootstrap = f"{hosts[HONEST[0]].ip}:{two.PORT}"
    nodes = {name: NamedNode(tmp, host, name, *args, *(("--peers", bootstrap) if name != HONEST[0] else ()),
                             hosts_file=hosts_file) for name, host in hosts.items()}
    behaviours = ("ahead-doctored", "named-ghosts") if ghosts else ("own-lineage",)
    nodes[LIAR] = NamedNode(tmp, liar_host, LIAR, *args, "--peers", bootstrap, hosts_file=hosts_file,
                            behaviours=behaviours, named=named)
    return nodes, named


def fooled(nodes: dict[str, NamedNode], liars: set[str]) -> dict[str, list[Any]]:
    """What the honest members did on the liars' word: stood aside for a round they said they
    closed, or adopted a state no honest member reached (a state is reached, and logged, before
    anyone can adopt it)."""
    reached = {e["param_digest"] for n in HONEST for e in nodes[n].events("round_done")}
    out: dict[str, list[Any]] = {}
    for name in HONEST:
        said = [e["closed_by"] for e in nodes[name].events("stand_aside") if set(e["closed_by"]) & liars]
        said += [e["param_digest"] for e in nodes[name].events("adopted") if e["param_digest"] not in reached]
        if said:
            out[name] = said
    return out


def finish(nodes: dict[str, NamedNode], liars: set[str]) -> dict[str, dict[str, Any]]:
    """Every honest member exits 0 at round ROUNDS, none fooled on the way (checked as they run:
    a fooled swarm stalls); their statuses."""
    poll("the honest members to finish, or one to be fooled",
         lambda: fooled(nodes, liars) or all(nodes[n].proc is not None and nodes[n].proc.poll() is not None
                                             for n in HONEST), timeout_s=two.FINISH_S, every_s=1.0,
         context=lambda: nodes[HONEST[1]].log()[-3000:])
    assert not fooled(nodes, liars), fooled(nodes, liars)
    for name in HONEST:
        assert nodes[name].wait(two.FINISH_S) == 0, f"{name}:\n{nodes[name].log()[-4000:]}"
    statuses = {name: nodes[name].status() for name in HONEST}
    assert all(s["round"] == ROUNDS for s in statuses.values()), {n: s["round"] for n, s in statuses.items()}
    return statuses


def test_one_host_under_twenty_names_is_one_voice(tmp_path: Path) -> None:
    """(b): with the round-ahead and doctored-state lies told by one host under 20 names and 8
    spellings of its IP, nobody stands aside for it, nobody takes its state, and the honest
    members end with one digest. Before, each name was a host: 28 voices to the honest 4."""
    with open_net("names") as net:
        nodes, named = swarm(net, tmp_path, two.TRAINING, ghosts=True)
        liars = {LIAR, *(f"ghost-{n:02d}" for n in range(len(named)))}
        try:
            for name in HONEST:
                nodes[name].start()
            two.formed(nodes)  # type: ignore[arg-type]
            nodes[LIAR].start()

            def met_ghosts() -> bool:
                return all(sum(e["peer_id"].startswith("ghost-") for e in nodes[n].events("peer_joined")) >= 8
                           for n in HONEST)

            poll("every honest member to meet ghosts", met_ghosts, timeout_s=90,
                 context=lambda: nodes[LIAR].log()[-2000:] + nodes[HONEST[1]].log()[-2000:])
            statuses = finish(nodes, liars)
        finally:
            for node in nodes.values():
                node.kill()
    assert len({s["param_digest"] for s in statuses.values()}) == 1, json.dumps(statuses)[:2000]


def test_one_member_announcing_round_1_takes_over_nobody_while_the_swarm_starts(tmp_path: Path) -> None:
    """(c): a member announces round 1, with a state of its own lineage it serves, while four
    honest members start at round 0. Before, every member joining after it took its state on its
    word; now nobody adopts it, and the four end with one digest."""
    with open_net("starts") as net:
        nodes, _ = swarm(net, tmp_path, two.QUICK, ghosts=False)
        first = nodes[HONEST[0]]
        try:
            first.start()
            nodes[LIAR].start()
            poll(f"{HONEST[0]} to meet the liar", lambda: any(e["peer_id"] == LIAR for e in first.events("peer_joined")),
                 timeout_s=60, context=lambda: nodes[LIAR].log()[-3000:])
            for name in HONEST[1:]:
                nodes[name].start()
            statuses = finish(nodes, {LIAR})
        finally:
            for node in nodes.values():
                node.kill()
    honest = [nodes[name] for name in HONEST]
    assert all(any(e["peer_id"] == LIAR for e in n.events("peer_joined")) for n in honest)  # the lie was heard
    assert len({s["param_digest"] for s in statuses.values()}) == 1, json.dumps(statuses)[:2000]
