"""The averaging protocols: all-to-all, reduce-scatter and gather as objects that run one round over a
small Transport interface, the round book (the closing rule), the shard agreement, the node's
round state. No gRPC here: `neuronode.swarm` is the gRPC Transport."""

from neuronode.averaging.alltoall import AllToAll
from neuronode.averaging.book import RoundBook, RoundRefused
from neuronode.averaging.gather import Gather
from neuronode.averaging.protocol import Average, Averaging, AveragingConfig, Prepared
from neuronode.averaging.reducescatter import ReduceScatter
from neuronode.averaging.state import Mode, NodePhase, RoundState
from neuronode.averaging.transport import MemberView, Sending, Transport

PROTOCOLS = {"all-to-all": AllToAll, "reduce-scatter": ReduceScatter, "gather": Gather}

__all__ = [
    "PROTOCOLS", "AllToAll", "Average", "Averaging", "AveragingConfig", "Gather",
    "MemberView", "Mode", "NodePhase", "Prepared", "ReduceScatter", "RoundBook", "RoundRefused",
    "RoundState", "Sending", "Transport",
]
