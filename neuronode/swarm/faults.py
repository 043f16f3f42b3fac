"""The fault-injection seam of the transport (tests and drills only).

`--fault-file PATH` names a JSON file that this node re-reads whenever it changes:

    {"blocked": ["127.0.0.1:7502"],   # addresses we can neither call nor be reached by
     "partition": [["127.0.0.1:7501", "127.0.0.1:7502"], ["127.0.0.1:7503"]],
                                      # groups of advertised addresses; calls across groups fail
     "delay_s": 0.5,                  # added before every outgoing call and contribution chunk
     "drop": 0.1,                     # probability that an outgoing call fails at once
     "cut_after_chunks": 2,           # outgoing contribution streams break after k chunks
     "cut_to": ["127.0.0.1:7503"],    # ... only those to these addresses (default: all)
     "cut_phase": "averaged",         # ... only this phase: whole, shard or averaged (default: all)
     "byzantine_scale": -100.0,       # this node lies: its pseudo-gradient times this factor
     "byzantine_noise": 10.0,         # ... plus gaussian noise of this standard deviation
     "step_delay_s": 0.02}            # the training thread sleeps this long after every inner step

Every node applies the plan to its own outgoing calls and to the callers it serves, so a
partition holds in both directions. Injected failures look like UNAVAILABLE to the code above,
exactly like a real network fault. Without the flag nothing here runs.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field

import grpc

logger = logging.getLogger(__name__)


class FaultInjected(grpc.aio.AioRpcError):
    """An injected failure, indistinguishable from UNAVAILABLE for the caller."""

    def __init__(self, what: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                         details=f"fault injected: {what}")


CUT_PHASES = ("whole", "shard", "averaged")  # by ContributionChunk.phase: 0, 1, 2


@dataclass
class FaultPlan:
    blocked: set[str] = field(default_factory=set)
    partition: list[set[str]] = field(default_factory=list)
    delay_s: float = 0.0
    drop: float = 0.0
    cut_after_chunks: int = 0
    cut_to: set[str] = field(default_factory=set)  # empty: every peer
    cut_phase: str = ""  # "": every phase; else one of CUT_PHASES
    byzantine_scale: float = 1.0
    byzantine_noise: float = 0.0
    step_delay_s: float = 0.0


class Faults:
    """Reads the plan file (when given) and answers whether a call may proceed."""

    def __init__(self, path: str | None, *, self_address: str = "") -> None:
        self.path = path
        self.self_address = self_address
        self.plan = FaultPlan()
        self._mtime = 0.0

    def refresh(self) -> FaultPlan:
        if not self.path:
            return self.plan
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            self.plan, self._mtime = FaultPlan(), 0.0
            return self.plan
        if mtime != self._mtime:
            self._mtime = mtime
            try:
                raw = json.loads(open(self.path).read() or "{}")
                plan = FaultPlan(
                    blocked=set(raw.get("blocked", [])),
                    partition=[set(g) for g in raw.get("partition", [])],
                    delay_s=float(raw.get("delay_s", 0.0)), drop=float(raw.get("drop", 0.0)),
                    cut_after_chunks=int(raw.get("cut_after_chunks", 0)),
                    cut_to=set(raw.get("cut_to", [])), cut_phase=str(raw.get("cut_phase", "")),
                    byzantine_scale=float(raw.get("byzantine_scale", 1.0)),
                    byzantine_noise=float(raw.get("byzantine_noise", 0.0)),
                    step_delay_s=float(raw.get("step_delay_s", 0.0)),
                )
                if plan.cut_phase not in ("", *CUT_PHASES):
                    raise ValueError(f"cut_phase must be one of {', '.join(CUT_PHASES)}")
                self.plan = plan
                logger.warning("fault plan from %s: %s", self.path, raw)
            except (ValueError, TypeError, AttributeError) as exc:
                logger.error("ignoring unreadable fault file %s: %s", self.path, exc)
        return self.plan

    def cut_off(self, address: str) -> bool:
        """True when the plan separates us from `address`."""
        plan = self.refresh()
        if address in plan.blocked:
            return True
        mine = [g for g in plan.partition if self.self_address in g]
        theirs = [g for g in plan.partition if address in g]
        return bool(mine and theirs and mine[0] is not theirs[0])

    def before_call(self, address: str) -> float:
        """Raise FaultInjected for a blocked or dropped call; return a delay to wait first."""
        if not self.path:
            return 0.0
        if self.cut_off(address):
            raise FaultInjected(f"{address} is cut off")
        if self.plan.drop and random.random() < self.plan.drop:
            raise FaultInjected(f"call to {address} dropped")
        return self.plan.delay_s

    def chunk_allowed(self, index: int, *, address: str, phase: int) -> bool:
        """False when the plan breaks this stream (to `address`, of `phase`) before chunk `index`."""
        plan = self.plan
        if not (self.path and plan.cut_after_chunks and index >= plan.cut_after_chunks):
            return True
        if plan.cut_to and address not in plan.cut_to:
            return True
        return bool(plan.cut_phase) and plan.cut_phase != CUT_PHASES[phase]
