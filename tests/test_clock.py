"""The injected clock tests drive (neuronode.clock.ManualClock): what it counts as waiting."""

from __future__ import annotations

import asyncio

from neuronode.clock import ManualClock


async def test_a_waiter_whose_event_is_set_is_no_longer_waiting() -> None:
    """Tests move the clock once every coroutine waits on it. A coroutine whose event was set
    still held its timer until it resumed, so it counted as waiting with news it had not taken
    in; the clock then moved, and what it fixed on resuming (a round's cut) fell past the step
    (test_averaging: a round that should close at its cut waited for its deadline; CI)."""
    clock = ManualClock()
    event = asyncio.Event()
    waiter = asyncio.ensure_future(clock.wait(event, 10.0))
    sleeper = asyncio.ensure_future(clock.sleep(10.0))
    await asyncio.sleep(0)
    assert clock.waiting == 2
    event.set()  # the waiter resumes at the loop's next turn, not yet
    assert not waiter.done() and clock.waiting == 1
    assert await waiter is True
    assert clock.waiting == 1
    clock.advance(10.0)
    await sleeper
    assert clock.waiting == 0
