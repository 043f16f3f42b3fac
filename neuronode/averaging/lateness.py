"""When a round stops waiting, and for whom: its cut, late senders and relays, late graces.

Rules (docs/protocol.md repeats them; neuronode.averaging.book applies them as it collects):
- The cut: once a strict majority of the round's hosts (neuronode.quorum voices, ours included)
  delivered, the round waits a grace more, the longest of GRACE x the timeout, the time that
  majority took since we began collecting, and the longest time one of the round's contributions
  took to stream in (it follows the contribution's size and the link rates measured). At the
  cut, a missing member whose stream to us is under way is still waited for (a slow uplink is
  slow, not late); one that other members list in their receipts as held (`reached`) is no
  longer waited for and is not late (its push was lost on our link: the caller fetches it if it
  counts, two listings, else every member leaves it out alike); any other is late. What a
  minority of hosts does cannot move the cut: it follows the majority.
- Late is late, however it is timed: a sender missing at a round's cut or deadline is late.
  Past the cut a stream is waited for while it moves (a chunk within the grace), so a stream
  that begins in time and stalls is late too. A round waits for a late sender only a bounded
  *late grace*: once every member that is not late delivered, LATE_GRACE x the time they took
  since the round began here (our previous round's close), never past the round's cut or
  deadline, and not while its stream merely moves; halved for each late grace in a row the
  sender missed. A late sender whose contribution arrives within it counts in the round, and is
  late no more (its next late grace is whole again). So a member behind the others by less than
  LATE_GRACE of a round (slower compute or link, or a round lost once: when the others closed
  without waiting for it, it started the next round behind them) gets back into the rounds at
  once, and one further behind gets closer by each late grace the others wait; while a member
  that delivers after it every round on purpose costs a round at most that late grace, and all
  rounds together at most twice the first. A late sender also stops being late when a
  contribution of its that began in time arrives whole (a slow link): by the end of the round's
  late grace (by the cut, if it fell late at that round's cut), a stream it begins for a round
  that closed without it (or that the round's close would cut off) runs to its end to show it,
  and is then dropped. Or when it comes back after it was gone (`forgive`).
- A member that refused our contribution to a round because it closed that round there
  (CLOSED_HERE: it went on without us) is not waited for in it (`left`): its own contribution
  to the round was made or given up already, and waiting for it cost a deadline per phase while
  it waited for us in its next round. Its word moves only itself.
- A relay's stall is charged to the relay (`via`: neuronode.swarm.links.relay forwards whole
  contributions it holds, so a relayed stream that stalls is the relay's doing): a maker whose
  relayed stream missed the cut or the deadline is not late; the relay is a late relay, and no
  stream it relays is waited for past a cut until one it relays, begun by a cut, arrives whole.

`Lateness` keeps plain fields only (ids, rounds, times); the book keeps the contributions.
"""

from __future__ import annotations

import logging
from typing import Any

from neuronode.clock import Clock
from neuronode.codec.contribution import Phase
from neuronode.events import fields

logger = logging.getLogger(__name__)

GRACE = 0.5  # the least a round waits past its majority (the cut), as a fraction of its timeout
LATE_GRACE = 0.5  # a late sender is waited for this fraction of the time the others took (module docstring)
CLOSED_HERE = "is closed here"  # what a refusal of a round the refusing member closed says (RoundClosed)


def cut_grace(timeout_s: float, waited_s: float, took_s: float = 0.0) -> float:
    """How long a wait goes on once a majority of hosts answered (the cut, module docstring):
    GRACE x its timeout, or as long as that majority took (`waited_s`), or as long as the
    slowest transfer that made it (`took_s`), whichever is longest."""
    return max(GRACE * timeout_s, waited_s, took_s)


