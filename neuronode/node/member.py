"""One member, several processes: DistributedDataParallel inside a machine, the swarm outside it.

`torchrun --nproc-per-node K -m neuronode start ...`, or `neuronode start --local-workers K`
(neuronode/node/launch.py), starts K processes (ranks) on one machine, one per GPU. They are one
member of the swarm. Every rank trains on its own data stream, and DistributedDataParallel
averages their gradients at every inner step, so their working weights stay equal; rank 0 alone
runs the swarm side (gRPC server, exchange, outer step, checkpoints, status, metrics) and leads
the others through each round with commands (the followers' loop: neuronode/node/follower.py):

- ``train``: the round's inner steps. Before every step the ranks agree whether to go on, so a
  stop (a signal to any rank) or the end of --round-seconds ends the round for all of them at
  the same step, and none is left waiting in a collective;
- ``report``: each rank's data-stream position, param_digest and tokens/s (for a checkpoint);
- ``restore``: load the checkpoint rank 0 resumed from (every rank's own stream position);
- ``stop``: the member is done.

With a command rank 0 sends its state when it moved since the last one (an outer step, an
adopted state, the --overlap look-ahead): global parameters, working weights and counters, so
every rank starts the next round from the same parameters.

A rank that dies breaks the member: the next collective on any other rank fails at once (the
connection closes), that rank stops, and the launcher's agent stops the rest (or restarts them
all from the last checkpoint with --max-restarts). Nothing here waits for a dead rank.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from neuronode.config import NodeConfig
from neuronode.errors import ConfigError, NeuronodeError

logger = logging.getLogger(__name__)

# The followers wait in the control group for as long as rank 0 is busy with the swarm (joining,
# waiting for --min-peers, a state transfer), which has no bound of its own.
CONTROL_TIMEOUT = timedelta(days=30)
STORE_TIMEOUT = timedelta(minutes=5)


class MemberLost(NeuronodeError):
    """A rank of this member failed or is gone: the member stops (its launcher may restart it)."""


def launched(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is a rank started by torchrun or torch's elastic agent."""
    return "RANK" in environ and "WORLD_SIZE" in environ


