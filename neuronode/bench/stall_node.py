"""The honest node of `neuronode bench stall`, in its own process so its memory is its own.

Prints its address, then for every round id read from stdin: waits (up to 30 s) for the
member's contribution to that round to be in its round book, closes the round as its deadline
would, waits (up to 30 s) for the book to let go of it, and prints
`buffered_peak buffered_after buffered_bytes_bound rss_bytes`. Ends when stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from neuronode.bench.stall import MANIFEST, SWARM_ID
from neuronode.swarm.context import Settings, SwarmConfig
from neuronode.swarm.node import SwarmNode


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; elsewhere its peak, from getrusage)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


async def until(predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:  # noqa: ASYNC110 - polling the book
        await asyncio.sleep(0.01)


async def settled(read: Callable[[], int], quiet_s: float = 0.5, timeout_s: float = 30.0) -> None:
    """Wait until `read()` stopped changing for `quiet_s`."""
    deadline, last, since = time.monotonic() + timeout_s, read(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        now = read()
        if now != last:
            last, since = now, time.monotonic()


async def serve(params: int, codec: str) -> None:
    node = SwarmNode(SwarmConfig(node_id="honest", swarm_id=SWARM_ID, manifest_hash=MANIFEST, n_elements=params,
                                 listen="127.0.0.1:0", advertise="", heartbeat_s=0.5, sync_timeout_s=600.0,
                                 settings=Settings(codec=codec)), executor=ThreadPoolExecutor(2))
    await node.start()
    print(node.advertise, flush=True)
    loop, book = asyncio.get_running_loop(), node.book
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            round_id = int(line)
            await until(lambda: book.sender_bytes("member") > 0, 30)
            await settled(lambda: node.counters.per_peer_received.get("member", 0))  # every chunk it will send
            status = node.status()
            peak, bound = status["buffered_bytes"], status["buffered_bytes_bound"]
            book.close(round_id)  # what the round's deadline does
            await until(lambda: book.buffered_bytes == 0, 30)
            print(peak, node.status()["buffered_bytes"], bound, rss_bytes(), flush=True)
    finally:
        await node.stop(grace_s=0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m neuronode.bench.stall_node")
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--codec", default="fp32")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.params, args.codec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
