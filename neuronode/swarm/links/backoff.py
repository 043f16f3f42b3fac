"""The one retry loop: try until something is done or a deadline passes, with exponential
backoff and jitter between tries, on the node's clock (tests drive it with ManualClock)."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

from neuronode.clock import Clock

FIRST_S = 0.2
MAX_S = 5.0


async def retry_until(deadline: float, clock: Clock, attempt: Callable[[float], Awaitable[bool]], *,
                      first_s: float = FIRST_S, max_s: float = MAX_S) -> bool:
    """Call `attempt(seconds left)` until it returns True (done: delivered, or refused for good)
    or `deadline` passes; waits first_s, 2 x first_s, ... up to max_s (times 0.5-1 at random)
    between tries, never past the deadline. True when an attempt said done."""
    delay = first_s
    while (left := deadline - clock.now()) > 0:
        if await attempt(left):
            return True
        await clock.sleep(min(delay, max(0.0, deadline - clock.now())) * random.uniform(0.5, 1.0))
        delay = min(delay * 2, max_s)
    return False
