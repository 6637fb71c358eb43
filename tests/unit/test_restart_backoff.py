"""The ``--workers`` supervisor's restart decision (``gateway.server.workers.RestartBackoff``): each worker
slot backs off on its own."""

from __future__ import annotations

from gateway.server.workers import RestartBackoff


def test_a_slot_that_keeps_dying_doubles_its_delay_up_to_the_cap() -> None:
    backoff = RestartBackoff(3, first_s=1, cap_s=8, stable_s=60)
    assert [backoff.after_exit(0, lived_s=0.5) for _ in range(6)] == [1, 2, 4, 8, 8, 8]


def test_other_slots_keep_their_own_first_delay() -> None:
    """Kills of different workers in a row: each is restarted after the first delay, whatever another slot
    has run up."""
    backoff = RestartBackoff(3, first_s=1, cap_s=30, stable_s=60)
    assert [backoff.after_exit(0, lived_s=1) for _ in range(4)] == [1, 2, 4, 8]
    assert backoff.after_exit(1, lived_s=1) == 1
    assert backoff.after_exit(2, lived_s=1) == 1
    assert backoff.after_exit(1, lived_s=1) == 2
    assert backoff.after_exit(0, lived_s=1) == 16


def test_a_slot_whose_child_lived_a_while_starts_over() -> None:
    backoff = RestartBackoff(2, first_s=1, cap_s=30, stable_s=60)
    assert [backoff.after_exit(0, lived_s=1) for _ in range(3)] == [1, 2, 4]
    assert backoff.after_exit(0, lived_s=60) == 1
    assert backoff.after_exit(0, lived_s=1) == 2
