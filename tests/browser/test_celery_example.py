"""examples/celery/ run as its README says, watched in real Chromium: a newcomer's first look at the
integrations.

Everything is real and its own: a ``gateway serve`` process (SQLite, an API key, the app's origin allowed),
a Celery worker process (``celery -A tasks worker``, prefork) on a RabbitMQ vhost and queue made for this
test (the vhost deleted after it, as the README's commands make and delete one), and the example app under
uvicorn. Another app's message waits on Celery's default queue, ``celery``, of the same vhost: the worker
takes nothing from it. The page follows its user's reports through one tag
subscription; the test clicks "Start a report" twice and waits until both cards have shown progress
between 0 and 100 and then the result, as a user would see them, while another user's report never shows;
then a third, cancelled through the gateway, stops in the worker and reads Cancelled (a card of the class
``cancelled``: grey).
A recorder (a MutationObserver from the first script on) keeps every value a card's state and progress took,
so a value held for a moment is seen however fast or slow this machine is.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from celery import Celery

from tests.browser.conftest import Console
from tests.support import bearer, eventually, http_client
from tests.support.processes import SERVING, GatewayProcess, free_port, spawn_gateway, unavailable

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "celery"
API_KEY = "example-key-for-the-browser-test"
# The commands of examples/celery/README.md (less the addresses, which the test picks): held to the README
# by test_the_readme_gives_the_commands_this_test_runs.
WORKER = ["celery", "-A", "tasks", "worker", "--loglevel", "INFO", "--concurrency", "2"]
APP = ["uvicorn", "app:app", "--port"]
WORKER_READY = re.compile(rb"celery@\S+ ready\.")
# The README's commands that give the example a vhost of its own (``rabbitmqctl`` and these words, for the
# README's vhost or the test's own), and the variables that take the example there.
VHOST_COMMANDS = (["add_vhost", "{vhost}"], ["set_permissions", "-p", "{vhost}", "guest", ".*", ".*", ".*"])
README_VHOST = "task-gateway-example"
# Where another app on the same vhost publishes: Celery's default queue.
CELERY_DEFAULT_QUEUE = "celery"
# Two reports of 40 rows at 0.1 s each run side by side; the rest is room for a loaded machine.
REPORT_TIMEOUT_MS = 60_000
START_S = 60.0

# Every value each report card's state and progress take, kept per task id from the first script on.
RECORDER = """
(() => {
  const seen = {};
  window.__reports = seen;
  const record = (el, attributes) => {
    const card = (seen[el.dataset.taskId] ??= { state: [], progress: [] });
    if (attributes.includes("data-state")) card.state.push(el.dataset.state);
    if (attributes.includes("data-progress")) card.progress.push(Number(el.dataset.progress));
  };
  new MutationObserver((records) => {
    for (const r of records) {
      if (r.type === "childList") {
        for (const node of r.addedNodes) {
          if (node.matches && node.matches("li.report")) record(node, ["data-state", "data-progress"]);
        }
      } else if (r.target.matches("li.report")) {
        record(r.target, [r.attributeName]);
      }
    }
  }).observe(document, {
    subtree: true,
    childList: true,
    attributes: true,
    attributeFilter: ["data-state", "data-progress"],
  });
})();
"""


def rabbitmqctl(*args: str) -> None:
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"rabbitmqctl {' '.join(args)}: {done.stderr or done.stdout}"


def vhost_command(words: list[str], vhost: str) -> list[str]:
    return [word.format(vhost=vhost) for word in words]


@pytest.fixture
def vhost() -> Iterator[str]:
    """A RabbitMQ vhost of this test's own on this machine's broker, made and deleted as the README does."""
    if shutil.which("rabbitmqctl") is None:
        unavailable("rabbitmqctl is missing: install and start RabbitMQ to run the Celery example")
    name = f"tg-example-{uuid.uuid4().hex[:12]}"
    add, permit = (vhost_command(words, name) for words in VHOST_COMMANDS)
    try:
        rabbitmqctl(*add)
    except AssertionError as exc:
        unavailable(f"RabbitMQ cannot make a vhost ({exc}); start it to run the Celery example")
    try:
        rabbitmqctl(*permit)
        yield name
    finally:
        rabbitmqctl("delete_vhost", name)


def broker_url(vhost: str) -> str:
    return f"amqp://guest:guest@127.0.0.1:5672/{vhost}"


def example_environ(gateway_url: str, vhost: str, queue: str) -> dict[str, str]:
    """This environment less its gateway, Celery and report settings, plus the four the README exports."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "CELERY_", "REPORT_"))}
    env.update(
        GATEWAY_URL=gateway_url,
        GATEWAY_API_KEY=API_KEY,
        CELERY_BROKER_URL=broker_url(vhost),
        REPORT_QUEUE=queue,
    )
    return env


