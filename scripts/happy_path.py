"""Count the neuronode modules one pseudo-gradient's round passes through on the happy path.

Three real members (SwarmNodes on 127.0.0.1, real gRPC), all-to-all, one round: each prepares
its contribution with the node's encoder (error feedback, codec, frames), exchanges it (push,
receive, collect, receipts, agreement) and averages (the aggregator). Every Python function
called meanwhile, on every thread, is recorded by module (sys.setprofile); the nodes' background
loops (heartbeats, reachability checks, sessions, the stream watch) are stopped first, so what is
left is what the round itself runs, both ends of each push included. The path's two ends, which
run in the node's training thread (node/replica.py: `pseudo_gradient`, `apply_average`;
diloco/engine.py: the outer step) and its caller (node/rounds.py), are added as they are.
Generated code (neuronode.v1) does not count.

Two measures, one run:
- `count`, `modules`: every module that ran (the whole round's machinery: clock, events, the
  peer table, receipts, admission, rate limits ...).
- `path`: the modules a call carrying the pseudo-gradient passes through. The three members'
  Δ are marked; a call whose arguments carry marked data (the object itself, a view of a marked
  tensor's storage, bytes that hold a marked payload, or a container, record, closure,
  coroutine or generator holding one) is on the path, with every neuronode frame above it on its
  stack; what such a call returns is marked in turn when it carries a payload (a tensor of at
  least 1024 elements, at least 512 bytes, or a record holding one), so the mark follows Δ
  through error feedback, the codec, frames, the wire (by content: a receiver sees new bytes),
  the book and the aggregator (the ends are added as above). Digests, receipts and counters
  are not payloads.

Usage: PYTHONPATH=. python scripts/happy_path.py   (prints JSON: count, swarm, modules, path)
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ENDS = {"neuronode.node.replica", "neuronode.node.rounds", "neuronode.diloco.engine"}
N = 50_000
MIN_ELEMENTS, MIN_BYTES, PRINT_BYTES = 1024, 512, 64


def ours(frame: Any) -> str:
    """The neuronode module `frame` runs in, or "" (not ours, or generated code)."""
    module = frame.f_globals.get("__name__", "")
    return module if module.startswith("neuronode.") and not module.startswith("neuronode.v1") else ""


def parts(obj: Any) -> list[Any]:
    """What `obj` holds, one level down: items, fields, slots, a closure's cells, the
    arguments of a partial, a bound method's object, a coroutine's or generator's locals."""
    import torch
    from google.protobuf.message import Message

    if obj is None or isinstance(obj, (bytes, bytearray, memoryview, str, int, float, bool, torch.Tensor)):
        return []
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)[:64]
    if isinstance(obj, dict):
        return list(obj.values())[:64]
    if isinstance(obj, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
        frame = getattr(obj, "gi_frame", None) or getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
        return list(frame.f_locals.values())[:64] if frame is not None else []
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if isinstance(obj, types.MethodType):
        return [obj.__self__]
    if isinstance(obj, types.FunctionType):
        return [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None]
    if isinstance(obj, Message):
        return [v for _, v in obj.ListFields()]
    try:
        fields = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        fields = None
    if isinstance(fields, dict):
        return list(fields.values())[:64]
    slots = [s for k in type(obj).__mro__ if "__slots__" in k.__dict__ for s in k.__dict__["__slots__"]]
    found = []
    for slot in slots[:64]:  # not getattr: a __getattr__ would run (and recurse) inside the profile
        try:
            found.append(object.__getattribute__(obj, slot))
        except AttributeError:
            pass
    return found


class Path:
    """Follows the marked pseudo-gradients through calls (see the module docstring)."""

    def __init__(self) -> None:
        self.kept: list[Any] = []  # marked objects stay alive, so their ids stay theirs
        self.ids: set[int] = set()
        self.storages: set[int] = set()
        self.prints: set[bytes] = set()  # the first bytes of each marked payload
        self.on_path: set[int] = set()  # frames whose call carried marked data
        self.modules: set[str] = set()

    def mark(self, obj: Any, depth: int = 2) -> None:
        import torch

        if id(obj) in self.ids:
            return
        self.ids.add(id(obj))
        self.kept.append(obj)
        if isinstance(obj, torch.Tensor) and obj.numel() >= MIN_ELEMENTS:
            self.storages.add(obj.untyped_storage().data_ptr())
        if isinstance(obj, (bytes, bytearray, memoryview)) and len(obj) >= MIN_BYTES:
            self.prints.add(bytes(obj[:PRINT_BYTES]))
        for part in parts(obj) if depth > 0 else ():
            if self.payload(part, 1):
                self.mark(part, depth - 1)

    def payload(self, obj: Any, depth: int = 2) -> bool:
        import torch

        if isinstance(obj, torch.Tensor):
            return obj.numel() >= MIN_ELEMENTS
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return len(obj) >= MIN_BYTES
        return depth > 0 and any(self.payload(p, depth - 1) for p in parts(obj))

    def carries(self, obj: Any, depth: int = 3) -> bool:
        import torch

        if id(obj) in self.ids:
            return True
        if isinstance(obj, torch.Tensor):
            return obj.numel() > 0 and obj.untyped_storage().data_ptr() in self.storages
        if isinstance(obj, (bytes, bytearray, memoryview)):
            data = obj if isinstance(obj, bytes) else bytes(obj)
            return len(data) >= MIN_BYTES and (data[:PRINT_BYTES] in self.prints or any(p in data for p in self.prints))
        return depth > 0 and any(self.carries(p, depth - 1) for p in parts(obj))

    def count(self, frame: Any) -> None:
        while frame is not None:
            if module := ours(frame):
                self.modules.add(module)
            frame = frame.f_back

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return") or not ours(frame):
            return
        if event == "call":
            code = frame.f_code
            n = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 4) + bool(code.co_flags & 8)
            if any(self.carries(frame.f_locals.get(name)) for name in code.co_varnames[:n]):
                self.on_path.add(id(frame))
                self.count(frame)
            return
        if id(frame) in self.on_path or (arg is not None and self.carries(arg)):
            self.on_path.discard(id(frame))
            self.count(frame)
            if arg is not None and self.payload(arg):
                self.mark(arg)


