"""What a queue job writes (``Run.write``, the integrations' sender thread) against a real gateway, through a
proxy that loses 30% of the answers after the gateway wrote them: the stream holds every write once, in
order, before the run's outcome; each lost answer was followed by a retry of the same batch, answered as a
duplicate."""

from __future__ import annotations

import logging
import time

import anyio
import pytest

from gateway.integrations.report import GatewayConfig, Reporter
from tests.support import eventually, running_gateway
from tests.support.lossy_proxy import LossyProxy

LINES = [f"line {n}\n" for n in range(300)]
# The job writes at a model's pace: a burst of lines, then a pause past the 50 ms a buffer waits, so that
# its text goes in many appends (each of which may lose its answer).
BURST, PAUSE_S = 15, 0.06


@pytest.mark.anyio
async def test_a_runs_writes_reach_the_stream_once_before_its_outcome_through_lost_answers(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url) as gw:
        proxy = LossyProxy(int(gw.url.rsplit(":", 1)[1]), loss=0.3, seed=5)
        async with proxy.running() as url:
            reporter = Reporter(GatewayConfig(url=url, api_key=None, timeout_s=5.0))

            def job() -> None:
                ticket = reporter.create("run-1", ttl_ms=120_000, max_attempts=1, heartbeat_ms=None, tags=())
                assert ticket is not None
                run = reporter.begin("run-1", worker="w1", ticket=ticket, scheme="celery")
                for n, line in enumerate(LINES, 1):
                    run.write("output", line)
                    if n % BURST == 0:
                        time.sleep(PAUSE_S)  # the job's own pace, not a wait for the sender
                run.succeed("s3://logs/1")
                run.finish()

            await anyio.to_thread.run_sync(job)
            await eventually(
                lambda: gw.client.get("/v1/tasks/run-1"),
                lambda answer: answer.json()["state"] == "succeeded",
                "the run's outcome taken",
            )
        page = await gw.client.get("/v1/tasks/run-1/streams/output", params={"offset": 0, "limit": 10_000})
        assert page.json()["chunks"] == LINES  # none missing, none twice
        events = (await gw.client.get("/v1/tasks/run-1/events", params={"cursor": 0})).json()["events"]
        assert [entry["event"]["type"] for entry in events] == ["start", "succeed"]
        proxy.check_appends(len(LINES))


@pytest.mark.anyio
async def test_a_stream_the_gateway_refuses_is_said_once_and_the_others_go_on(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A task has at most 8 streams: the ninth's text is refused (409 too-many-streams), said once at
    WARNING, and what the job writes to it after is dropped, said once too; the run's other streams and its
    outcome go on."""
    names = [f"s{n}" for n in range(9)]
    async with running_gateway(sqlite_url) as gw:
        reporter = Reporter(GatewayConfig(url=gw.url, api_key=None, timeout_s=5.0))

        def job() -> None:
            ticket = reporter.create("run-2", ttl_ms=120_000, max_attempts=1, heartbeat_ms=None, tags=())
            assert ticket is not None
            run = reporter.begin("run-2", worker="w1", ticket=ticket, scheme="celery")
            for name in names:
                run.write(name, f"{name} first\n")
            deadline = time.monotonic() + 10
            while "s8" not in run.refused_streams:  # the sender's answer, which the job cannot await
                assert time.monotonic() < deadline, "the ninth stream was never refused"
                time.sleep(0.01)
            for name in names:
                run.write(name, f"{name} second\n")
            run.succeed("s3://logs/2")
            run.finish()

        with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
            await anyio.to_thread.run_sync(job)
            await eventually(
                lambda: gw.client.get("/v1/tasks/run-2"),
                lambda answer: answer.json()["state"] == "succeeded",
                "the run's outcome taken",
            )
        for name in names[:8]:
            text = await gw.client.get(f"/v1/tasks/run-2/streams/{name}/text")
            assert text.text == f"{name} first\n{name} second\n"
        listed = (await gw.client.get("/v1/tasks/run-2/streams")).json()["streams"]
        assert [stream["name"] for stream in listed] == names[:8]
        said = [r.getMessage() for r in caplog.records if r.name == "gateway.integrations"]
        refused = [line for line in said if "stream s8 of task run-2 refused: 409 too-many-streams" in line]
        dropped = [
            line for line in said if "dropping what the job writes to stream s8 (the gateway refused" in line
        ]
        assert (len(refused), len(dropped)) == (1, 1)
