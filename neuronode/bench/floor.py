"""`bench sync --grpc-floor`: the transport's own cost, measured in the same run.

N worker processes, each a bare grpc.aio server and client with neuronode's channel options.
Every round each worker streams to every other worker as many bytes as one neuronode node sent
to each peer in a round of the node run, in messages of `--chunk-bytes`, raw (no protobuf, no
hashing, no codec, nothing averaged). A round on a worker lasts from the shared start (file
barriers, as the node workers use) until its pushes are done and every peer's stream has
arrived; the round's time is the slowest worker's, and the benchmark reports the median, as for
the node run and gloo. The ratio of the node run to this floor is what neuronode adds on top of
gRPC; the floor's ratio to gloo is what gRPC costs on its own.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

FLOOR_METHOD = "/neuronode.bench.Floor/Push"
POLL_S = 0.005


class Receiver:
    """Counts the complete streams, and their bytes, that arrived for each round."""

    def __init__(self) -> None:
        self.done: dict[int, int] = {}
        self.bytes: dict[int, int] = {}
        self.changed = asyncio.Event()

    async def push(self, requests: Any, context: Any) -> bytes:
        round_id = int(dict(context.invocation_metadata())["round"])
        received = 0
        async for message in requests:
            received += len(message)
        self.bytes[round_id] = self.bytes.get(round_id, 0) + received
        self.done[round_id] = self.done.get(round_id, 0) + 1
        self.changed.set()
        return b""

    async def wait(self, round_id: int, streams: int, deadline: float) -> None:
        while self.done.get(round_id, 0) < streams:
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"round {round_id}: {self.done.get(round_id, 0)} of {streams} streams arrived")
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except TimeoutError:
                pass


def messages(total_bytes: int, chunk_bytes: int) -> list[bytes]:
    """`total_bytes` cut into messages of `chunk_bytes` (the last one shorter)."""
    chunk = bytes(range(256)) * (chunk_bytes // 256 + 1)
    full, rest = divmod(total_bytes, chunk_bytes)
    return [chunk[:chunk_bytes]] * full + ([chunk[:rest]] if rest else [])


async def barrier(workdir: Path, round_id: int, index: int, nodes: int, deadline: float) -> None:
    (workdir / f"floor-barrier-{round_id}-{index}").touch()
    names = [workdir / f"floor-barrier-{round_id}-{i}" for i in range(nodes)]
    while not all(n.exists() for n in names):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out waiting for all floor workers at round {round_id}")
        await asyncio.sleep(POLL_S)


async def floor_worker(*, workdir: Path, index: int, ports: list[int], bytes_per_peer: int,
                       chunk_bytes: int, rounds: int, round_timeout_s: float) -> dict[str, Any]:
    """One floor worker: an untimed warm-up round, then `rounds` timed ones."""
    import grpc

    from neuronode.swarm.wire import CHANNEL_OPTIONS, SERVER_OPTIONS

    receiver = Receiver()
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("neuronode.bench.Floor", {
        "Push": grpc.stream_unary_rpc_method_handler(receiver.push)}),))
    server.add_insecure_port(f"127.0.0.1:{ports[index]}")
    await server.start()
    peers = [p for i, p in enumerate(ports) if i != index]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=CHANNEL_OPTIONS) for p in peers]
    payload = messages(bytes_per_peer, chunk_bytes)

    async def push(channel: grpc.aio.Channel, round_id: int) -> None:
        async def stream() -> Any:
            for message in payload:
                yield message

        call = channel.stream_unary(FLOOR_METHOD)
        await call(stream(), metadata=(("round", str(round_id)),), wait_for_ready=True,
                   timeout=round_timeout_s)

    seconds, cpu_s = [], []
    try:
        for round_id in range(1 + rounds):
            deadline = time.monotonic() + round_timeout_s
            await barrier(workdir, round_id, index, len(ports), deadline)
            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.gather(*(push(ch, round_id) for ch in channels))
            await receiver.wait(round_id, len(peers), deadline)
            seconds.append(time.perf_counter() - t0)
            cpu_s.append(time.process_time() - c0)
        # Nobody stops serving before every worker has its last round (a peer may still send).
        await barrier(workdir, 1 + rounds, index, len(ports), time.monotonic() + round_timeout_s)
    finally:
        for channel in channels:
            await channel.close()
        await server.stop(grace=1.0)
    return {"index": index, "seconds": seconds[1:], "cpu_s": cpu_s[1:],
            "bytes_received": [receiver.bytes.get(r, 0) for r in range(1, 1 + rounds)]}
