"""Prometheus metrics, one registry per app so that several gateways can live in one process (tests)."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Expiry's and leases': around the protocol's bound (1 s) finely; a backlog after a database outage lands
# in the last ones.
EXPIRY_LATENESS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)


# Garbage collection pauses: a young collection takes well under a millisecond; a full one walks every
# tracked object of the process (thousands of sockets are millions of objects), which is what to watch.
GC_PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter(
            "gateway_http_requests", "HTTP requests answered", ["method", "status"], registry=self.registry
        )
        self.callbacks = Counter(
            "gateway_callbacks",
            "Worker callbacks answered, by the transition's reason",
            ["reason"],
            registry=self.registry,
        )
        self.callback_seconds = Histogram(
            "gateway_callback_seconds",
            "Time from a callback's arrival to its committed answer",
            registry=self.registry,
        )
        self.heartbeats = Counter(
            "gateway_heartbeats",
            "Heartbeats answered 200 (each renews its attempt's lease, where the task has one)",
            registry=self.registry,
        )
        self.metadata_patches = Counter(
            "gateway_metadata_patches",
            "Metadata patches that changed a task's metadata (POST /v1/tasks/{task_id}/metadata)",
            registry=self.registry,
        )
        self.tasks_created = Counter("gateway_tasks_created", "Tasks created", registry=self.registry)
        self.sockets_refused = Counter(
            "gateway_sockets_refused",
            "WebSockets and SSE streams refused because the process neared its file descriptor limit "
            "(GATEWAY_FD_RESERVE)",
            registry=self.registry,
        )
        self.tasks_cancelled = Counter(
            "gateway_tasks_cancelled", "Tasks ended by POST /v1/tasks/{id}/cancel", registry=self.registry
        )
        self.tasks_expired = Counter(
            "gateway_tasks_expired_by_sweeper", "Tasks expired by the sweeper", registry=self.registry
        )
        self.expiry_lateness_seconds = Histogram(
            "gateway_expiry_lateness_seconds",
            "Time from a task's deadline (expiresAtMs) to the commit of its expiry by the sweeper "
            "(protocol.md: within 1 s)",
            buckets=EXPIRY_LATENESS_BUCKETS,
            registry=self.registry,
        )
        self.leases_ended = Counter(
            "gateway_leases_ended_by_sweeper",
            "Heartbeat leases the sweeper ended (their attempt failed with heartbeat-timeout)",
            registry=self.registry,
        )
        self.lease_lateness_seconds = Histogram(
            "gateway_lease_lateness_seconds",
            "Time from a heartbeat lease's end to the commit of its heartbeat-timeout fail by the sweeper "
            "(protocol.md: within 1 s)",
            buckets=EXPIRY_LATENESS_BUCKETS,
            registry=self.registry,
        )
        self.notifications_drained = Counter(
            "gateway_notifications_drained", "Notifications taken from the outbox", registry=self.registry
        )
        self.drain_replays = Counter(
            "gateway_drain_replays",
            "Drains answered with the batch kept under their Idempotency-Key (a retry: its answer was lost)",
            registry=self.registry,
        )
        self.notifications_relayed = Counter(
            "gateway_notifications_relayed",
            "Notifications the webhook receiver answered 2xx",
            registry=self.registry,
        )
        self.notification_relay_failures = Counter(
            "gateway_notification_relay_failures",
            "Webhook tries that failed, by reason (timeout, connection, 4xx, 5xx...); each is retried",
            ["reason"],
            registry=self.registry,
        )
        self.notifications_relay_pending = Gauge(
            "gateway_notifications_relay_pending",
            "Notifications not relayed yet (all processes), as of the relay's last look",
            registry=self.registry,
        )
        self.tasks_deleted = Counter(
            "gateway_finished_tasks_deleted",
            "Finished tasks deleted by retention (GATEWAY_RETAIN_FINISHED_S), with everything they owned",
            registry=self.registry,
        )
        self.retention_held = Gauge(
            "gateway_finished_tasks_held",
            "Tasks finished longer ago than GATEWAY_RETAIN_FINISHED_S that are kept because nobody took "
            "their notification (not drained, nor relayed when a relay is set), all processes, as of this "
            "process's last retention pass",
            registry=self.registry,
        )

        self.slow_consumers = Counter(
            "gateway_slow_consumers_closed", "Connections closed with 4008", registry=self.registry
        )
        self.gc_pause_seconds = Histogram(
            "gateway_gc_pause_seconds",
            "Pauses of the cyclic garbage collector in this process, by generation (2: a full collection)",
            ["generation"],
            buckets=GC_PAUSE_BUCKETS,
            registry=self.registry,
        )

    def expired(self, deadlines_ms: Sequence[int], committed_ms: int) -> None:
        """Tasks with these deadlines were expired by a commit at ``committed_ms``."""
        for deadline in deadlines_ms:
            self.expiry_lateness_seconds.observe(max(0, committed_ms - deadline) / 1000)

    def leases_over(self, ends_ms: Sequence[int], committed_ms: int) -> None:
        """Leases with these ends were ended by a commit at ``committed_ms``."""
        for end in ends_ms:
            self.lease_lateness_seconds.observe(max(0, committed_ms - end) / 1000)

    def watch_hub(self, stats: Callable[[], dict[str, int]]) -> None:
        """Export the hub's queue sizes, read when /metrics is scraped."""
        for name, help_text in (
            ("connections", "Open live connections (WebSocket and SSE)"),
            ("subscriptions", "Live subscriptions of tasks (those a tag subscription streams included)"),
            ("tag_subscriptions", "Live subscriptions of tags (/v1/ws)"),
            ("pending_total", "Entries queued for subscribers, all together"),
            ("pending_max", "The longest backlog of one subscription"),
            ("conflations", "Backlogs collapsed into a conflated snapshot since start"),
            ("catch_ups", "Reads of the store for entries the bus did not bring, since start"),
            (
                "direct_writes",
                "Entries written by fan-out straight to a socket with room, since start (the others went "
                "through their connection's queue and writer)",
            ),
        ):
            gauge = Gauge(f"gateway_hub_{name}", help_text, registry=self.registry)
            gauge.set_function(lambda name=name: stats()[name])  # type: ignore[misc]

    def watch_bus(self, bus: Any) -> None:
        """Export whether the bus listens now, and how often it has (re)connected."""
        connected = Gauge(
            "gateway_bus_connected", "1 while the bus listener is connected", registry=self.registry
        )
        connected.set_function(lambda: 1.0 if bus.connected else 0.0)
        connects = Gauge(
            "gateway_bus_connects", "Times the bus listener connected since start", registry=self.registry
        )
        connects.set_function(lambda: float(bus.reconnects))
        heard = Gauge(
            "gateway_bus_messages_heard",
            "Messages this process's bus listener heard from the shared bus since start (its own included)",
            registry=self.registry,
        )
        heard.set_function(lambda: float(getattr(bus, "heard", 0)))

    def watch_committer(self, committer: Any) -> None:
        """Export the group commit's batches and the callbacks they applied (their mean size per process),
        and this process's id (``gateway serve --workers`` answers /metrics from any of its processes)."""
        batches = Gauge(
            "gateway_callback_batches", "Group-commit batches committed since start", registry=self.registry
        )
        batches.set_function(lambda: float(committer.batches))
        applied = Gauge(
            "gateway_callbacks_batched",
            "Callbacks applied by those batches since start (divided by the batches: the mean batch size)",
            registry=self.registry,
        )
        applied.set_function(lambda: float(committer.applied))
        pid = Gauge("gateway_process_id", "The operating-system id of this process", registry=self.registry)
        pid.set(os.getpid())

    def watch_relay(self, in_flight: Callable[[], int]) -> None:
        """Export how many notifications this process's relay is sending now."""
        gauge = Gauge(
            "gateway_notifications_relay_in_flight",
            "Webhook POSTs this process has under way",
            registry=self.registry,
        )
        gauge.set_function(lambda: float(in_flight()))

    @contextmanager
    def watching_gc(self) -> Iterator[None]:
        """Observe every garbage collection of this process in ``gateway_gc_pause_seconds`` for the block
        (``gc.callbacks``: the interpreter's, so each process of ``--workers`` observes its own)."""
        by_generation = [self.gc_pause_seconds.labels(generation=str(g)) for g in range(3)]
        started = 0.0

        def on_gc(phase: str, info: dict[str, int]) -> None:
            nonlocal started
            if phase == "start":
                started = time.perf_counter()
            elif started:
                by_generation[info["generation"]].observe(time.perf_counter() - started)
                started = 0.0

        gc.callbacks.append(on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(on_gc)

    def render(self) -> bytes:
        return generate_latest(self.registry)