@dataclass
class Member:
    """This process's place in its member, and the collectives between its ranks."""

    rank: int
    world: int
    local_rank: int
    device: str  # what this rank trains on: "cpu", or "cuda:<local rank>"
    control: Any = None  # a gloo group of all ranks: commands, the step agreement, reports
    broken: str = ""  # why the member cannot go on (a rank failed or is gone), once it cannot
    restarts: int = 0  # how often the launcher restarted the member (TORCHELASTIC_RESTART_COUNT)
    rates: list[float] = field(default_factory=list)  # each rank's tokens/s, at the last step agreed

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, cfg: NodeConfig, *, device: str, environ: Mapping[str, str] = os.environ) -> Member:
        """Join the process group torchrun (or the agent) set up in the environment."""
        import torch.distributed as dist

        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        local_rank = int(environ.get("LOCAL_RANK", rank))
        if int(environ.get("LOCAL_WORLD_SIZE", world)) != world:
            raise ConfigError("a member is one machine: start torchrun with --nnodes 1 (one agent, "
                              "--nproc-per-node processes); other machines join the swarm as members")
        if cfg.local_workers not in (1, world):
            raise ConfigError(f"--local-workers {cfg.local_workers}, but torchrun started {world} processes; "
                              "give one of the two")
        cfg.check_local_workers(world, how="torchrun --nproc-per-node")
        if device.startswith("cuda"):
            if local_rank >= torch.cuda.device_count():
                raise ConfigError(f"{world} processes but {torch.cuda.device_count()} GPUs visible: "
                                  "one process per GPU (--local-workers or --nproc-per-node)")
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(local_rank)
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # one machine: loopback only
            if variable not in os.environ and (lo := loopback_interface()):
                os.environ[variable] = lo
        cuda = device.startswith("cuda")
        dist.init_process_group("nccl" if cuda else "gloo", store=attempt_store(environ), rank=rank, world_size=world,
                                device_id=torch.device(device) if cuda else None)
        member = cls(rank=rank, world=world, local_rank=local_rank, device=device,
                     restarts=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")), rates=[0.0] * world)
        member.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return member

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group may refuse to be torn down
                dist.destroy_process_group()

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Collectives between the ranks: a failure means a rank is gone, and the member with it."""
        if self.broken:
            raise MemberLost(self.broken)
        try:
            yield
        except RuntimeError as exc:  # torch.distributed's errors (DistBackendError too) are RuntimeErrors
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            self.broken = f"rank {self.rank}: a process of this member failed or is gone ({first}); the member stops"
            raise MemberLost(self.broken) from exc

    def command(self, op: str, payload: dict[str, Any]) -> None:
        """Rank 0: tell the other ranks what comes next."""
        self.broadcast_bytes(to_json([op, payload]))

    def receive(self) -> tuple[str, dict[str, Any]]:
        """The other ranks: wait for rank 0's next command."""
        op, payload = from_json(self.broadcast_bytes(b""))
        return str(op), dict(payload)

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's `data` on every rank, over the control group: its length, then its bytes
        (never a pickle: what a rank receives is data, read as JSON)."""
        import torch.distributed as dist

        length = torch.tensor([len(data)], dtype=torch.int64)
        with self.guarded():
            dist.broadcast(length, src=0, group=self.control)
            buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.leader
                      else torch.empty(int(length), dtype=torch.uint8))
            if int(length):
                dist.broadcast(buffer, src=0, group=self.control)
        return bytes(buffer.numpy()) if not self.leader else data

    def agree(self, *, stop: bool, time_up: bool, tokens_per_s: float) -> tuple[bool, bool]:
        """Before an inner step, on every rank: (stop, end the round) if any rank says so; each
        rank's tokens/s lands in `rates`."""
        import torch.distributed as dist

        mine = torch.tensor([float(stop), float(time_up), tokens_per_s], dtype=torch.float64)
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        with self.guarded():
            dist.all_gather(everyone, mine, group=self.control)
        table = torch.stack(everyone)  # (world, 3)
        self.rates = table[:, 2].tolist()
        return bool(table[:, 0].any()), bool(table[:, 1].any())

    def check_equal(self, value: float, *, what: str) -> None:
        """Every rank's `value` is the same (its weights after a round: DistributedDataParallel
        averages every step's gradients, so they are bit-identical), or the member stops."""
        import torch.distributed as dist

        everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world)]
        with self.guarded():
            dist.all_gather(everyone, torch.tensor([value], dtype=torch.float64), group=self.control)
        if len({float(v) for v in everyone}) > 1:
            self.broken = (f"the {what} of this member's processes differ after the round (the gradients "
                           "were not averaged: does the task's loss_fn call the model it is given?)")
            raise MemberLost(self.broken)

    def gather(self, report: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's report, in rank order, at rank 0 (the others get []), as JSON (never a
        pickle): every rank's length, then every rank's bytes padded to the longest."""
        import torch.distributed as dist

        mine = to_json(report)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        with self.guarded():
            dist.all_gather(lengths, torch.tensor([len(mine)], dtype=torch.int64), group=self.control)
            longest = max(int(n) for n in lengths)
            padded = torch.zeros(longest, dtype=torch.uint8)
            padded[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)  # JSON: never empty
            everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world)] if self.leader else None
            dist.gather(padded, everyone, dst=0, group=self.control)
        if not self.leader or everyone is None:
            return []
        return [from_json(bytes(t[:int(n)].numpy())) for t, n in zip(everyone, lengths, strict=True)]

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (in place), over the training backend."""
        import torch.distributed as dist

        on_device = tensor.to(self.device)
        with self.guarded():
            dist.broadcast(on_device, src=0)
        if on_device is not tensor:
            tensor.copy_(on_device)

    def data_parallel(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                      grad_accum: int) -> Callable[[nn.Module, Any], torch.Tensor]:
        """The task's loss through DistributedDataParallel: the backward of each step's last
        micro-batch averages the gradients of all ranks (the others accumulate locally)."""
        from torch.nn.parallel import DistributedDataParallel

        with self.guarded():  # DDP checks the model's shapes and broadcasts rank 0's weights
            ddp = DistributedDataParallel(model, device_ids=[self.local_rank] if self.device.startswith("cuda") else None)
        calls = itertools.count(1)

        def loss(_model: nn.Module, batch: Any) -> torch.Tensor:
            if next(calls) % grad_accum:  # DDP decides in forward whether the backward all-reduces
                with ddp.no_sync():
                    return loss_fn(ddp, batch)
            return loss_fn(ddp, batch)

        return loss


