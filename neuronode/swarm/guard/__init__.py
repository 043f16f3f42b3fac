"""Who may call, and who is believed: membership proofs on every request and signatures on
Hellos and contributions (`proofs`; keys, certificates and TLS themselves are
neuronode.security's), the checks before any handler runs (`interceptors`), each signed
request good once (`replay`), the one admission path (`admission`), the one ban list (`bans`), the
upload cap (`ratelimit`), and the decisions that never rest on one member's word (`trust`, pure).

May import (tests/test_layering.py): averaging, clock, events, quorum, security,
v1; of swarm/ the node's core (`context`, `wire`), the peer table and lineages
(`membership.table`, `membership.lineage`) and the receipts' wire forms (`receipts.wire`).
"""
