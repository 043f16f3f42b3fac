"""A host is one member in the average: the ids of one host are combined into one contribution
before any aggregator sees them.

Ids are free (anyone with the swarm's secret makes as many keys as it likes), addresses are not.
So every aggregator counts hosts, never ids: `by_host` turns the round's contributions, by
sender id, into one contribution per host, and the aggregator (mean, norm-clip, trimmed-mean,
median, centered-clip, the cosine filter) runs over those. Norm-clip's median norm and its
opposed-minority rule, the median's and the trimmed mean's order statistics, centered-clip's
radius: all of them count a host once, however many ids it runs.

- A host's contribution is the weighted mean of its ids' (``average`` over them, in sorted id
  order), and it weighs what its ids claimed together, at most ``max_weight`` (the swarm's
  --max-weight: what one member may claim). Five ids on one address weigh what one member may.
- A host of one id passes through untouched: the same key (its id), the same source (decoded
  lazily, streamed), the same weight. Where every id is a host of its own (distinct addresses,
  or a swarm on one machine, where loopback counts per id), the result is bit for bit what the
  aggregator gives without this step.
- The key of a host of several ids is their ids, sorted, joined by a space (no id holds one).

Which ids share a host is the caller's `hosts` mapping (sender id -> host key). It must be the
same at every replica, or the replicas' averages differ: the averaging layer takes it from the
host each contribution's maker signed into it (neuronode.averaging.protocol says why that is
the same everywhere).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from neuronode.diloco.aggregate import Weighted, average

__all__ = ["HostMean", "by_host"]


class HostMean:
    """The weighted mean of one host's contributions, computed on first use and kept (the
    aggregators that pass over their members several times ask for it more than once)."""

    def __init__(self, members: Mapping[str, Weighted]) -> None:
        self.members = dict(members)
        self._mean: Tensor | None = None

    def __call__(self) -> Tensor:
        if self._mean is None:
            self._mean = average(self.members)
        return self._mean


def by_host(contributions: Mapping[str, Weighted], hosts: Mapping[str, str], *,
            max_weight: float = 0.0) -> dict[str, Weighted]:
    """One contribution per host (module docstring). `hosts` maps a sender id to its host key
    (an id it lacks is a host of its own); `max_weight` > 0 caps what one host weighs (0: no
    cap, a host weighs its ids' sum)."""
    groups: dict[str, list[str]] = {}
    for peer_id in sorted(contributions):
        groups.setdefault(hosts.get(peer_id, f"id:{peer_id}"), []).append(peer_id)
    out: dict[str, Weighted] = {}
    for ids in groups.values():
        total = 0.0
        for peer_id in ids:  # summed in sorted id order: the same float at every replica
            total += float(contributions[peer_id][1])
        weight = min(total, max_weight) if max_weight > 0 else total
        if len(ids) == 1:
            source, claimed = contributions[ids[0]]
            out[ids[0]] = (source, claimed if weight == claimed else weight)
        else:
            out[" ".join(ids)] = (HostMean({peer_id: contributions[peer_id] for peer_id in ids}), weight)
    return out
