"""Who makes a round's contributions under `--averaging gather`, and how each one spreads. Pure.

Every member trains every round; a round averages the contributions of at most K makers
(`--gather-makers`), so what a member receives, sends and computes per round does not grow with
the swarm. The rest carry their pseudo-gradient to a later round in error feedback
(neuronode.codec.ContributionEncoder.carry).

**The makers.** A member's ticket for a round is a hash of the round's seed and its id; the
seed is the parameters the round starts from (`base_digest`: every replica holds them, nobody
knows them before the previous round closed, and no member chooses them alone). The makers are
the K members with the lowest tickets (`makers`), worked out by each member over the members
it knows; in a swarm of at most K every member is one (all-to-all). What a round averages is
then decided from the makers' receipts (neuronode.averaging.agreement), and of what they agree
on only the K lowest tickets count (`lowest`): a pure function of the agreed statements, so every
replica keeps the same ones whatever its own view of the swarm, and a member whose ticket is
not among the K lowest of the swarm cannot get in by sending anyway.

**Spreading.** A maker sends its contribution to `fanout` members; each receiver forwards it to
its own `fanout` (`children`), down a tree of depth log_fanout(N), so nobody uploads N copies.
The tree of maker m is the members ranked by ticket, rotated to start at an offset of m's own
(m's rank among the makers × N / K), with m at its root: the members that forward (the first
N / fanout after the root) differ from one maker's tree to the next, so with fanout = K each
member forwards for about one maker a round, K copies, and receives each maker's contribution
once. Members whose views differ compute slightly different trees; what one misses, it fetches
from a member whose receipt lists it (neuronode.averaging.protocol.Averaging.agree).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from neuronode.config import NodeConfig

DEFAULT_MAKERS = NodeConfig.gather_makers  # swarms of at most this many average everyone, as all-to-all does


def round_seed(round_id: int, base_digest: str) -> str:
    """What a round's tickets are drawn from: its id and the parameters it starts from."""
    return f"{round_id}:{base_digest}"


def ticket(seed: str, member: str) -> bytes:
    """`member`'s ticket for the round of `seed` (lower goes first)."""
    return hashlib.blake2b(f"{seed}\n{member}".encode(), digest_size=8).digest()


def ranked(seed: str, members: Iterable[str]) -> list[str]:
    """`members` by ticket, then id (one hash each: a draw sorts every member it knows)."""
    prefix = f"{seed}\n".encode()
    blake2b = hashlib.blake2b

    def key(m: str) -> bytes:
        name = m.encode()
        return blake2b(prefix + name, digest_size=8).digest() + name

    return sorted(members, key=key)


@dataclass(frozen=True)
class Draw:
    """One round's order of the members a member knows: by ticket, then id."""

    seed: str
    order: tuple[str, ...]
    k: int  # makers a round averages at most

    @functools.cached_property
    def index(self) -> dict[str, int]:
        return {m: i for i, m in enumerate(self.order)}

    @property
    def makers(self) -> tuple[str, ...]:
        """The K members with the lowest tickets, in ticket order."""
        return self.order[:self.k]

    def children(self, maker: str, me: str, fanout: int) -> list[str]:
        """Where `me` sends (or forwards) `maker`'s contribution: our children in its tree
        (module docstring); [] for a member we do not know or a leaf."""
        tree = self.tree(maker)
        if tree is None or me not in self.index:
            return []
        n = len(self.order)
        if me == maker:
            position = 0
        else:
            start, offset = tree
            # position among the others (the order without the maker), counted from the offset
            rank = self.index[me] - (self.index[me] > self.index[maker])
            position = 1 + (rank - offset) % (n - 1)
        first = position * fanout + 1
        return [self.at(maker, p) for p in range(first, min(first + fanout, n))]

    def tree(self, maker: str) -> tuple[int, int] | None:
        """(maker's index, the offset its tree starts the others at), or None if unknown."""
        at = self.index.get(maker)
        if at is None or len(self.order) < 2:
            return None
        n = len(self.order)
        stride = max(1, (n - 1) // max(1, min(self.k, n)))
        return at, (min(at, self.k - 1) * stride) % (n - 1)

    def at(self, maker: str, position: int) -> str:
        """The member at `position` (1 ..) of `maker`'s tree."""
        tree = self.tree(maker)
        assert tree is not None and position >= 1
        at, offset = tree
        n = len(self.order)
        rank = (offset + position - 1) % (n - 1)  # among the others
        return self.order[rank + (rank >= at)]


def draw(round_id: int, base_digest: str, members: Iterable[str], k: int) -> Draw:
    """The order of `members` for a round (its seed from `round_id` and `base_digest`)."""
    seed = round_seed(round_id, base_digest)
    return Draw(seed=seed, order=tuple(ranked(seed, set(members))), k=k)


class Draws:
    """A member's draws of its latest rounds. The round's own draw (its makers, our children as a
    maker) is made once, when it prepares (`get`); a tree we forward down follows our view of
    the members as it is when each contribution arrives (`current`), redrawn only when that
    view changed: a draw made before we knew every member would send to the wrong children for
    the rest of the round."""

    KEEP = 4

    def __init__(self, k: int) -> None:
        self.k = k
        self._by_seed: dict[str, Draw] = {}
        self._current: dict[str, tuple[frozenset[str], Draw]] = {}

    def get(self, round_id: int, base_digest: str, members: Callable[[], Iterable[str]]) -> Draw:
        seed = round_seed(round_id, base_digest)
        got = self._by_seed.get(seed)
        if got is None:
            got = self._by_seed[seed] = draw(round_id, base_digest, members(), self.k)
            while len(self._by_seed) > self.KEEP:
                del self._by_seed[next(iter(self._by_seed))]
        return got

    def current(self, round_id: int, base_digest: str, members: Iterable[str]) -> Draw:
        seed, view = round_seed(round_id, base_digest), frozenset(members)
        held = self._current.get(seed)
        if held is None or held[0] != view:
            held = self._current[seed] = (view, draw(round_id, base_digest, view, self.k))
            while len(self._current) > self.KEEP:
                del self._current[next(iter(self._current))]
        return held[1]


def lowest(senders: Iterable[str], seed: str, k: int) -> set[str]:
    """Of `senders` (whose contributions a round agreed on), the `k` with the lowest tickets."""
    return set(ranked(seed, senders)[:k])
