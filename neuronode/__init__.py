"""neuronode: train one model together over ordinary internet links (DiLoCo, peer to peer).

`neuronode.Swarm` puts your own model, inner optimizer and training loop in a swarm
(neuronode.library; docs/library.md). It is imported on first use, so `import neuronode` (and
the CLI) stays light: torch loads only when a Swarm is wanted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from neuronode.library import Swarm, SwarmError

__all__ = ["Swarm", "SwarmError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from neuronode import library

        return getattr(library, name)
    raise AttributeError(f"module 'neuronode' has no attribute {name!r}")