def publish_as_another_app(vhost: str) -> None:
    """What another Celery app on the same vhost does: publish a task of its own to Celery's default queue."""
    other = Celery("another-app", broker=broker_url(vhost))
    try:
        other.send_task("another_app.job", queue=CELERY_DEFAULT_QUEUE)
    finally:
        other.close()


async def queues(vhost: str) -> dict[str, tuple[int, int]]:
    """The vhost's queues: their messages (ready and unacknowledged) and consumers."""
    listed = await anyio.run_process(
        [
            "rabbitmqctl",
            "-q",
            "list_queues",
            "-p",
            vhost,
            "name",
            "messages",
            "consumers",
            "--no-table-headers",
        ]
    )
    rows = [line.split("\t") for line in listed.stdout.decode().splitlines() if line.strip()]
    return {name: (int(messages), int(consumers)) for name, messages, consumers in rows}


@asynccontextmanager
async def example_process(
    name: str, command: list[str], env: dict[str, str], directory: Path
) -> AsyncIterator[GatewayProcess]:
    """``command`` (a console script of this interpreter's environment) run in examples/celery in a session
    of its own, its output in ``directory/name.log``; stopped (SIGTERM, then SIGKILL, then anything left in
    its process group: a prefork worker's children) when the block ends, its output's tail printed if the
    block failed."""
    log = directory / f"{name}.log"
    argv = [sys.executable, "-m", *command]
    with log.open("wb") as out:
        process = await anyio.open_process(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=EXAMPLE, start_new_session=True
        )
    child = GatewayProcess(name, process, log)
    failed = False
    try:
        yield child
    except BaseException:
        failed = True
        raise
    finally:
        await child.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        if failed:
            print(f"\n----- {name} (pid {child.pid}): {log} -----\n{child.tail()}")


@asynccontextmanager
async def gateway_process(origin: str, directory: Path) -> AsyncIterator[GatewayProcess]:
    """``gateway serve`` as the README starts it: an API key, the example app's origin allowed."""
    env = {"GATEWAY_API_KEY": API_KEY, "GATEWAY_ALLOWED_ORIGINS": origin}
    gw = await spawn_gateway(
        "gateway", f"sqlite:///{directory / 'gateway.db'}", directory / "gw.log", env=env
    )
    try:
        await gw.serving()
        yield gw
    except BaseException:
        print(f"\n----- gateway (pid {gw.pid}): {gw.log} -----\n{gw.tail()}")
        raise
    finally:
        await gw.stop()


def test_the_readme_gives_the_commands_this_test_runs() -> None:
    readme = (EXAMPLE / "README.md").read_text()
    for words in (WORKER, [*APP, "8001"]):
        assert " ".join(words) in readme, words
    for line in ("GATEWAY_ALLOWED_ORIGINS=http://127.0.0.1:8001", "gateway serve", "http://127.0.0.1:8001/"):
        assert line in readme, line
    for words in VHOST_COMMANDS:
        assert shlex.join(["rabbitmqctl", *vhost_command(words, README_VHOST)]) in readme, words
    assert f"rabbitmqctl delete_vhost {README_VHOST}" in readme
    assert f"export CELERY_BROKER_URL={broker_url(README_VHOST)} REPORT_QUEUE=" in readme


@dataclass
class Example:
    """The example running as its README says: the gateway, the worker, the app, alice's page."""

    gw: GatewayProcess
    worker: GatewayProcess
    queue: str
    page: Any
    api: Any  # the gateway's API with its key
    site: Any  # the example app


