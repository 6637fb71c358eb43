"""The dashboard on a tag link, in headless Chromium: issue 18's browser acceptance test.

Two ``gateway serve`` processes on one PostgreSQL database (tests/support/processes.py). The page is opened on
``/?tag=T&token=K`` (``K`` a tag token from ``POST /v1/tokens``) through a relay to the first process
(``TcpProxy``, which can make the link die silently); every task is created and driven through the second.
What a user of the link sees:

- the tag's tasks, one card each, newest first;
- a task created afterwards, on the other process, appears and follows its progress live (within a second
  is no test, a loaded machine can miss it: it is the bench check ``tag-across-processes``,
  bench/checks/tag_across.py, on the gateway's frames);
- after the link went silent (no FIN, nothing through, the gateway out of reach) while two more tasks were
  created and the others moved on, once the link is back the page shows all six, each exactly as the store
  has it (state, progress, version). How soon (within 10 s of its return) is no test, a loaded machine can
  miss it: it is the bench check ``tag-page-back`` (bench/checks/dead_link_pages.py), whose step this is.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import httpx
import pytest

from bench.checks.dead_link_pages import back_after_a_silence
from gateway.client import Worker
from tests.support import STEP_S, TcpProxy, http_client, postgres_database
from tests.support.processes import GatewayProcess, gateway_processes
from tests.support.tag_page import TagPage

if TYPE_CHECKING:
    from tests.browser.conftest import Console

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.fixture
async def gateways(browser: Any, pg_url: str, tmp_path: Path) -> AsyncIterator[list[GatewayProcess]]:
    """Two gateway processes on one database (set up after the browser, so stopped before it)."""
    async with gateway_processes(2, pg_url, tmp_path) as gws:
        yield gws


@pytest.fixture
async def page(gateways: list[GatewayProcess], context: Any, console: Console) -> Any:
    page = await context.new_page()
    page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: console.page_errors.append(str(e)))
    return page


async def tag_token(client: httpx.AsyncClient, url: str, tag: str) -> str:
    answer = await client.post(f"{url}/v1/tokens", json={"tag": tag, "ttlS": 3600})
    assert answer.status_code == 201, answer.text
    token: str = answer.json()["token"]
    return token


async def create(client: httpx.AsyncClient, url: str, task_id: str, tag: str) -> dict[str, Any]:
    body = {"id": task_id, "ttlMs": 600_000, "maxAttempts": 2, "tags": [tag]}
    answer = await client.post(f"{url}/v1/tasks", json=body)
    assert answer.status_code == 201, answer.text
    made: dict[str, Any] = answer.json()
    return made


async def test_a_tag_link_shows_its_tasks_live_and_exact_after_a_silent_link(
    gateways: list[GatewayProcess], page: Any, console: Console
) -> None:
    near, far = gateways  # the page's process (through the relay), and the one everything is done on
    run = uuid.uuid4().hex[:8]
    tag = f"owner:u{run}"
    ids = [f"tagged-{run}-{i}" for i in range(6)]
    async with http_client(timeout=STEP_S) as client, AsyncExitStack() as stack:
        tags = TagPage(page, client, far.url)
        workers: dict[str, Worker] = {}

        async def make(i: int) -> None:
            made = await create(client, far.url, ids[i], tag)
            workers[ids[i]] = await stack.enter_async_context(Worker(far.url, ids[i], made["callbackToken"]))

        for i in range(3):
            await make(i)
        await workers[ids[0]].start("w0")
        await workers[ids[0]].progress(40, "p40")
        await workers[ids[1]].start("w1")
        token = await tag_token(client, near.url, tag)
        relay = await stack.enter_async_context(TcpProxy(near.port))

        # 1. The tag's three tasks, newest first, each exact.
        await page.goto(f"{relay.url}/?{urlencode({'tag': tag, 'token': token})}")
        await page.wait_for_selector("body[data-ready=true]", state="attached")
        head = page.locator("#tag-head")
        await tags.expect(head).to_have_attribute("data-state", "live")
        await tags.expect(head).to_have_attribute("data-tag", tag)
        for task_id in ids[:3]:
            await tags.exact(task_id, STEP_S * 1000)
        assert await tags.order() == ids[2::-1]

        # 2. A fourth, created on the other process, appears and follows its progress.
        await make(3)
        created_at = time.monotonic()
        await tags.expect(tags.card(ids[3])).to_be_visible(timeout=STEP_S * 1000)
        appeared_s = time.monotonic() - created_at
        assert await tags.order() == ids[3::-1]
        await workers[ids[3]].start("w3")
        await tags.exact(ids[3], STEP_S * 1000)
        for progress in (20, 50):
            await workers[ids[3]].progress(progress, f"p{progress}")
            await tags.exact(ids[3], STEP_S * 1000)

        # 3. The link goes silent (nothing through, nothing closed, the gateway out of reach) while two more
        #    tasks are created and the others move on; then it comes back.
        accepted = relay.accepted

        async def meanwhile() -> None:
            await make(4)
            await make(5)
            await workers[ids[0]].succeed(f"s3://results/{ids[0]}", "sha256:00")
            await workers[ids[1]].progress(10, "p10")
            await workers[ids[2]].start("w2")
            await workers[ids[3]].progress(80, "p80")
            await workers[ids[5]].start("w5")

        back_s = await back_after_a_silence(relay, tags, meanwhile, ids, STEP_S)
        assert await tags.order() == ids[::-1]
        await tags.expect(head).to_have_attribute("data-count", "6")
        assert relay.accepted > accepted  # on a new connection: the silent one was noticed and replaced
    print(
        f"\nthe fourth task appeared in {appeared_s * 1000:.0f} ms; "
        f"all six exact {back_s:.1f} s after the link came back"
    )
    console.errors[:] = [e for e in console.errors if not e.startswith("WebSocket connection to")]
    console.assert_clean()
