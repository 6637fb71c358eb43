"""A connection held to having a subscription (``Peer.hold_to``, for ``/v1/ws``), in plain calls.

protocol.md, Close codes: a socket that has held no subscription for its deadline (since it opened, or
since its last subscription ended) is closed with ``4408``; one that has had ``max_refusals`` messages
refused while it held none, with ``4429``; each after an error frame that says why, sent behind what was
queued before it. The driver's clock is a plain number here.
"""

from __future__ import annotations

import pytest

from gateway.errors import CLOSE_NO_SUBSCRIPTION, CLOSE_TOO_MANY_REFUSALS
from gateway.frames import PONG, error_frame
from tests.unit.fanout_play import Play

DEADLINE_S = 10.0


@pytest.fixture
def play() -> Play:
    play = Play()
    play.book.create("t")
    play.book.create("u")
    return play


def test_a_connection_that_holds_no_subscription_is_overdue_at_its_deadline(play: Play) -> None:
    peer = play.connect()
    peer.hold_to(100.0, DEADLINE_S, 5)
    assert not peer.idle_overdue(109.9)
    assert peer.idle_overdue(110.0)


def test_a_subscription_held_stops_the_deadline_and_the_last_one_ending_starts_it_again(play: Play) -> None:
    peer = play.connect()
    peer.hold_to(100.0, DEADLINE_S, 5)
    t = play.subscribe(peer, "t", 0)
    u = play.subscribe(peer, "u", 0)
    assert not peer.idle_overdue(1_000.0)
    play.fan.remove(t)
    peer.let_go(1_000.0)  # one left: still held
    assert not peer.idle_overdue(2_000.0)
    play.fan.remove(u)
    peer.let_go(2_000.0)  # none left: from now
    assert not peer.idle_overdue(2_009.9)
    assert peer.idle_overdue(2_010.0)
    peer.let_go(2_005.0)  # already counting: the deadline stays where it started
    assert peer.idle_overdue(2_010.0)


def test_a_subscription_being_authorized_or_resumed_counts_and_a_refused_one_does_not(play: Play) -> None:
    peer = play.connect()
    peer.hold_to(100.0, DEADLINE_S, 5)
    pending = play.fan.subscribe(peer, "t")  # its resume state is being read
    assert not peer.idle_overdue(200.0)
    play.fan.remove(pending)  # the read failed (an unknown task, say): it was never held
    peer.let_go(150.0)
    assert peer.idle_overdue(110.0)  # counted from the opening, not from the failed subscribe


def test_a_closing_or_closed_connection_is_not_overdue_again(play: Play) -> None:
    closing, closed = play.connect(), play.connect()
    for peer in (closing, closed):
        peer.hold_to(0.0, DEADLINE_S, 5)
    closing.close_after(error_frame("request-timeout", "idle"), CLOSE_NO_SUBSCRIPTION)
    closed.close(1001)
    assert not closing.idle_overdue(100.0) and not closed.idle_overdue(100.0)


def test_a_connection_not_held_has_no_deadline_and_counts_no_refusal(play: Play) -> None:
    peer = play.connect()  # SSE, the single-task socket
    assert not peer.idle_overdue(1e9)
    peer.let_go(5.0)
    assert not peer.idle_overdue(1e9)
    assert not any(peer.refused() for _ in range(10))


def test_the_nth_refusal_while_holding_none_closes_and_holding_one_resets_the_count(play: Play) -> None:
    peer = play.connect()
    peer.hold_to(0.0, DEADLINE_S, 3)
    assert [peer.refused(), peer.refused()] == [False, False]
    sub = play.subscribe(peer, "t", 0)
    assert not any(peer.refused() for _ in range(10))  # held: refusals are only errors
    play.fan.remove(sub)
    peer.let_go(1.0)
    assert [peer.refused() for _ in range(3)] == [False, False, True]  # counted afresh


def test_the_closing_frame_goes_after_what_was_queued_then_the_connection_ends(play: Play) -> None:
    peer = play.connect(direct=True, max_control=1)
    peer.hold_to(0.0, DEADLINE_S, 5)
    refusal = error_frame("unauthorized", "bad token", "t")
    assert peer.send_control(refusal)
    assert peer.control_full()
    why = error_frame("too-many-refusals", "closing")
    peer.close_after(why, CLOSE_TOO_MANY_REFUSALS)  # past max_control: it is the last frame
    peer.close_after(error_frame("request-timeout", "late"), CLOSE_NO_SUBSCRIPTION)  # the first stays
    assert not peer.quiet()  # nothing goes straight to the socket any more
    assert peer.next() == (None, refusal)
    assert peer.next() == (None, why)
    assert peer.close_code is None and peer.has_work()  # the end is still to come
    assert peer.next() is None
    assert peer.close_code == CLOSE_TOO_MANY_REFUSALS
    peer.close_after(PONG, CLOSE_NO_SUBSCRIPTION)  # closed: nothing more
    assert peer.next() is None and peer.control is None


def test_a_closing_with_nothing_queued_before_it(play: Play) -> None:
    peer = play.connect()
    peer.hold_to(0.0, DEADLINE_S, 5)
    why = error_frame("request-timeout", "idle")
    peer.close_after(why, CLOSE_NO_SUBSCRIPTION)
    assert peer.has_work()
    assert play.take(peer) == [(None, why)]
    assert peer.close_code == CLOSE_NO_SUBSCRIPTION