# What ranks send each other besides tensors: JSON, with tensors (a data stream's generator
# state) as {"__tensor__": dtype, "shape": [...], "data": base64}, of these dtypes only.
_DTYPES = {str(t): t for t in (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32, torch.float64,
                               torch.bool)}


def to_json(value: Any) -> bytes:
    """`value` (JSON types and CPU tensors) as UTF-8 JSON bytes."""
    def tensor(obj: Any) -> dict[str, Any]:
        if not isinstance(obj, torch.Tensor) or str(obj.dtype) not in _DTYPES:
            raise TypeError(f"a member's ranks send JSON data and tensors of {sorted(_DTYPES)}, not {type(obj).__name__}")
        data = obj.detach().cpu().contiguous()
        return {"__tensor__": str(data.dtype), "shape": list(data.shape),
                "data": base64.b64encode(data.numpy().tobytes()).decode()}

    return json.dumps(value, default=tensor, separators=(",", ":")).encode()


def from_json(data: bytes) -> Any:
    """What `to_json` wrote (ValueError for anything else)."""
    def tensor(obj: dict[str, Any]) -> Any:
        if "__tensor__" not in obj:
            return obj
        dtype = _DTYPES[obj["__tensor__"]]
        raw = bytearray(base64.b64decode(obj["data"], validate=True))
        return torch.frombuffer(raw, dtype=dtype).reshape(obj["shape"]) if raw else torch.empty(obj["shape"], dtype=dtype)

    try:
        return json.loads(data, object_hook=tensor)
    except (KeyError, TypeError, RuntimeError) as exc:
        raise ValueError(f"a rank sent data that is not what to_json writes: {exc}") from None


def loopback_interface() -> str:
    """The name of the loopback network interface ("lo" on Linux), or "" if none is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return ""
    return next((name for name in names if name.startswith("lo")), "")


def attempt_store(environ: Mapping[str, str]) -> Any:
    """The rendezvous store of this start of the member. torchrun's agent shares one store with
    every restart of its workers; keys of the previous start (the dead ranks' addresses) would
    send the new ranks to connect to nobody, so each start gets its own prefix."""
    import torch.distributed as dist

    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    host, port = environ.get("MASTER_ADDR", "127.0.0.1"), int(environ.get("MASTER_PORT", "29500"))
    serve = not agent_store and rank == 0
    # torch's store serves on every interface, whatever MASTER_ADDR names: ours listens at that
    # address only (loopback under --local-workers), so nothing off this machine reaches it.
    listener = listening_socket(host, port) if serve else None
    try:
        store = dist.TCPStore(host, port, world, is_master=serve, timeout=STORE_TIMEOUT, multi_tenant=not agent_store,
                              master_listen_fd=listener.fileno() if listener is not None else None)
    finally:
        if listener is not None:
            listener.detach()  # the store owns the socket now
    return dist.PrefixStore(f"neuronode/start-{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening at `host`:`port` only (the first address `host` resolves to)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(128)
    return listener
