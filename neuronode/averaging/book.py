"""Contributions kept per (phase, round), and the rule that closes a round.

Rules (docs/protocol.md repeats them):
- Round ids count completed rounds: the contribution made after k completed rounds is round k.
- Each phase (whole contributions, reduce-scatter slices, averaged shards) closes its rounds on
  its own: rounds below its `closed_below` are closed, and a contribution for them is refused
  and never mixed into a later round. Rounds at or beyond `closed_below + window` are too far
  ahead and refused; the ones in between are buffered, so a fast peer may send the next round
  before we finish this one.
- One contribution per sender, phase and round, within a lineage: a sender that repaired (it
  adopted the swarm's state) and runs a round again sends a contribution made from other
  parameters, which replaces the one it sent before while the round is open here (that one
  would count nowhere: only our lineage's contributions are averaged). A second one of the
  same lineage is refused (ALREADY_EXISTS).
- A round closes when every expected member's contribution has arrived, or at its *cut* (a
  grace after a strict majority of its hosts delivered), or at its deadline if at least
  `min_contributors` have; with fewer the node keeps waiting (one more deadline at a time).
- A contribution still arriving at the deadline is waited for while it keeps arriving (its
  stream sends a chunk at least every `idle_s`), one more timeout at most: on a slow link a
  contribution in flight is not left out (every member would leave it out alike, its maker
  too). One still streaming when its round closes is discarded: its stream is aborted and its
  buffer freed (`abort` callbacks), as is a stream that sent no chunk for `idle_s` (`expire`).
- The cut, and who is late (a sender missing at a round's cut or deadline; a round waits for
  it only a bounded late grace, until one of its contributions arrives in time; a relay's stall
  is charged to the relay): neuronode.averaging.lateness, whose rules this book applies.

Memory (`buffered_bytes`): every stream reserves its whole payload (in its encoded form, P x
bytes-per-parameter of its codec, or one shard of it) when it opens, and keeps it until its round
closes or the stream is discarded. A sender holds at most `max_sender_bytes` at once, so the
book holds at most that times the number of live members (docs/protocol.md gives the formula).

The book is also the node's change signal: the transport calls `notify()` when membership
changes (a peer joined, left, moved to another round, published a receipt), so every wait here
and in the averaging protocols wakes up and re-evaluates its rule.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from neuronode.averaging.lateness import CLOSED_HERE, Lateness, cut_grace
from neuronode.clock import Clock
from neuronode.codec.contribution import Contribution, Phase
from neuronode.events import fields
from neuronode.quorum import VoiceOf, by_id, majority

logger = logging.getLogger(__name__)

Lineage = tuple[str, tuple[str, ...]]  # (base_digest, members): Contribution.lineage


class RoundRefused(Exception):
    """Base for contributions a round cannot take; `code` names the gRPC status to answer."""

    code = "FAILED_PRECONDITION"


class RoundClosed(RoundRefused):
    pass


class RoundTooFar(RoundRefused):
    pass


class DuplicateContribution(RoundRefused):
    code = "ALREADY_EXISTS"


class BufferFull(RoundRefused):
    code = "RESOURCE_EXHAUSTED"


Abort = Callable[[str], None]  # stops one stream (a reason a person can read)


@dataclass
class Stream:
    """A contribution still streaming in: its reservation and when it last moved."""

    reserved_bytes: int
    last_active: float
    abort: Abort | None = None
    began: float = 0.0
    late: bool = False  # its sender (or the relay carrying it) was late when it began


class RoundBook:
    """Per-(phase, round) contribution store with deadline-bounded collection."""

    def __init__(self, *, first_round: int, window: int = 2, clock: Clock | None = None,
                 max_sender_bytes: int = 0, idle_s: float = 60.0) -> None:
        self.window = window
        self.clock = clock or Clock()
        self.max_sender_bytes = max_sender_bytes  # 0: unbounded (in-process swarms, tests)
        self.idle_s = idle_s
        self._closed_below = {phase: first_round for phase in Phase}
        self._complete: dict[tuple[Phase, int], dict[str, Contribution]] = {}
        self._streaming: dict[tuple[Phase, int, str], Stream] = {}
        self._held: dict[tuple[Phase, int, str], int] = {}  # complete contributions' reservations
        self._by_sender: dict[str, int] = {}
        self.lateness = Lateness(self.clock)  # the cuts, late graces, late senders and relays
        self._changed = asyncio.Event()

    @property
    def buffered_bytes(self) -> int:
        """Bytes reserved by streams in flight and complete contributions not yet taken."""
        return sum(self._by_sender.values())

    def senders(self) -> set[str]:
        """Members holding a reservation here now."""
        return set(self._by_sender)

    def sender_bytes(self, sender_id: str) -> int:
        return self._by_sender.get(sender_id, 0)

    def _reserve(self, sender_id: str, nbytes: int) -> None:
        self._by_sender[sender_id] = self._by_sender.get(sender_id, 0) + nbytes

    def _release(self, sender_id: str, nbytes: int) -> None:
        left = self._by_sender.get(sender_id, 0) - nbytes
        if left > 0:
            self._by_sender[sender_id] = left
        else:
            self._by_sender.pop(sender_id, None)

    def closed_below(self, phase: Phase = Phase.WHOLE) -> int:
        return self._closed_below[phase]

    def check_open(self, round_id: int, sender_id: str, phase: Phase = Phase.WHOLE,
                   lineage: Lineage | None = None) -> None:
        """Raise a RoundRefused if `sender_id` may not contribute to `round_id` now. A complete
        contribution of another `lineage` (made from other parameters: the sender repaired and
        runs the round again) does not hold its slot: `begin` replaces it."""
        below = self._closed_below[phase]
        if round_id < below:
            raise RoundClosed(
                f"round {round_id} {CLOSED_HERE} (this node is at round {below}); "
                "late contributions are never mixed into another round")
        if round_id >= below + self.window:
            raise RoundTooFar(
                f"round {round_id} is too far ahead (this node is at round {below}, "
                f"buffers {self.window} rounds); the sender must catch its peers up first")
        held = self._complete.get((phase, round_id), {}).get(sender_id)
        if (held is not None and (lineage is None or held.lineage == lineage)) or (phase, round_id, sender_id) in self._streaming:
            raise DuplicateContribution(f"round {round_id} already has a contribution from {sender_id}")

    def begin(self, round_id: int, sender_id: str, phase: Phase = Phase.WHOLE, *,
              reserved_bytes: int = 0, abort: Abort | None = None, lineage: Lineage | None = None,
              via: str = "") -> None:
        """Open a stream's slot, reserving `reserved_bytes` (its whole payload); `abort` is
        called if the round closes, or the stream idles, before it finishes. A contribution of
        `lineage` replaces one of another lineage the sender sent before (module docstring).
        `via`: the member relaying it, "" when the maker sends it itself (a relay's stalls are
        charged to it, not to the maker). A late sender (or relay) may stream for a round that
        closed without waiting for it, if it begins by that round's cut: its stream runs to its
        end to show it was in time (`finish` then drops it), else RoundClosed."""
        late = self.lateness.owes_proof(phase, sender_id, via)
        proof = round_id < self._closed_below[phase] and late and self.lateness.may_prove(phase, round_id)
        if not proof:
            self.check_open(round_id, sender_id, phase, lineage)
        elif (phase, round_id, sender_id) in self._streaming:
            raise DuplicateContribution(f"round {round_id} already has a contribution from {sender_id}")
        old = self._complete.get((phase, round_id), {}).pop(sender_id, None)
        if old is not None:
            self._release(sender_id, self._held.pop((phase, round_id, sender_id), 0))
            logger.info("round %d: %s sends its %s again, made from other parameters (it repaired); it "
                        "replaces the one it sent before", round_id, sender_id, phase.label,
                        extra=fields("contribution_replaced", round_id=round_id, peer_id=sender_id))
        held = self.sender_bytes(sender_id)
        if self.max_sender_bytes and held + reserved_bytes > self.max_sender_bytes:
            raise BufferFull(f"round {round_id}: {sender_id} already has {held} bytes buffered here (at most "
                             f"{self.max_sender_bytes} per member); send the next contribution once a round closed")
        self._streaming[(phase, round_id, sender_id)] = Stream(reserved_bytes, self.clock.now(), abort, self.clock.now(),
                                                               late)
        self.lateness.carried(phase, round_id, sender_id, via)
        self._reserve(sender_id, reserved_bytes)

    def touch(self, round_id: int, sender_id: str, phase: Phase = Phase.WHOLE) -> None:
        """A chunk of the stream arrived: it is not idle."""
        stream = self._streaming.get((phase, round_id, sender_id))
        if stream is not None:
            stream.last_active = self.clock.now()

    def abort(self, round_id: int, sender_id: str, phase: Phase = Phase.WHOLE) -> None:
        """Forget a stream that ended without finishing (its reservation is freed)."""
        stream = self._streaming.pop((phase, round_id, sender_id), None)
        if stream is not None:
            self._release(sender_id, stream.reserved_bytes)
            self.notify()  # a collector past the round's cut stops waiting for it

    def finish(self, contribution: Contribution) -> None:
        """Store a complete contribution whose stream `begin` opened."""
        c = contribution
        key = (c.phase, c.round_id, c.sender_id)
        stream = self._streaming.pop(key, None)
        reserved = stream.reserved_bytes if stream is not None else 0
        closed = c.round_id < self._closed_below[c.phase]
        if stream is not None:  # in time, its sender is late no more; its time feeds the round's cut
            self.lateness.arrived(c.phase, c.round_id, c.sender_id, began=stream.began, late=stream.late,
                                  counts=not closed)
        if closed:
            self._release(c.sender_id, reserved)
            raise RoundClosed(f"round {c.round_id} closed while the contribution streamed")
        self._complete.setdefault((c.phase, c.round_id), {})[c.sender_id] = c
        self._held[key] = reserved
        self.notify()

    def expire(self) -> int:
        """Abort streams that sent nothing for `idle_s`; how many were aborted."""
        now = self.clock.now()
        idle = [(k, s) for k, s in self._streaming.items() if now - s.last_active >= self.idle_s]
        for (phase, round_id, sender), stream in idle:
            self._stop(phase, round_id, sender, stream, f"no chunk for {self.idle_s:.0f} s")
        return len(idle)

    def _stop(self, phase: Phase, round_id: int, sender_id: str, stream: Stream, why: str) -> None:
        self.abort(round_id, sender_id, phase)
        if stream.abort is not None:
            stream.abort(f"round {round_id}: {phase.label} stream from {sender_id} aborted: {why}")

    def _discard_below(self, phase: Phase | None, below: int) -> None:
        """Drop what is buffered for rounds below `below` (of `phase`, or all phases)."""
        self.lateness.forget_below(phase, below - self.window)  # a closed round's cut judges later streams
        for key in [k for k in self._complete if (phase is None or k[0] == phase) and k[1] < below]:
            for sender in self._complete.pop(key):
                self._release(sender, self._held.pop((key[0], key[1], sender), 0))
        for (ph, round_id, sender), stream in list(self._streaming.items()):
            if (phase is None or ph == phase) and round_id < below:
                if self.lateness.runs_on(ph, round_id, sender, stream.began, stream.late):
                    continue  # a late sender's stream begun in time: it runs to its end (`begin`)
                self._stop(ph, round_id, sender, stream, "its round closed before it finished")

    def add_own(self, contribution: Contribution) -> None:
        c = contribution
        self._complete.setdefault((c.phase, c.round_id), {})[c.sender_id] = c
        self.notify()

    def contributors(self, round_id: int, phase: Phase = Phase.WHOLE) -> set[str]:
        return set(self._complete.get((phase, round_id), {}))

    def changed(self) -> asyncio.Event:
        """Set at the next notify(): take it before evaluating a rule, then wait on it."""
        return self._changed

    def notify(self) -> None:
        """Wake collectors: a contribution arrived or membership changed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def collect(
        self, round_id: int, *, phase: Phase = Phase.WHOLE, expected: Callable[[], set[str]], timeout_s: float,
        min_contributors: int = 1, on_extend: Callable[[], None] | None = None,
        moved_past: Callable[[], bool] = lambda: False,
        fetchable: Callable[[], set[str]] = set, reached: Callable[[], set[str]] | None = None,
        voice: VoiceOf = by_id,
    ) -> dict[str, Contribution]:
        """Wait until every expected sender contributed, the round's cut, or the deadline (the
        module docstring); then close the round. `fetchable()`: senders whose contributions other
        members hold (their receipts say so), which we will fetch: they count toward
        `min_contributors`. `reached()` (default `fetchable`): senders whose contributions reached
        other members: at the cut, they are not waited for and not late. `voice`: the host of a
        member, for the majority the cut follows. `moved_past()`: the swarm went on past this round
        (a quorum of the other hosts): the deadline closes it, however few contributed."""
        opened = self.clock.now()
        deadline = opened + timeout_s
        late_before = self.lateness.excused(phase)  # whose late grace this round is (not those late at its cut)
        cut: float | None = None
        grace = 0.0
        late_until: float | None = None  # the end of the late grace, once every punctual member delivered
        late_s = 0.0
        said = False
        while True:
            changed = self._changed
            have = self.contributors(round_id, phase)
            members = expected()
            missing = members - have - self.lateness.excused(phase) - self.lateness.gone(phase, round_id)
            now, wake = self.clock.now(), deadline
            if cut is None:
                if majority(have, members | have, voice):
                    grace = cut_grace(timeout_s, now - opened, self.lateness.took(phase, round_id))
                    cut = now + grace
                    self.lateness.cut(phase, round_id, cut, grace)
            held = fetchable() if len(have) < min_contributors else set()
            counted = have if len(have) >= min_contributors else have | held
            if cut is not None and missing:
                if now >= cut:  # past it, a stream is waited for while it moves (not through a late relay)
                    moving = self.lateness.moving(phase, round_id, {s: st.last_active for (ph, r, s), st in
                                                                    self._streaming.items() if ph == phase and r == round_id},
                                                  now, grace)
                    gone = missing - set(moving)
                    skipped = gone & (reached or fetchable)()  # its push to us was lost: not late
                    self.lateness.missed_cut(phase, round_id, gone, skipped, contributors=len(have), grace=grace)
                    missing -= gone
                    if missing:  # look again when the stalest of them would have stalled for a grace
                        wake = min(deadline, min(moving[s] for s in missing) + grace)
                else:
                    wake = min(deadline, cut)
            if not missing and len(counted) >= min_contributors:
                waiting = (members - have) & self.lateness.excused(phase)
                if not waiting:
                    break
                if late_until is None:
                    late_s = self.lateness.late_grace(phase, round_id, waiting, since=opened)
                    late_until = now + late_s
                end = min(late_until, deadline, cut if cut is not None else deadline)
                self.lateness.late_end(phase, round_id, end)
                if now >= end:
                    self.lateness.missed_grace(phase, round_id, waiting, late_before, contributors=len(have), grace=late_s)
                    break
                await self.clock.wait(changed, end - now)
                continue
            arriving = missing & {s for ph, r, s in self._streaming if ph == phase and r == round_id}
            if now >= deadline and arriving and now < deadline + timeout_s:
                if not said:
                    said = True
                    logger.info("round %d: deadline passed while the contributions of %s are still arriving; "
                                "waiting for them while they move", round_id, ", ".join(sorted(arriving)),
                                extra=fields("in_flight", round_id=round_id, senders=sorted(arriving)))
                await self.clock.wait(changed, deadline + timeout_s - now)
                continue
            if now >= deadline:
                # Missing at a deadline: late, whether we close now or wait on for --min-peers.
                relays = self.lateness.mark_late(phase, round_id, missing)
                if len(counted) >= min_contributors:
                    logger.warning("round %d: deadline passed without %s; closing with %d contributors "
                                   "(they are late: rounds wait for them only a late grace until one of their contributions "
                                   "arrives in time)",
                                   round_id, ", ".join(sorted(missing)), len(have),
                                   extra=fields("deadline", round_id=round_id, missing=sorted(missing), contributors=len(have),
                                                relays=relays))
                    break
                if moved_past():
                    logger.warning("round %d: %d of --min-peers %d contributors, but a quorum of the other hosts "
                                   "went on past this round; closing it (we catch up at the next round's start)",
                                   round_id, len(have), min_contributors,
                                   extra=fields("swarm_moved_on", round_id=round_id, contributors=len(have)))
                    break
                logger.warning("round %d: %d of --min-peers %d contributors; waiting %.0f s more",
                               round_id, len(have), min_contributors, timeout_s,
                               extra=fields("waiting_for_peers", round_id=round_id))
                deadline = now + timeout_s
                if on_extend is not None:
                    on_extend()  # keep pushing our contribution to peers that join meanwhile
                wake = deadline
            await self.clock.wait(changed, wake - now)
        self.lateness.collected(phase, round_id, deadline)
        return self.close(round_id, phase)

    def close(self, round_id: int, phase: Phase = Phase.WHOLE) -> dict[str, Contribution]:
        """Close `round_id` of `phase` (and everything before it); return its contributions."""
        self._closed_below[phase] = max(self._closed_below[phase], round_id + 1)
        self.lateness.closed(phase, round_id)
        result = self._complete.pop((phase, round_id), {})
        for sender in result:  # the caller holds them now
            self._release(sender, self._held.pop((phase, round_id, sender), 0))
        self._discard_below(phase, self._closed_below[phase])
        return result

    def advance(self, first_round: int) -> None:
        """Rounds below `first_round` were applied without collecting them here (the node caught
        up by rounds): close them, in every phase still below (never reopening one)."""
        for phase in Phase:
            if self._closed_below[phase] < first_round:
                self._closed_below[phase] = first_round
                self._discard_below(phase, first_round)

    def reset(self, first_round: int) -> None:
        """Jump to another round (after a state transfer): drop everything buffered before it."""
        self._closed_below = dict.fromkeys(Phase, first_round)
        self._discard_below(None, first_round)


