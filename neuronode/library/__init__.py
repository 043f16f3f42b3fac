"""neuronode as a library: your model, your inner optimizer and your training loop in a swarm.

`Swarm` wraps them (docs/library.md); `neuronode.library.hf` has a Hugging Face
`TrainerCallback` and `neuronode.library.lightning` a Lightning `Callback` (extras
``hf-trainer`` and ``lightning``). `neuronode.Swarm` is this `Swarm`.
"""

from neuronode.library.swarm import Swarm, SwarmError

__all__ = ["Swarm", "SwarmError"]
