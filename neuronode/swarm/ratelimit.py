"""An upload cap shared by everything a node sends (`--max-upload-mbps`)."""

from __future__ import annotations

import asyncio
import time


class UploadLimiter:
    """Paces sends so the node's upload stays at or under `mbps` megabits per second.

    One schedule for all streams: each send reserves the next `nbytes * 8 / rate` seconds of
    the link, so several concurrent pushes share the cap instead of each getting all of it.
    A burst of up to `burst_s` seconds of traffic may go out at once after an idle spell.
    """

    def __init__(self, mbps: float, *, burst_s: float = 0.25) -> None:
        self.bytes_per_s = mbps * 1e6 / 8 if mbps > 0 else 0.0
        self.burst_s = burst_s
        self._next = 0.0

    @property
    def enabled(self) -> bool:
        return self.bytes_per_s > 0

    async def acquire(self, nbytes: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        start = max(self._next, now - self.burst_s)
        self._next = start + nbytes / self.bytes_per_s
        if self._next > now:
            await asyncio.sleep(self._next - now)