def same_lineage(got: dict[str, Contribution], lineage: tuple[str, tuple[str, ...]]) -> dict[str, Contribution]:
    """Only contributions made from the same parameters, for the same members, are averaged."""
    kept = {k: c for k, c in got.items() if c.lineage == lineage}
    for sender in sorted(set(got) - set(kept)):
        c = got[sender]
        logger.warning("round %d: not averaging %s's %s: it was made from other parameters or "
                       "another membership; the repair rule will reconcile us", c.round_id, sender,
                       c.phase.label, extra=fields("other_lineage", round_id=c.round_id, peer_id=sender))
    return kept


def majority_lineage(got: dict[str, Contribution], base_digest: str | None,
                     voice_of: VoiceOf = by_id) -> dict[str, Contribution]:
    """A round we listen to: contributions made from `base_digest` (the parameters we hold for
    its start; a member claiming another start counts nowhere), or with None from the start
    the senders of most hosts share (neuronode.quorum); for the membership most of them name
    (reduce-scatter)."""
    hosts: dict[tuple[str, tuple[str, ...]], set[str]] = {}
    for c in got.values():
        if base_digest is None or c.base_digest == base_digest:
            hosts.setdefault(c.lineage, set()).add(voice_of(c.sender_id))
    best = min(hosts, key=lambda k: (-len(hosts[k]), k)) if hosts else (base_digest or "", ())
    return same_lineage(got, best)
