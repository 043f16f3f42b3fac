"""`--local-workers`: a member's processes meet on loopback only (issue 37, finding 7), on a real
network (tests/netns.py): the member runs on one host, a prober on another.

torch's TCPStore listens on every interface whatever address it is given, and takes anyone who
connects: the rendezvous of the launcher's agent (the endpoint named 127.0.0.1) and the ranks'
store both listened on `*:PORT`, so any machine that could reach the host could set their keys.
Now every socket the member listens on besides its swarm port is bound to loopback, and none of
them answers from another host, while the swarm port does.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from helpers import poll
from netns import Host, open_net
from test_two_ids_on_one_host import PORT, HostNode

from neuronode.node.member import from_json, to_json

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

# A member of two processes waiting for a second member (--min-peers 2) that never comes.
ARGS = ("--local-workers", "2", "--max-local-workers", "2", "--min-peers", "2", "--inner-steps", "5",
        "--batch-size", "4", "--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
        "--swarm-id", "lw", "--device", "cpu", "--open")
PROBE = """
import json, socket, sys
ip, ports, out = sys.argv[1], sys.argv[2:], {}
for port in ports:
    try:
        socket.create_connection((ip, int(port)), timeout=3).close()
        out[port] = True
    except OSError:
        out[port] = False
print(json.dumps(out))
"""


def listening(host: Host) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in `host`."""
    rows = host.run("ss", "-ltnH").stdout.split("\n")
    out = []
    for row in rows:
        if row.strip():
            local = row.split()[3]  # State Recv-Q Send-Q Local:Port Peer:Port
            address, _, port = local.rpartition(":")
            out.append((address.strip("[]"), int(port)))
    return out


def test_a_members_rendezvous_does_not_answer_from_another_host(tmp_path: Path) -> None:
    with open_net("lw") as net:
        home, prober = net.public_host("m"), net.public_host("p")
        member = HostNode(tmp_path, home, "m", *ARGS)
        try:
            member.start()
            poll("both ranks of the member ready", lambda: {e["rank"] for e in member.events("rank_ready")} >= {0, 1},
                 timeout_s=180, context=lambda: member.log()[-3000:])
            sockets = listening(home)
            others = sorted({port for _, port in sockets} - {PORT})
            assert len(others) >= 2, sockets  # the agent's rendezvous store and the ranks' store, at least
            answered = json.loads(prober.run(sys.executable, "-c", PROBE, home.ip, str(PORT), *map(str, others)).stdout)
            assert answered.pop(str(PORT)), "the swarm port answers from another host (the probe works)"
            assert not any(answered.values()), f"answered from another host: {answered} (listening: {sockets})"
            exposed = [(a, p) for a, p in sockets if p != PORT and a not in ("127.0.0.1", "::1")]
            assert not exposed, f"listening beyond loopback: {exposed} (all: {sockets})"
            member.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            assert member.wait(60) == 0, member.log()[-3000:]
        finally:
            member.kill()


def test_what_ranks_send_each_other_is_json_never_a_pickle() -> None:
    """Commands and reports travel as JSON with tensors tagged (a data stream's generator state);
    a pickle, or a tensor of a dtype not listed, is refused, never unpickled."""
    import pickle

    import torch

    state = torch.Generator().manual_seed(3).get_state()
    report = {"rank": 1, "batches": {"generator": state, "batches_drawn": 7}, "param_digest": "ab", "loss": float("nan")}
    back = from_json(to_json(report))
    assert torch.equal(back["batches"]["generator"], state) and back["batches"]["batches_drawn"] == 7
    assert back["param_digest"] == "ab" and back["loss"] != back["loss"]
    with pytest.raises(ValueError):
        from_json(pickle.dumps(report))
    with pytest.raises(ValueError):
        from_json(b'{"x": {"__tensor__": "torch.complex64", "shape": [1], "data": ""}}')
    with pytest.raises(TypeError):
        to_json({"x": object()})
