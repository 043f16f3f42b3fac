"""Status over a real gRPC channel on port 0, under uvloop and under asyncio's own loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import swarm_config

from neuronode.node.run import run_async
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.wire import status_to_dict
from neuronode.v1 import node_pb2 as pb
from neuronode.v1 import node_pb2_grpc as pb_grpc

REQUIRED = {"node_id", "round", "phase", "peers", "last_round_contributors", "param_digest",
            "loss", "val_loss", "bytes_sent", "bytes_received"}


async def serve_and_ask() -> tuple[dict[str, object], str]:
    cfg = swarm_config("node-s", n_elements=10, heartbeat_s=0.5)
    provider = {"round": 4, "phase": "training", "param_digest": "abc", "loss": 1.5,
                "val_loss": 2.5, "last_round_contributors": 3}
    with ThreadPoolExecutor(1) as pool:
        node = SwarmNode(cfg, executor=pool, status_provider=lambda: provider)
        address = await node.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                resp = await pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=5)
        finally:
            await node.stop()
    return status_to_dict(resp), type(asyncio.get_running_loop()).__module__


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_uvloop", [True, False])
def test_status_over_grpc(use_uvloop: bool) -> None:
    if use_uvloop:
        pytest.importorskip("uvloop")
    report, loop_module = run_async(serve_and_ask, use_uvloop=use_uvloop)
    assert REQUIRED <= set(report)
    assert report["node_id"] == "node-s" and report["round"] == 4 and report["phase"] == "training"
    assert report["last_round_contributors"] == 3 and report["val_loss"] == 2.5
    assert isinstance(report["round"], int) and report["peers"] == []
    assert ("uvloop" in loop_module) == use_uvloop


@pytest.mark.timeout(60)
def test_status_cli_against_live_node() -> None:
    """`neuronode status --peer` (the sync client used by the CLI) against a live server."""
    from neuronode.node.status import from_peer

    async def main() -> dict[str, object]:
        cfg = swarm_config("node-x", n_elements=10)
        with ThreadPoolExecutor(1) as pool:
            node = SwarmNode(cfg, executor=pool, status_provider=lambda: {"round": 2})
            address = await node.start()
            try:
                return await asyncio.to_thread(from_peer, address, timeout_s=5)
            finally:
                await node.stop()

    report = asyncio.run(main())
    assert report["node_id"] == "node-x" and report["round"] == 2
