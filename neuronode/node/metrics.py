"""Prometheus metrics, read from the daemon's state at scrape time (`--metrics-port`, which also
serves the status page: neuronode.node.web).

Nothing on the hot path updates a metric except the sync-time histogram: a custom collector
reads the counters the daemon and the swarm keep anyway, so a scrape costs one pass over them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from neuronode.config import is_loopback_host
from neuronode.errors import ConfigError
from neuronode.events import fields
from neuronode.node.web import PageApp, Source, serve

logger = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """What one scrape reports (built by the daemon, off nothing but plain attributes)."""

    rounds: int = 0
    inner_steps: int = 0
    loss: float = float("nan")
    val_loss: float = float("nan")
    tokens_per_s: float = 0.0
    contributors: int = 0
    peers_alive: int = 0
    utilization: float = 0.0
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    bytes_relayed: int = 0
    control_bytes_sent: int = 0
    control_bytes_received: int = 0
    local_workers: int = 1
    rank_tokens_per_s: list[float] = field(default_factory=list)


class NodeCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s = self.snapshot()
        yield counter("neuronode_rounds", "completed rounds", s.rounds)
        yield counter("neuronode_inner_steps", "inner optimizer steps", s.inner_steps)
        yield gauge("neuronode_loss", "last training loss", s.loss)
        yield gauge("neuronode_val_loss", "validation loss after the last round", s.val_loss)
        yield gauge("neuronode_tokens_per_second", "training throughput (a member's: all its processes')", s.tokens_per_s)
        yield gauge("neuronode_local_workers", "processes this member trains with (--local-workers)", s.local_workers)
        per_rank = GaugeMetricFamily("neuronode_rank_tokens_per_second", "training throughput, by process of the member",
                                     labels=["rank"])
        for rank, rate in enumerate(s.rank_tokens_per_s):
            per_rank.add_metric([str(rank)], rate)
        yield per_rank
        yield gauge("neuronode_round_contributors", "contributions averaged in the last round", s.contributors)
        yield gauge("neuronode_peers_alive", "peers heard from recently", s.peers_alive)
        yield gauge("neuronode_utilization", "share of the last round's wall time spent training", s.utilization)
        yield labelled("neuronode_bytes_sent", "bytes sent, by peer", "peer", s.bytes_sent)
        yield labelled("neuronode_bytes_received", "bytes received, by peer", "peer", s.bytes_received)
        yield labelled("neuronode_refusals", "requests refused, by reason", "reason", s.refusals)
        yield counter("neuronode_bytes_relayed", "bytes forwarded between members nobody can dial", s.bytes_relayed)
        yield counter("neuronode_control_bytes_sent", "bytes of Hellos and their answers sent", s.control_bytes_sent)
        yield counter("neuronode_control_bytes_received", "bytes of Hellos and their answers received",
                      s.control_bytes_received)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def labelled(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(dict(values).items()):
        family.add_metric([key], value)
    return family


class Metrics:
    """The registry of one node; `serve()` exposes it over HTTP."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(NodeCollector(snapshot))
        self.sync_seconds = Histogram(
            "neuronode_sync_seconds", "seconds from our contribution being ready to the round closing",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=self.registry)

        self._server: Any = None

    def serve(self, host: str, port: int, *, api: dict[str, Source] | None = None,
              shows_addresses: bool = True) -> None:
        """/metrics, and the status page with its `api` documents, on host:port."""
        app = PageApp(metrics=make_wsgi_app(self.registry), api=api or {})
        try:
            self._server = serve(app, host, port)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror}); "
                              "choose a free port, or 0 to turn metrics off") from None
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        logger.info("metrics on http://%s/metrics, status page on http://%s/", where, where)
        if not is_loopback_host(host):
            logger.info("the status page and metrics on port %d can be reached from other machines (%s); the "
                        "page %s peers' addresses%s", port, host or "every address",
                        "shows" if shows_addresses else "hides",
                        "" if shows_addresses else " (--page-show-addresses shows them)",
                        extra=fields("page_public", host=host, port=port, addresses_shown=shows_addresses))

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()
