"""The receipts members tell each other (what they decide: neuronode.averaging.agreement):
ours signed and published in Hellos, theirs checked, echoed and disputed (`receipts`), compact
receipts rebuilt into lists and the lists asked for (`lists`), their wire forms and size bounds
(`wire`), and whose signatures and keys count (`checks`).

May import (tests/test_layering.py): averaging, codec, events, quorum, security, v1; of swarm/
the node's core (`context`, `wire`) and the peer table (`membership.table`).
"""
