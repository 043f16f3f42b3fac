"""What the status page shows (`/api/status`, `/api/history`; served by neuronode.node.web).

`/api/status` holds exactly the fields of `neuronode status --peer` (the same dict, through the
same proto), plus what only the page shows: the members table, this node's warnings (codes
derived from its state, never from log text), its recent warning events, codec, averaging and
uptime. Everything here is assembled on the event loop, where the state it reads changes.

Addresses of peers are home IPs: where the page can be reached from other machines (its port
listens beyond loopback) they are left out unless --page-show-addresses says otherwise.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from neuronode.averaging import RoundState
from neuronode.config import NodeConfig, is_loopback_host
from neuronode.events import record_fields
from neuronode.node.console import round_seconds
from neuronode.node.history import History, RoundRecord
from neuronode.swarm.membership.lineage import same_lineage
from neuronode.swarm.membership.table import PeerTable
from neuronode.swarm.node import SwarmNode
from neuronode.swarm.wire import dict_to_status, status_to_dict

RECENT_ROUNDS = 5  # rounds of the members table's "counted" column
RECENT_EVENTS = 20  # warning events the page lists


def shows_addresses(cfg: NodeConfig, host: str) -> bool:
    """Whether the page shows peers' addresses: on loopback always, beyond only when asked."""
    return cfg.page_show_addresses or is_loopback_host(host)


def status_warnings(status: dict[str, Any], *, min_peers: int) -> list[str]:
    """Codes of what is wrong now, from status fields: `min_peers` (fewer live members than
    --min-peers: rounds wait), `diverged` (our parameters differ from the swarm's), `unreachable`
    (peers cannot dial us; we take part through sessions) and `isolated` (unreachable, and no
    session carries the swarm to us)."""
    out = []
    alive = 1 + sum(1 for p in status.get("peers", ()) if p.get("alive"))
    if alive < min_peers:
        out.append("min_peers")
    if status.get("agreement") == "diverged":
        out.append("diverged")
    if status.get("reachable") == "no":
        out.append("unreachable" if status.get("sessions") else "isolated")
    return out


def member_rows(table: PeerTable, own: dict[str, Any], *, own_digests: dict[int, str], late: set[str],
                recent: list[RoundRecord], show_addresses: bool) -> list[dict[str, Any]]:
    """The members table: this node first, then every peer we know, then ids banned here that we
    no longer know. `recent` are the newest history records with contributor ids; each row says
    whether that member's contribution counted in them."""
    now = table.clock.now()
    contributors = [set(r.contributor_ids) for r in recent]

    def counted(node_id: str) -> list[bool]:
        return [node_id in ids for ids in contributors]

    rows = [{
        "node_id": own["node_id"], "self": True, "address": own.get("advertise", ""),
        "reachable": own.get("reachable", "unknown") != "no", "carried_by": sorted(own.get("sessions", ())),
        "round": own.get("round", 0), "alive": True, "left": False, "last_seen_s": 0.0,
        "counted": counted(own["node_id"]), "late": False, "banned": False,
        "agreement": own.get("agreement", "unknown"),
    }]
    for peer in sorted(table.peers.values(), key=lambda p: (not table.is_alive(p), p.node_id)):
        lineage = same_lineage(own_digests, peer.digests)
        rows.append({
            "node_id": peer.node_id, "self": False, "address": peer.address if show_addresses else "",
            "reachable": peer.reachable, "carried_by": list(peer.carried_by), "round": peer.round,
            "alive": table.is_alive(peer), "left": peer.left,
            "last_seen_s": round(now - peer.last_seen, 3) if peer.last_seen else -1.0,
            "counted": counted(peer.node_id), "late": peer.node_id in late,
            "banned": table.banned_for(peer.node_id) > 0,
            "agreement": "unknown" if lineage is None else "agree" if lineage else "diverged",
        })
    for node_id in (i for i in table.banned_ids() if i not in table.peers):
        rows.append({"node_id": node_id, "self": False, "address": "", "reachable": False, "carried_by": [],
                     "round": 0, "alive": False, "left": False, "last_seen_s": -1.0, "counted": counted(node_id),
                     "late": node_id in late, "banned": True, "agreement": "unknown"})
    return rows


