"""The keep-alive wheel (``gateway.server.keepalive``) on a clock of the test's own: one loop timer for any
number of connections, each pinged once an interval, one whose pong is an interval late timed out, one
that answers in time never."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from gateway.server.keepalive import TICK_S, KeepaliveWheel, Pinged, wheel_for

INTERVAL_S = 20.0
BUCKETS = 20  # a coarse wheel, so that a test's hand can follow it
STEP_S = INTERVAL_S / BUCKETS


class FakeTimer:
    def __init__(self, loop: FakeLoop, when: float, callback: Any) -> None:
        self.loop, self.when, self.callback, self.cancelled = loop, when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """``time`` and ``call_at``: what the wheel uses of its loop; time moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.timers: list[FakeTimer] = []
        self.timers_made = 0

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any) -> FakeTimer:
        timer = FakeTimer(self, when, callback)
        self.timers.append(timer)
        self.timers_made += 1
        return timer

    def pending(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled]

    def advance(self, seconds: float) -> None:
        """Run every timer due up to ``seconds`` from now, in order, each at its time."""
        end = self.now + seconds
        while True:
            due = sorted((t for t in self.pending() if t.when <= end + 1e-9), key=lambda t: t.when)
            if not due:
                break
            timer = due[0]
            self.timers.remove(timer)
            self.now = max(self.now, timer.when)
            timer.callback()
        self.now = end


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False
        self.aborted = False

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str) -> None:  # no socket: drop() only aborts
        return None

    def abort(self) -> None:
        self.aborted = self.closing = True

    def write(self, data: bytes) -> None:
        self.written.append(data)


class FakeConnection:
    """The parts of uvicorn's protocol the wheel touches; ``pong`` is what uvicorn's ``handle_pong`` does."""

    def __init__(self, loop: FakeLoop) -> None:
        self.loop = loop
        self.keepalive_bucket: dict[Pinged, None] | None = None
        self.pending_ping_payload: bytes | None = None
        self.ping_sent_at = 0.0
        self.close_sent = False
        self.disconnected = False
        self.fake_transport = FakeTransport()
        self.transport = cast(asyncio.Transport, self.fake_transport)
        self.timed_out_at: float | None = None
        self.pinged_at: list[float] = []

    @property
    def pings(self) -> list[bytes]:
        return self.fake_transport.written

    def keepalive_timeout(self) -> None:
        self.timed_out_at = self.loop.now
        self.pending_ping_payload = None
        self.close_sent = True

    def pong(self, data: bytes | None = None) -> None:
        """Answer the last ping (or send a pong with ``data``)."""
        if data is None:
            data = self.pings[-1][2:]
        if self.pending_ping_payload is not None and data == self.pending_ping_payload:
            self.pending_ping_payload = None


def wheel(loop: FakeLoop) -> KeepaliveWheel:
    return KeepaliveWheel(cast(asyncio.AbstractEventLoop, loop), INTERVAL_S, BUCKETS)


def join(w: KeepaliveWheel, loop: FakeLoop, count: int) -> list[FakeConnection]:
    made = [FakeConnection(loop) for _ in range(count)]
    for c in made:
        w.join(c)
    return made


def test_many_connections_share_one_timer_and_each_is_pinged_once_an_interval() -> None:
    loop = FakeLoop()
    w = wheel(loop)
    conns = join(w, loop, 50)
    loop.advance(STEP_S * 7.5)  # joined at different places of the wheel
    conns += join(w, loop, 50)
    assert len(loop.pending()) == 1 and len(w) == 100
    for _ in range(4):
        for c in conns:
            c.pings.clear()
        loop.advance(INTERVAL_S)
        for c in conns:
            assert len(c.pings) == 1, "one ping an interval"
            frame = c.pings[0]
            assert frame[:2] == b"\x89\x04" and len(frame) == 6  # unmasked ping, 4 bytes of payload
            assert c.pending_ping_payload == frame[2:]
            c.pong()
        assert len(loop.pending()) == 1
    assert all(c.timed_out_at is None for c in conns)
    # One timer at a time, one a tick: not one per connection.
    assert loop.timers_made <= 4 * BUCKETS + 9


def test_the_first_ping_comes_within_an_interval_of_joining_and_not_much_sooner() -> None:
    loop = FakeLoop()
    w = wheel(loop)
    loop.advance(3.3)
    joined = loop.now
    (c,) = join(w, loop, 1)
    loop.advance(STEP_S * 0.4)
    (d,) = join(w, loop, 1)  # the wheel is turning now
    d_joined = loop.now
    loop.advance(INTERVAL_S - STEP_S * 0.5)
    assert not c.pings and not d.pings
    loop.advance(STEP_S * 0.1)
    for conn, at in ((c, joined), (d, d_joined)):
        assert len(conn.pings) == 1
        assert INTERVAL_S - STEP_S < conn.ping_sent_at - at <= INTERVAL_S + 1e-9