@asynccontextmanager
async def running_example(
    context: Any, console: Console, vhost: str, tmp_path: Path, **environ: str
) -> AsyncIterator[Example]:
    from playwright.async_api import expect

    app_port = free_port()
    origin = f"http://127.0.0.1:{app_port}"
    queue = f"tg-example-reports-{uuid.uuid4().hex[:8]}"
    async with gateway_process(origin, tmp_path) as gw:
        env = {**example_environ(gw.url, vhost, queue), **environ}
        async with (
            example_process("worker", WORKER, env, tmp_path) as worker,
            example_process("app", [*APP, str(app_port), "--host", "127.0.0.1"], env, tmp_path) as app,
            http_client(base_url=gw.url, headers=bearer(API_KEY), timeout=10) as api,
            http_client(base_url=origin, timeout=30) as site,
        ):
            await worker.wait_for(WORKER_READY, timeout_s=START_S)
            await app.wait_for(SERVING, timeout_s=START_S)

            await context.add_init_script(RECORDER)
            page = await context.new_page()
            page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console.page_errors.append(str(e)))
            await page.goto(f"{origin}/?user=alice")
            await page.wait_for_selector("body[data-ready=true]", state="attached")
            await expect(page.locator("#connection")).to_have_attribute("data-state", "connected")
            yield Example(gw, worker, queue, page, api, site)


@pytest.mark.anyio
async def test_a_user_starts_reports_and_watches_them_progress_and_finish(
    context: Any, console: Console, vhost: str, tmp_path: Path
) -> None:
    from playwright.async_api import expect

    await anyio.to_thread.run_sync(publish_as_another_app, vhost)
    async with running_example(context, console, vhost, tmp_path) as example:
        worker, queue, page, api, site = (
            example.worker,
            example.queue,
            example.page,
            example.api,
            example.site,
        )

        started = []
        for _ in range(2):
            async with page.expect_response("**/api/reports") as info:
                await page.get_by_role("button", name="Start a report").click()
            answer = await info.value
            assert answer.status == 201, await answer.text()
            started.append((await answer.json())["taskId"])
        # Another user's report, started meanwhile: alice's page never shows it.
        bob = await site.post("/api/reports", json={"user": "bob"})
        assert bob.status_code == 201, bob.text

        for task_id in started:
            card = page.locator(f'li.report[data-task-id="{task_id}"]')
            await expect(card).to_have_attribute("data-state", "succeeded", timeout=REPORT_TIMEOUT_MS)
            await expect(card.get_by_role("progressbar")).to_have_attribute("aria-valuenow", "100")
            await expect(card.locator(".detail")).to_contain_text(f"result: reports/alice/{task_id}.csv")
            await expect(card.locator(".state")).to_have_text("Done")

        seen: dict[str, dict[str, list[Any]]] = await page.evaluate("window.__reports")
        for task_id in started:
            states, progress = seen[task_id]["state"], seen[task_id]["progress"]
            assert "running" in states and states[-1] == "succeeded", states
            assert any(0 < p < 100 for p in progress), progress  # seen progressing, not only done
            assert progress == sorted(progress) and progress[-1] == 100, progress

        # The gateway holds what the page showed: each report a task tagged with its owner, one attempt.
        for task_id in started:
            task = (await api.get(f"/v1/tasks/{task_id}")).json()
            assert task["state"] == "succeeded" and task["attempts"] == 1, task
            assert task["tags"] == ["owner:alice"], task
            assert task["resultRef"] == f"reports/alice/{task_id}.csv", task
        bob_id = bob.json()["taskId"]
        await eventually(
            lambda: api.get(f"/v1/tasks/{bob_id}"),
            lambda answer: answer.json()["state"] == "succeeded",
            "bob's report to finish",
            REPORT_TIMEOUT_MS / 1000,
            poll_s=0.1,
        )
        assert bob_id not in seen and await page.locator("li.report").count() == 2

        # All of alice's reports, finished ones too, are there when she comes back.
        await page.reload()
        await page.wait_for_selector("body[data-ready=true]", state="attached")
        for task_id in started:
            card = page.locator(f'li.report[data-task-id="{task_id}"]')
            await expect(card).to_have_attribute("data-state", "succeeded")
        assert await page.locator("li.report").count() == 2

        # A report cancelled through the gateway (the README's curl) stops in the worker and reads
        # Cancelled: the job's next progress() raised TaskCancelled. Its 1,000 rows (100 s) leave it
        # running until then, however slow the machine.
        started_doomed = await site.post("/api/reports", json={"user": "alice", "rows": 1000})
        assert started_doomed.status_code == 201, started_doomed.text
        doomed = started_doomed.json()["taskId"]
        card = page.locator(f'li.report[data-task-id="{doomed}"]')
        await expect(card).to_have_attribute("data-progress", re.compile("^[1-9][0-9]?$"))
        cancelled = await api.post(f"/v1/tasks/{doomed}/cancel")
        assert cancelled.json()["reason"] == "cancelled", cancelled.text
        await expect(card.locator(".state")).to_have_text("Cancelled")
        await expect(card).to_have_attribute("data-state", "failed")
        await expect(card).to_have_class(re.compile(r"\bcancelled\b"))  # grey, not a failure's red
        stopped = re.compile(rf"Task tasks\.report\[{doomed}\] raised unexpected: TaskCancelled".encode())
        await worker.wait_for(stopped, timeout_s=REPORT_TIMEOUT_MS / 1000)
        assert (await api.get(f"/v1/tasks/{doomed}")).json()["progress"] < 100
        await page.close()
        # The worker took its reports from the queue it was given, and nothing from another app's.
        found = await queues(vhost)
        assert found[CELERY_DEFAULT_QUEUE] == (1, 0), found
        assert found[queue][1] == 1, found
    console.assert_clean()


