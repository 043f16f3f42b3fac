"""The worker threads of a node: nothing CPU-bound runs on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Pools:
    """One thread trains (torch state is not thread-safe: in a node, the training loop's own
    thread, through neuronode.node.handoff); one encodes (the encoder and error feedback:
    neuronode.codec.ContributionEncoder); two decode and average chunks; one writes checkpoints."""

    train: Executor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="train"))
    encode: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="encode"))
    codec: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="codec"))
    writer: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="checkpoint"))

    async def run(self, pool: Executor, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def shutdown(self) -> None:
        for pool in (self.train, self.encode, self.codec, self.writer):
            pool.shutdown(wait=True)
