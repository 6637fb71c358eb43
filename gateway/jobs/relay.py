"""The webhook relay: every terminal notification POSTed to ``GATEWAY_NOTIFY_URL``, signed the Standard
Webhooks way, until the receiver answers 2xx; only then is it marked sent (at least once, never lost).

A loop owned by the app's lifespan. It is woken when a commit wrote notifications, and looks again every
``poll`` for the rest (retries whose backoff ended, notifications other processes committed, leases a
stopped process left). Each round claims as many due notifications as it has free slots
(``Settings.notify_concurrency``) in one short transaction that leases them: their ``relay_next_at_ms``
moves to now + the request timeout + 5 s, so that no claim (of this process or another: ``FOR UPDATE SKIP
LOCKED`` on PostgreSQL) takes them while they are being sent. The POST runs outside any transaction,
bounded by the timeout; a 2xx marks the notification relayed, anything else (another status, a timeout, a
refused connection) moves its ``relay_next_at_ms`` to a backoff with full jitter: a random time up to
``min(retry_max, retry_min * 2^(tries - 1))``. A process that dies mid-send leaves its lease, which runs
out: another process, or this one restarted, sends it again.

The relay and ``POST /v1/notifications/drain`` are independent consumers: each has its own mark on the
outbox row, and each takes every notification.

Each notification has one ``webhook-id`` on every try (derived from its task, state and version), so that
a receiver that gets it twice (its 2xx lost, a lease that ran out) can tell; docs/webhooks.md says how to
verify and deduplicate.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import random
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import anyio
import httpx
import orjson
from anyio.abc import TaskGroup

from gateway.errors import one_line
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.store.base import Notification, Outgoing, Store
from gateway.store.database import database_unavailable, unavailable_reason
from gateway.store.db_deadline import DB_DEADLINE_S

log = logging.getLogger("gateway.relay")

Clock = Callable[[], int]

# A sending process holds a notification for its request timeout plus this margin (clock differences
# between hosts, the event loop's own delays), so that two processes never POST it at the same time.
LEASE_MARGIN_MS = 5_000
# Of a receiver's answer, at most this much is read (and thrown away).
MAX_ANSWER_BYTES = 64 * 1024
# Giving back the leases of sends cut short by a stop: at most this long.
GIVE_BACK_S = 2.0
# Failed tries are logged in one line at most this often.
LOG_EVERY_S = 60.0


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


def webhook_id(notification: Notification) -> str:
    """The notification's ``webhook-id``: the same on every try, by every process; another notification
    (task, state, version) has another."""
    key = f"{notification.task_id}\x00{notification.state}\x00{notification.version}".encode()
    return "msg_" + hashlib.sha256(key).hexdigest()[:32]


def webhook_body(notification: Notification) -> bytes:
    """The JSON body: the drain's fields, and a ``type`` (``task.succeeded``, ``task.failed``,
    ``task.expired``) that a receiver can route on."""
    return orjson.dumps(
        {
            "type": f"task.{notification.state}",
            "taskId": notification.task_id,
            "state": notification.state,
            "atMs": notification.at_ms,
            "version": notification.version,
        }
    )


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """``webhook-signature``: ``v1,`` + base64 of HMAC-SHA256 over ``id.timestamp.body``."""
    mac = hmac.new(key, b"%s.%d.%s" % (msg_id.encode(), timestamp, body), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def backoff_ms(attempt: int, retry_min_ms: int, retry_max_ms: int, rand: Callable[[], float]) -> int:
    """How long to wait after the ``attempt``-th failed try: full jitter, a uniform random time up to
    ``min(retry_max_ms, retry_min_ms * 2^(attempt - 1))``."""
    ceiling = min(retry_max_ms, retry_min_ms * 2 ** min(max(attempt - 1, 0), 62))
    return int(rand() * ceiling)


class Relay:
    def __init__(
        self,
        store: Store,
        url: str,
        key: bytes,
        metrics: Metrics,
        *,
        timeout_ms: int = 10_000,
        retry_min_ms: int = 500,
        retry_max_ms: int = 60_000,
        concurrency: int = 8,
        poll_ms: int = 1_000,
        clock: Clock = wall_clock_ms,
        rand: Callable[[], float] = random.random,
        transport: httpx.AsyncBaseTransport | None = None,
        db_deadline_s: float = DB_DEADLINE_S,
    ) -> None:
        self.store = store
        # The longest one of its database rounds may take (GATEWAY_DB_DEADLINE_MS).
        self.db_deadline_s = db_deadline_s
        self.url = url
        self.key = key
        self.metrics = metrics
        self.timeout_s = timeout_ms / 1000
        self.lease_ms = timeout_ms + LEASE_MARGIN_MS
        self.retry_min_ms = retry_min_ms
        self.retry_max_ms = retry_max_ms
        self.concurrency = concurrency
        self.poll_s = poll_ms / 1000
        self.clock = clock
        self.rand = rand
        self.transport = transport
        self.in_flight = 0
        self._wakeup = asyncio.Event()
        self._failures = 0
        self._quiet_until = 0.0
        # Outcomes of ended sends, recorded with the next round's claim: relayed outbox ids, and
        # (outbox id, when to try again) for the others.
        self._sent: list[int] = []
        self._later: list[tuple[int, int]] = []
        # The earliest retry this process scheduled, to wake for it before the next poll.
        self._retry_at_ms: int | None = None
        # Where to, in logs: no path, query or credentials.
        parts = urlsplit(url)
        self._where = f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        metrics.watch_relay(lambda: self.in_flight)

    @classmethod
    def from_settings(cls, store: Store, settings: Settings, metrics: Metrics) -> Relay | None:
        """The relay the settings ask for, or ``None`` without ``GATEWAY_NOTIFY_URL``."""
        key = settings.notify_key
        if settings.notify_url is None or key is None:
            return None
        return cls(
            store,
            settings.notify_url,
            key,
            metrics,
            timeout_ms=settings.notify_timeout_ms,
            retry_min_ms=settings.notify_retry_min_ms,
            retry_max_ms=settings.notify_retry_max_ms,
            concurrency=settings.notify_concurrency,
            poll_ms=settings.notify_poll_ms,
            db_deadline_s=settings.db_deadline_ms / 1000,
        )

    def wake(self) -> None:
        """Look for due notifications now (a commit wrote some, a slot came free)."""
        self._wakeup.set()

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        try:
            async with (
                httpx.AsyncClient(
                    timeout=self.timeout_s,
                    limits=limits,
                    transport=self.transport,
                    follow_redirects=False,
                    headers={"user-agent": "task-gateway-relay"},
                ) as client,
                anyio.create_task_group() as tg,
            ):
                counted_at = -self.poll_s
                while True:
                    # A wake-up from here on is not missed: the round below runs after it, or the wait
                    # returns at once.
                    self._wakeup.clear()
                    await self._round(client, tg)
                    if anyio.current_time() - counted_at >= self.poll_s:
                        counted_at = anyio.current_time()
                        await self._count_pending()
                    wait_s = self.poll_s
                    if self._retry_at_ms is not None:  # a retry of this process falls due before the poll
                        wait_s = min(wait_s, max(0.0, (self._retry_at_ms - self.clock()) / 1000))
                    with anyio.move_on_after(wait_s):
                        await self._wakeup.wait()
        finally:
            # Sends cut short by the stop gave their leases back; record that, so a restart sends at once.
            await self._record_outcomes(deadline_s=GIVE_BACK_S)

    async def _round(self, client: httpx.AsyncClient, tg: TaskGroup) -> None:
        """One transaction: record the outcomes of the sends that ended, then claim due notifications for
        the free slots and start sending them."""
        free = self.concurrency - self.in_flight
        now = self.clock()
        if self._retry_at_ms is not None and self._retry_at_ms <= now:
            self._retry_at_ms = None
        claimed = await self._record_outcomes(claim=free, now=now)
        for outgoing in claimed:
            self.in_flight += 1
            tg.start_soon(self._send, client, outgoing)

    async def _record_outcomes(
        self, claim: int = 0, now: int = 0, deadline_s: float | None = None
    ) -> list[Outgoing]:
        sent, later = self._sent, self._later
        if not (sent or later or claim > 0):
            return []
        self._sent, self._later = [], []
        try:
            # Shielded: a stop waits for the commit instead of tearing a connection down mid-query.
            with anyio.fail_after(self.db_deadline_s if deadline_s is None else deadline_s, shield=True):
                async with self.store.write() as tx:
                    if sent:
                        await tx.relay_sent(sent, self.clock())
                    for outbox_id, next_at_ms in later:
                        await tx.relay_later(outbox_id, next_at_ms)
                    if claim > 0:
                        return await tx.claim_relay(now, now + self.lease_ms, claim)
                    return []
        except Exception as exc:  # a database outage must not end the relay; the next round tries again
            # Kept for the next round. Were they lost with the process, the leases would run out and the
            # notifications be sent again: a duplicate, never a loss.
            self._sent[:0] = sent
            self._later[:0] = later
            self._database_trouble(exc)
            return []

    async def _send(self, client: httpx.AsyncClient, outgoing: Outgoing) -> None:
        outcome: int | None = None  # when to try again; None: sent
        try:
            problem = await self._post(client, outgoing.notification)
            if problem is None:
                self.metrics.notifications_relayed.inc()
            else:
                self.metrics.notification_relay_failures.labels(problem).inc()
                delay = backoff_ms(outgoing.attempt, self.retry_min_ms, self.retry_max_ms, self.rand)
                outcome = self.clock() + delay
                if self._retry_at_ms is None or outcome < self._retry_at_ms:
                    self._retry_at_ms = outcome
                self._failures += 1
                if anyio.current_time() >= self._quiet_until:  # a line a minute, not one per try
                    self._quiet_until = anyio.current_time() + LOG_EVERY_S
                    log.warning(
                        "webhook relay: POST to %s failed (%s; %d failed tries since the last such line); "
                        "each notification is retried with backoff until a 2xx",
                        self._where,
                        problem,
                        self._failures,
                    )
                    self._failures = 0
        except BaseException:  # cut short (a stop): give the lease back, so that a restart sends it at once
            outcome = self.clock()
            raise
        finally:
            self.in_flight -= 1
            if outcome is None:
                self._sent.append(outgoing.outbox_id)
            else:
                self._later.append((outgoing.outbox_id, outcome))
            self.wake()

    async def _post(self, client: httpx.AsyncClient, notification: Notification) -> str | None:
        """One try: ``None`` on a 2xx, else what went wrong (``timeout``, ``connection``, ``5xx``...)."""
        msg_id = webhook_id(notification)
        body = webhook_body(notification)
        timestamp = self.clock() // 1000
        headers = {
            "content-type": "application/json",
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self.key, msg_id, timestamp, body),
        }
        try:
            with anyio.fail_after(self.timeout_s):
                async with client.stream("POST", self.url, content=body, headers=headers) as answer:
                    read = 0
                    async for chunk in answer.aiter_raw():
                        read += len(chunk)
                        if read > MAX_ANSWER_BYTES:
                            break
                    status = answer.status_code
        except TimeoutError:
            return "timeout"
        except httpx.TimeoutException:
            return "timeout"
        except httpx.HTTPError:
            return "connection"
        if 200 <= status < 300:
            return None
        return f"{status // 100}xx"

    async def _count_pending(self) -> None:
        try:
            with anyio.fail_after(self.db_deadline_s, shield=True):
                async with self.store.read() as tx:
                    self.metrics.notifications_relay_pending.set(await tx.relay_pending())
        except Exception as exc:
            self._database_trouble(exc)

    def _database_trouble(self, exc: Exception) -> None:
        if database_unavailable(exc) or isinstance(exc, TimeoutError):
            log.warning("webhook relay: %s (%s); retrying", unavailable_reason(exc), one_line(exc))
        else:
            log.exception("webhook relay: a database round failed; retrying")
