"""Pure DiLoCo engine: inner/outer optimisation, pseudo-gradients and their aggregation.

No networking lives here; callers move the flat float32 vectors between peers.
"""

from neuronode.diloco.aggregate import Aggregator, Weighted, average
from neuronode.diloco.aggregators import available_aggregators, get_aggregator
from neuronode.diloco.engine import DiLoCo, OuterConfig, StateMismatchError
from neuronode.diloco.inner import InnerConfig
from neuronode.diloco.schedule import lr_at

__all__ = [
    "Aggregator",
    "Weighted",
    "DiLoCo",
    "InnerConfig",
    "OuterConfig",
    "StateMismatchError",
    "available_aggregators",
    "average",
    "get_aggregator",
    "lr_at",
]
