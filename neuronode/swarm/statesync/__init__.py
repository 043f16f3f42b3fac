"""State transfer (docs/protocol.md, "State transfer"): what a joiner downloads and from whom,
the header a quorum vouches for (`statesync`), fetching from every donor at once (`download`),
the state assembled and checked chunk by chunk (`assembly`), the donor's snapshots and shares
(`donor`), and what a node serves others at all, state and missed contributions alike: slots
per caller host and the pace a reader must keep (`serving`).

May import (tests/test_layering.py): codec, events, security, state, v1; of swarm/ the
node's core (`context`, `wire`), `links`, the signatures (`guard.proofs`) and the quorum's
witnesses (`guard.trust`).
"""