@pytest.mark.anyio
async def test_an_answer_grows_word_by_word_survives_a_silent_link_and_a_retry_replaces_it(
    context: Any, console: Console, vhost: str, tmp_path: Path
) -> None:
    """The example's answer (a job writing words at a model's pace to its stream ``output``), its first
    attempt failing half-way: the card's text grows, is replaced by the second attempt's, goes on through a
    gateway that stops answering for a while (SIGSTOP: the page's link goes silent, then comes back), and
    ends as the gateway's text."""
    from playwright.async_api import expect

    # 10 words a second: the first attempt writes for some 6 s before it fails, long enough to be seen.
    async with running_example(context, console, vhost, tmp_path, ANSWER_TOKEN_S="0.1") as example:
        page, api = example.page, example.api
        form = page.locator("form#ask")
        await form.get_by_label("its first attempt fails half-way").check()
        async with page.expect_response("**/api/answers") as info:
            await form.get_by_role("button", name="Ask").click()
        answer = await info.value
        assert answer.status == 201, await answer.text()
        task_id = (await answer.json())["taskId"]
        output = page.locator(f'li[data-task-id="{task_id}"] pre.output')
        await expect(output).to_have_attribute("data-attempt", "1", timeout=REPORT_TIMEOUT_MS)
        first = await output.text_content() or ""
        # Word by word: more text of the same attempt than was first seen.
        await page.wait_for_function(
            "([id, more]) => document.querySelector(`li[data-task-id='${id}'] pre.output`).textContent.length"
            " > more",
            arg=[task_id, len(first)],
        )
        # The retry's words replace the first attempt's.
        await expect(output).to_have_attribute("data-attempt", "2", timeout=REPORT_TIMEOUT_MS)
        # The gateway stops answering: the page's link goes silent and is given up, then comes back.
        os.kill(example.gw.pid, signal.SIGSTOP)
        try:
            # A ping unanswered past the client's deadline (3 s after 3 s of silence) gives the link up.
            connection = page.locator("#connection")
            await expect(connection).not_to_have_attribute("data-state", "connected", timeout=30_000)
        finally:
            os.kill(example.gw.pid, signal.SIGCONT)
        await expect(output).to_have_attribute("data-ended", "true", timeout=REPORT_TIMEOUT_MS)
        text = await api.get(f"/v1/tasks/{task_id}/streams/output/text")
        assert await output.text_content() == text.text and text.text.endswith(".\n"), text.text
        assert text.headers["Stream-Attempt"] == "2"
        task = (await api.get(f"/v1/tasks/{task_id}")).json()
        assert (task["state"], task["attempts"]) == ("succeeded", 2), task
        await page.close()
    console.assert_clean()
