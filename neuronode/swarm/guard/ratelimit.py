"""An upload cap shared by everything a node sends (`--max-upload-mbps`), and a meter of the
upload rate pushes actually reach (for the auto zstd level)."""

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


class UploadMeter:
    """Upload rate over the time at least one push is in flight: concurrent pushes share one
    link, so a single push's own rate would understate it. One sample per busy spell, smoothed
    (one slow spell, e.g. a busy receiver, should not flip the zstd level)."""

    def __init__(self) -> None:
        self.rate = 0.0  # bytes/s; 0: nothing measured yet
        self._active = 0
        self._since = 0.0
        self._bytes = 0

    def begin(self, now: float) -> None:
        if self._active == 0:
            self._since, self._bytes = now, 0
        self._active += 1

    def end(self, now: float, sent_bytes: int) -> None:
        """A push finished (`sent_bytes` 0 if it failed)."""
        self._active -= 1
        self._bytes += sent_bytes
        if self._active == 0 and self._bytes and now > self._since:
            sample = self._bytes / (now - self._since)
            self.rate = sample if not self.rate else 0.7 * self.rate + 0.3 * sample