class WarningEvents(logging.Handler):
    """The last warnings the node logged as structured events (level WARNING or above, with an
    `event`): their event name, round, peer and line, for the page. Any thread may log."""

    def __init__(self, keep: int = RECENT_EVENTS) -> None:
        super().__init__(logging.WARNING)
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        facts = record_fields(record)
        if "event" not in facts:
            return
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            message = str(record.msg)
        with self._lock:
            self._recent.append({"time_s": round(record.created, 3), "level": record.levelname.lower(),
                                 "event": str(facts["event"]), "round_id": facts.get("round_id"),
                                 "peer_id": facts.get("peer_id"), "message": message})

    def recent(self, *, with_messages: bool) -> list[dict[str, Any]]:
        """Newest last. Lines may name peers' addresses: `with_messages` False leaves them out."""
        with self._lock:
            events = [dict(e) for e in self._recent]
        if not with_messages:
            for event in events:
                event["message"] = ""
        return events


@dataclass(kw_only=True)
class Page:
    """The page's data for one running node (every method runs on the event loop)."""

    cfg: NodeConfig
    swarm: SwarmNode
    state: RoundState
    history: History
    show_addresses: bool
    events: WarningEvents = field(default_factory=WarningEvents)
    started_s: float = field(default_factory=time.monotonic)
    tokens_per_round: int = 0  # what one round trains on here (NodeConfig.tokens_per_round); 0: not known

    def status(self) -> dict[str, Any]:
        """`/api/status`: the fields of `neuronode status --peer`, then the page's own."""
        raw = self.swarm.status()
        status = status_to_dict(dict_to_status(raw))  # exactly what the Status RPC answers
        if not self.show_addresses:
            for peer in status["peers"]:
                peer["address"] = ""
        records = self.history.records()
        recent = [r for r in records if r.contributor_ids][-RECENT_ROUNDS:]
        late = {sender for _, sender in self.swarm.book.lateness.late}
        status.update({
            "uptime_s": round(time.monotonic() - self.started_s, 1), "codec": self.cfg.codec,
            "averaging": self.cfg.averaging, "min_peers": self.cfg.min_peers, "rounds_target": self.cfg.rounds,
            "inner_steps_per_round": self.cfg.inner_steps, "addresses_shown": self.show_addresses,
            "warnings": status_warnings(status, min_peers=self.cfg.min_peers),
            "recent_rounds": [r.round for r in recent],
            "members": member_rows(self.swarm.table, status, own_digests=dict(self.state.digests), late=late,
                                   recent=recent, show_addresses=self.show_addresses),
            "events": self.events.recent(with_messages=self.show_addresses),
            **self.schedule(status, [r.time_s for r in records]),
        })
        return json_safe(status)

    def schedule(self, status: dict[str, Any], end_times: list[float]) -> dict[str, Any]:
        """tokens_per_round, round_s (a whole round's measured wall time, 0 before two rounds
        ended) and rounds_eta_s (seconds until --rounds ends: the rounds left at round_s, or
        before it is known at their training time by tokens/s; None without --rounds or a rate)."""
        round_s = round_seconds(end_times)
        rate = float(status.get("tokens_per_s") or 0.0)
        per_round = round_s or (self.tokens_per_round / rate if rate and self.tokens_per_round else 0.0)
        left = max(self.cfg.rounds - int(status.get("round", 0)), 0)
        eta = round(left * per_round, 1) if self.cfg.rounds and per_round else None
        return {"tokens_per_round": self.tokens_per_round, "round_s": round(round_s, 3), "rounds_eta_s": eta}

    def history_json(self) -> dict[str, Any]:
        """`/api/history`: the node's per-round records, oldest first."""
        return json_safe({"node_id": self.swarm.cfg.node_id,
                          "rounds": [r.to_json() for r in self.history.records()]})


def json_safe(value: Any) -> Any:
    """NaN and infinities as null (a browser's JSON.parse refuses them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