def test_a_connection_whose_pong_is_an_interval_late_is_timed_out_and_one_just_in_time_is_not() -> None:
    loop = FakeLoop()
    w = wheel(loop)
    silent, late, stale = join(w, loop, 3)
    loop.advance(INTERVAL_S)
    pinged_at = silent.ping_sent_at
    first = stale.pings[-1][2:]
    loop.advance(INTERVAL_S - STEP_S / 2)  # not yet an interval since the ping: nobody is dropped
    assert silent.timed_out_at is None and late.timed_out_at is None
    late.pong()  # just in time
    stale.pong(b"\x00\x00\x00\x00")  # a pong to no ping of ours does not count
    loop.advance(STEP_S)
    assert silent.timed_out_at == pinged_at + INTERVAL_S  # the deadline is exactly one interval
    assert stale.timed_out_at == pinged_at + INTERVAL_S
    assert late.timed_out_at is None and len(late.pings) == 2
    assert len(w) == 1  # the timed-out ones left the wheel
    # The next ping's payload is another: a pong repeating the first one does not answer it.
    assert late.pings[-1][2:] != first
    late.pong(first)
    loop.advance(INTERVAL_S)
    assert late.timed_out_at is not None
    assert len(w) == 0 and not loop.pending()  # the wheel stops its timer when empty


def test_connections_that_leave_or_close_are_not_pinged_and_the_timer_stops_with_the_last() -> None:
    loop = FakeLoop()
    w = wheel(loop)
    gone, closing, closed, sent_close, stays = join(w, loop, 5)
    w.join(stays)  # joining twice is once
    assert len(w) == 5
    w.leave(gone)
    w.leave(gone)
    closing.fake_transport.closing = True
    closed.disconnected = True
    sent_close.close_sent = True
    loop.advance(INTERVAL_S)
    assert [len(c.pings) for c in (gone, closing, closed, sent_close, stays)] == [0, 0, 0, 0, 1]
    assert len(w) == 1 and len(loop.pending()) == 1
    w.leave(stays)
    assert len(w) == 0 and not loop.pending() and not w.running
    again = FakeConnection(loop)
    w.join(again)  # a wheel that stopped starts again
    loop.advance(INTERVAL_S)
    assert len(again.pings) == 1


def test_a_connection_whose_ping_fails_is_dropped_and_the_others_are_still_pinged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = FakeLoop()
    w = wheel(loop)
    conns = join(w, loop, 3)

    def broken(data: bytes) -> None:
        raise RuntimeError("transport gone wrong")

    conns[1].fake_transport.write = broken  # type: ignore[method-assign]
    for _ in range(3):
        loop.advance(INTERVAL_S)
        for c in (conns[0], conns[2]):
            c.pong()
    assert len(conns[0].pings) == len(conns[2].pings) == 3
    assert conns[1].keepalive_bucket is None and len(w) == 2 and len(loop.pending()) == 1
    assert conns[1].fake_transport.aborted, "not pinged any more: dropped, not left open unwatched"
    assert not conns[0].fake_transport.aborted and not conns[2].fake_transport.aborted
    assert "pinging a WebSocket failed" in caplog.text


def test_a_stalled_loop_does_not_run_the_missed_ticks_in_a_burst() -> None:
    loop = FakeLoop()
    w = wheel(loop)
    join(w, loop, 1)
    timer = loop.pending()[0]
    loop.now += 10 * STEP_S  # the loop was busy: the tick runs late
    loop.timers.remove(timer)
    timer.callback()
    (following,) = loop.pending()
    assert following.when >= loop.now


def test_each_loop_and_interval_has_a_wheel_of_its_own() -> None:
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        a = wheel_for(first, 20.0)
        assert a is not None and wheel_for(first, 20.0) is a
        assert wheel_for(first, 0.3) not in (None, a)
        assert wheel_for(second, 20.0) not in (None, a)
        fine = wheel_for(first, 1.0)  # a tick every TICK_S, whatever the interval
        assert fine is not None and a.tick_s == pytest.approx(TICK_S) == fine.tick_s
    finally:
        first.close()
        second.close()


def test_the_protocol_falls_back_to_uvicorns_timers_unless_the_timeout_is_the_interval() -> None:
    from gateway.server.ws_protocol import GatewayWebSocketProtocol

    loop = asyncio.new_event_loop()
    try:
        made = []
        for interval, timeout in ((20.0, 20.0), (20.0, 5.0), (None, None), (20.0, None)):
            p = object.__new__(GatewayWebSocketProtocol)  # only what start_keepalive reads
            p.loop, p.ping_interval, p.ping_timeout = loop, interval, timeout
            p.ping_timer, p.pong_timer, p.last_ping_rtt = None, None, 0.0
            p.start_keepalive()
            made.append(p)
        wheeled, own_timeout, off, no_timeout = made
        assert wheeled.keepalive_bucket is not None and wheeled.ping_timer is None
        wheel = wheel_for(loop, 20.0)
        assert wheel is not None and len(wheel) == 1
        for p in (own_timeout, no_timeout):
            assert p.keepalive_bucket is None and p.ping_timer is not None  # uvicorn's own
        assert off.keepalive_bucket is None and off.ping_timer is None
        wheeled.stop_keepalive()
        assert len(wheel) == 0 and not wheel.running
        for p in (own_timeout, no_timeout):
            p.stop_keepalive()
            assert p.ping_timer is None
    finally:
        loop.close()
