"""Who is in the swarm, and how each member sees the others: the peer table and liveness
(`table`, pure), Hellos, heartbeats, announcements and replica agreement (`peers`), lineages,
believable claims and the catch-up plan (`lineage`, pure), the address peers see, dial-backs and
reachability (`reach`), and the host a contribution names (`hosts`, pure).

May import (tests/test_layering.py): clock, config, errors, events, quorum, averaging, security,
v1; of swarm/ the node's core (`context`, `wire`), `links` (how a member is reached), `receipts`
(the receipts a Hello carries), and of `guard` the bans and the rules that never rest on one
word (`guard.bans`, `guard.trust`).
"""