class Lateness:
    """The cuts, late graces, late senders and late relays of one round book, per phase."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.late: set[tuple[Phase, str]] = set()
        self._missed: dict[tuple[Phase, str], int] = {}  # late graces a late sender missed in a row
        self.late_relays: set[tuple[Phase, str]] = set()  # relays that stalled a stream they carried
        self._via: dict[tuple[Phase, int, str], str] = {}  # the relay that carried a maker's stream of a round
        self._cuts: dict[tuple[Phase, int], float] = {}  # a round's cut, once known (module docstring)
        self._late_ends: dict[tuple[Phase, int], float] = {}  # when a round stopped waiting for late senders
        self._graces: dict[tuple[Phase, int], float] = {}  # and the grace it gave
        self._took: dict[tuple[Phase, int], float] = {}  # the longest a contribution took to stream in
        self._closed_at: dict[Phase, tuple[int, float]] = {}  # the last round closed, and when
        self._left: dict[tuple[Phase, int], set[str]] = {}  # members that closed a round without us

    def carried(self, phase: Phase, round_id: int, sender_id: str, via: str) -> None:
        """A stream of `sender_id`'s round begins, relayed by `via` ("": its maker sends it)."""
        if via:
            self._via[(phase, round_id, sender_id)] = via
        else:  # the latest stream of a maker's round says who carried it
            self._via.pop((phase, round_id, sender_id), None)

    def relay(self, phase: Phase, round_id: int, sender_id: str) -> str:
        """The member that relayed `sender_id`'s latest stream of the round ("" if it sent itself)."""
        return self._via.get((phase, round_id, sender_id), "")

    def owes_proof(self, phase: Phase, sender_id: str, via: str) -> bool:
        """Whether the sender, or the relay carrying its stream, is late in `phase`."""
        return (phase, sender_id) in self.late or (bool(via) and (phase, via) in self.late_relays)

    def may_prove(self, phase: Phase, round_id: int) -> bool:
        """Whether a late sender (or relay) may still begin a stream for `round_id`, closed, to
        show it was in time: until the end of the round's wait for late senders."""
        return self.clock.now() <= self._late_ends.get((phase, round_id), float("-inf"))

    def in_time(self, phase: Phase, round_id: int, began: float, late: bool) -> bool:
        """Whether a stream begun at `began` did so by its round's cut, or, from a late sender (or
        relay: `late`), by the end of the round's wait for late senders (any time before those are
        known)."""
        return began <= (self._late_ends if late else self._cuts).get((phase, round_id), float("inf"))

    def runs_on(self, phase: Phase, round_id: int, sender_id: str, began: float, late: bool) -> bool:
        """Whether a stream still arriving when its round closed is a late sender's stream begun
        in time: it runs to its end to show it (module docstring)."""
        late_now = self.owes_proof(phase, sender_id, self.relay(phase, round_id, sender_id))
        return late_now and self.in_time(phase, round_id, began, late)

    def arrived(self, phase: Phase, round_id: int, sender_id: str, *, began: float, late: bool, counts: bool) -> None:
        """A stream begun at `began` arrived whole: if in time, its sender (and the relay that
        carried it) is late no more. `counts`: its round is open, so the time it took is one its
        cut waits for (`took`)."""
        if self.in_time(phase, round_id, began, late):
            self._missed.pop((phase, sender_id), None)
            if (phase, sender_id) in self.late:
                self.late.discard((phase, sender_id))
                logger.info("round %d: %s delivered its %s in time: rounds wait for it again", round_id,
                            sender_id, phase.label, extra=fields("late_ended", round_id=round_id, peer_id=sender_id))
            self.late_relays.discard((phase, self.relay(phase, round_id, sender_id)))
        if counts:
            took = self._took.get((phase, round_id), 0.0)
            self._took[(phase, round_id)] = max(took, self.clock.now() - began)

    def took(self, phase: Phase, round_id: int) -> float:
        """The longest one of the round's contributions took to stream in here."""
        return self._took.get((phase, round_id), 0.0)

    def cut(self, phase: Phase, round_id: int, at: float, grace: float) -> None:
        """The round's cut is `at`, `grace` after a majority of its hosts delivered."""
        self._cuts[(phase, round_id)], self._graces[(phase, round_id)] = at, grace

    def grace(self, round_id: int, phase: Phase = Phase.WHOLE) -> float:
        """The grace `round_id`'s cut gave here (0.0 if it had none)."""
        return self._graces.get((phase, round_id), 0.0)

    def moving(self, phase: Phase, round_id: int, last_active: dict[str, float], now: float,
               grace: float) -> dict[str, float]:
        """Of the round's streams ({sender: when it last moved}), those waited for past its cut:
        moved within `grace`, and not carried by a late relay."""
        return {s: t for s, t in last_active.items()
                if (phase, self.relay(phase, round_id, s)) not in self.late_relays and now - t < grace}

    def missed_cut(self, phase: Phase, round_id: int, gone: set[str], skipped: set[str], *,
                   contributors: int, grace: float) -> None:
        """`gone` are not waited for past the round's cut: `skipped` (other members hold theirs)
        are fetched if they count and are not late; the others are (`mark_late`)."""
        relays = self.mark_late(phase, round_id, gone - skipped)
        if skipped:
            logger.info("round %d: not waiting for the pushes of %s: other members hold them; "
                        "fetching those that count", round_id, ", ".join(sorted(skipped)),
                        extra=fields("fetch_early", round_id=round_id, senders=sorted(skipped)))
        if gone - skipped:
            logger.warning("round %d: %s missed the round's cut (a majority of hosts delivered, and "
                           "the grace passed); they are late: rounds wait for them only a late grace until one "
                           "of their contributions arrives in time", round_id,
                           ", ".join(sorted(gone - skipped)),
                           extra=fields("cut", round_id=round_id, late=sorted(gone - skipped),
                                        contributors=contributors, grace_s=round(grace, 3), relays=relays))

    def mark_late(self, phase: Phase, round_id: int, senders: set[str]) -> dict[str, str]:
        """`senders` missed `round_id`'s cut or deadline: each is late, unless a relay carried
        its stream of the round, which then stalled it: the relay is charged (`late_relays`, module
        docstring), not the maker. Returns {maker: relay} for those."""
        relays = {s: via for s in senders if (via := self.relay(phase, round_id, s))}
        self.late |= {(phase, s) for s in senders - set(relays)}
        self.late_relays |= {(phase, via) for via in relays.values()}
        return relays

    def excused(self, phase: Phase) -> set[str]:
        """Late senders: a round of `phase` waits for them only its late grace (`late_grace`)."""
        return {sender for ph, sender in self.late if ph == phase}

    def late_grace(self, phase: Phase, round_id: int, senders: set[str], *, since: float) -> float:
        """How long a round waits for its late `senders` once every other member delivered
        (now): LATE_GRACE x the time those took since the round began here, our close of the
        round before (or `since`, when we began collecting, if we did not close that one),
        halved for each late grace in a row the least-missing of them missed."""
        last = self._closed_at.get(phase)
        began = last[1] if last is not None and last[0] == round_id - 1 else since
        missed = min(self._missed.get((phase, s), 0) for s in senders)
        return LATE_GRACE * max(0.0, self.clock.now() - began) / 2 ** missed

    def late_end(self, phase: Phase, round_id: int, end: float) -> None:
        """The round waits for its late senders until `end` (a stream they begin by then is in time)."""
        self._late_ends[(phase, round_id)] = end

    def missed_grace(self, phase: Phase, round_id: int, waiting: set[str], owed: set[str], *,
                     contributors: int, grace: float) -> None:
        """The round closes without its late senders `waiting`; those of them whose late grace
        it was (`owed`: late before the round) missed one more in a row."""
        for sender in waiting & owed:
            self._missed[(phase, sender)] = self._missed.get((phase, sender), 0) + 1
        logger.info("round %d: closing without %s: late, and not here within the late grace (%.1f s)",
                    round_id, ", ".join(sorted(waiting)), grace,
                    extra=fields("late_grace", round_id=round_id, late=sorted(waiting),
                                 contributors=contributors, grace_s=round(grace, 3)))

    def collected(self, phase: Phase, round_id: int, deadline: float) -> None:
        """The book collected `round_id`: a round with no cut had its deadline (a stream begun by
        then was in time); one that waited for no late sender ends that wait now."""
        self._cuts.setdefault((phase, round_id), deadline)
        self._late_ends.setdefault((phase, round_id), self.clock.now())

    def left(self, phase: Phase, round_id: int, member: str) -> None:
        """`member` refused our contribution to `round_id` as closed there (module docstring)."""
        self._left.setdefault((phase, round_id), set()).add(member)

    def gone(self, phase: Phase, round_id: int) -> set[str]:
        """Members not waited for in `round_id`: they closed it without us."""
        return self._left.get((phase, round_id), set())

    def closed(self, phase: Phase, round_id: int) -> None:
        """`round_id` closes now (the next round's late grace counts from here)."""
        self._closed_at[phase] = (round_id, self.clock.now())

    def forget_below(self, phase: Phase | None, below: int) -> None:
        """Drop the times of rounds below `below` (of `phase`, or all phases); a closed round's
        cut judges streams that begin after it closed, so the book keeps a window more."""
        kept: list[dict[Any, Any]] = [self._cuts, self._late_ends, self._graces, self._took, self._via, self._left]
        for old in kept:
            for key in [k for k in old if (phase is None or k[0] == phase) and k[1] < below]:
                del old[key]

    def forgive(self, sender_id: str) -> None:
        """`sender_id` is back after it was gone (a restart, a healed partition): wait for it again."""
        self.late_relays = {(phase, relay) for phase, relay in self.late_relays if relay != sender_id}
        self.late = {(phase, sender) for phase, sender in self.late if sender != sender_id}
        self._missed = {key: n for key, n in self._missed.items() if key[1] != sender_id}
