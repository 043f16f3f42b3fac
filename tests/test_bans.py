from __future__ import annotations

from neuronode.swarm.bans import Bans


def test_ban_after_strikes_and_backoff(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    clock = [1000.0]
    monkeypatch.setattr("neuronode.swarm.bans.time.monotonic", lambda: clock[0])
    bans = Bans(strikes_to_ban=3, window_s=10, first_ban_s=30, max_ban_s=100)
    bans.strike("x")
    bans.strike("x")
    assert bans.banned_for("x") == 0
    bans.strike("x")
    assert bans.banned_for("x") == 30
    assert bans.banned_for("y") == 0
    clock[0] += 31
    assert bans.banned_for("x") == 0
    for _ in range(3):
        bans.strike("x")
    assert bans.banned_for("x") == 60  # doubled
    clock[0] += 61
    for _ in range(3):
        bans.strike("x")
    assert bans.banned_for("x") == 100  # capped


def test_strikes_outside_window_do_not_count(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    clock = [0.0]
    monkeypatch.setattr("neuronode.swarm.bans.time.monotonic", lambda: clock[0])
    bans = Bans(strikes_to_ban=3, window_s=10)
    for _ in range(5):
        bans.strike("x")
        clock[0] += 6
    assert bans.banned_for("x") == 0