async def one_round(seen: set[str], path: Path) -> None:
    import torch

    from neuronode.averaging import AllToAll, AveragingConfig
    from neuronode.codec import ContributionEncoder, EncoderConfig
    from neuronode.diloco import average
    from neuronode.swarm.context import Settings
    from neuronode.swarm.node import SwarmConfig, SwarmNode

    pool = ThreadPoolExecutor(2)
    nodes: list[Any] = []
    for name in ("a", "b", "c"):
        cfg = SwarmConfig(node_id=name, swarm_id="path", manifest_hash="a1" * 32, n_elements=N, listen="127.0.0.1:0",
                          advertise="", peers=(nodes[0].advertise,) if nodes else (), heartbeat_s=0.2,
                          sync_timeout_s=30.0, reachable="yes", settings=Settings(codec="bf16"))
        node = SwarmNode(cfg, executor=pool)
        await node.start()
        nodes.append(node)
    for _ in range(600):  # the members meet (heartbeats every 0.2 s)
        if all(len(n.table.alive()) == 2 for n in nodes):
            break
        await asyncio.sleep(0.05)
    for node in nodes:  # the background loops: not the round's path
        for prefix in ("heartbeats", "stream-watch", "reachability", "sessions"):
            for task in node.ctx.tasks.named(prefix):
                task.cancel()
    await asyncio.sleep(0.1)
    protocols = []
    for node in nodes:
        encoder = ContributionEncoder(EncoderConfig(codec="bf16", chunk_bytes=1 << 14, zstd_level=1, byte_shuffle=True),
                                      n_elements=N, sender_id=node.cfg.node_id)
        protocols.append(AllToAll(AveragingConfig(node_id=node.cfg.node_id, codec="bf16", n_elements=N,
                                                  sync_timeout_s=30.0, min_contributors=3),
                                  transport=node.transport, encoder=encoder, encoder_pool=pool, aggregate=average,
                                  executor=pool))
    deltas = [torch.randn(N, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    for delta in deltas:
        path.mark(delta)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if module := ours(frame):
            seen.add(module)
            path.profile(frame, event, arg)

    assert not pool._threads, "worker threads started before the profile: they would go unseen"
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        prepared = await asyncio.gather(*(p.prepare(0, d, base_digest="", weight=1.0)
                                          for p, d in zip(protocols, deltas, strict=True)))
        results = await asyncio.gather(*(p.exchange(x) for p, x in zip(protocols, prepared, strict=True)))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert all(r.contributors == ["a", "b", "c"] for r in results), [r.contributors for r in results]
    for node in nodes:
        await node.stop(grace_s=0.2)
    pool.shutdown()


def main() -> None:
    seen: set[str] = set()
    path = Path()
    asyncio.run(one_round(seen, path))

    def listing(found: set[str]) -> dict[str, Any]:
        modules = sorted(found | ENDS)
        return {"count": len(modules), "swarm": sum(m.startswith("neuronode.swarm") for m in modules),
                "modules": [m.removeprefix("neuronode.") for m in modules]}

    print(json.dumps({**listing(seen), "path": listing(path.modules)}, indent=1))


if __name__ == "__main__":
    main()
