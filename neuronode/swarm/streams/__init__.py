"""Contribution streams besides our own pushes (those are neuronode.swarm.transport's): chunk
framing without copying payloads (`chunks`), every stream that comes in, pushed, carried or
fetched, and its checks (`inbound`), forwarding a maker's contribution down its gather tree
(`forward`), and fetching a contribution we missed or serving one we hold (`missed`).

May import (tests/test_layering.py): averaging, codec, events, quorum, security, v1; of swarm/
the node's core (`context`, `wire`), `links`, `guard` (admission, bans, signatures), the peer
table and the host a contribution names (`membership.table`, `membership.hosts`), and the serving
slots (`statesync.serving`).
"""
