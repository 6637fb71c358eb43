"""Prometheus metrics, one registry per app so that several gateways can live in one process (tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


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
        self.tasks_created = Counter("gateway_tasks_created", "Tasks created", registry=self.registry)
        self.tasks_expired = Counter(
            "gateway_tasks_expired_by_sweeper", "Tasks expired by the sweeper", registry=self.registry
        )
        self.notifications_drained = Counter(
            "gateway_notifications_drained", "Notifications taken from the outbox", registry=self.registry
        )

        self.slow_consumers = Counter(
            "gateway_slow_consumers_closed", "Connections closed with 4008", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
