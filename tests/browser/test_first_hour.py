"""A newcomer's first screen of README.md, followed literally, to a progress bar moving live in Chromium.

On the files a fresh clone of this checkout has (``git ls-files``, as they are in the working tree; a file
not added to git is not there, as it would not be in a clone), in a directory of its own:

1. the README's first command, as written (``python3 -m venv .venv && .venv/bin/pip install -q -e . &&
   .venv/bin/gateway serve``), in a shell with no venv active, on a free port (``GATEWAY_PORT``): the
   test waits for the line it says it prints, ``gateway: dashboard at ...``;
2. the first block of "From a task to a live progress bar", in a second shell: it creates a task and prints
   the link to open, which Chromium opens (the card shows the task, queued);
3. the second block in the same shell (its variables kept): the worker's start, progress every second,
   succeed. The page sees the bar move: every value the card's progress bar took is recorded as it
   changes (a MutationObserver from the first script on), and they must rise through the values in
   between while the task runs, then reach 100 as it succeeds.

The packages the first command installs are already in this test's environment, and a fresh venv takes
them from there (a ``.pth`` line, :func:`venv_seeded_from_ours`): ``pip install -e .`` then installs the
checkout alone, in seconds rather than the minute a download and install of every package takes. Whether
those packages install into a new venv is what the README's test command shows, every run.

Then Ctrl-C stops the gateway, as a newcomer would, with exit 0. The blocks are read from the README (those
marked ``run by tests/browser/test_first_hour.py``), the address ``localhost:8000`` turned to the port.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.browser.conftest import Console
from tests.support import doc_blocks, wait_until
from tests.support.processes import DASHBOARD, GatewayProcess, free_port

THIS = "tests/browser/test_first_hour.py"
# The README's "first screen": what a reader sees before scrolling far.
FIRST_SCREEN_LINES = 60
INSTALL_S = 300.0  # a venv and pip install -e . on a loaded machine (seconds on a quiet one)
WORKER_S = 60.0  # the worker block: 9 progress reports a second apart
LINK = re.compile(r"Open (http://\S+)")


def newcomer_blocks() -> list[doc_blocks.Block]:
    blocks = [b for b in doc_blocks.blocks("README.md") if b.runner == THIS]
    assert len(blocks) == 3, [b.where for b in blocks]
    assert all(b.line < FIRST_SCREEN_LINES for b in blocks), [b.where for b in blocks]
    return blocks


def fresh_clone(destination: Path) -> None:
    """The files a clone of this checkout would have, as they are in the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=doc_blocks.ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = doc_blocks.ROOT / name.decode()
        if source.is_file():  # a file deleted in the working tree is not in the next clone either
            target = destination / name.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def venv_seeded_from_ours(clone: Path, env: dict[str, str]) -> None:
    """``clone/.venv``, made as the README makes it, whose interpreter also finds the packages of this
    test's environment (a ``.pth`` line naming our site-packages). The README's ``python3 -m venv .venv``
    finds it made; its ``pip install -e .`` finds every requirement there and installs the checkout alone.
    The checkout installed in our environment is not seen: a ``.pth`` line adds a folder to the path, not
    the editable installs its own ``.pth`` files declare."""
    subprocess.run(["python3", "-m", "venv", ".venv"], cwd=clone, env=env, check=True)
    made = subprocess.run(
        [".venv/bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    (Path(made) / "test-environment.pth").write_text(f"{ours}\n")


def newcomer_environ() -> dict[str, str]:
    """A shell with no venv active and none of the gateway's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_") and k != "VIRTUAL_ENV"}
    ours = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != ours)
    return env


@pytest.mark.anyio
async def test_the_readme_first_screen_leads_to_a_live_progress_bar(
    context: Any, console: Console, tmp_path: Path
) -> None:
    from playwright.async_api import expect

    serve, create, work = newcomer_blocks()
    clone = tmp_path / "task-gateway"
    fresh_clone(clone)
    env = newcomer_environ()
    venv_seeded_from_ours(clone, env)
    port = free_port()
    log = tmp_path / "first-terminal.log"
    with log.open("wb") as out:
        first = await anyio.open_process(
            ["bash", "-c", serve.text],
            cwd=clone,
            env={**env, "GATEWAY_PORT": str(port)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the terminal's process group: Ctrl-C reaches pip, then the gateway
        )
    terminal = GatewayProcess("the README's first command", first, log)
    try:
        dashboard = (await terminal.wait_for(DASHBOARD, timeout_s=INSTALL_S))[0].group(1).decode()
        assert dashboard == f"http://127.0.0.1:{port}"

        # The second terminal: the first block, then (once the page is open) the second, in one shell.
        second = await anyio.open_process(
            [
                "bash",
                "-c",
                f"{doc_blocks.local(create.text, port)}\nread -r _\n{doc_blocks.local(work.text, port)}",
            ],
            cwd=clone,
            env=env,
            stdin=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        async with second:
            assert second.stdout is not None and second.stdin is not None
            said = ""
            with anyio.fail_after(30):
                while (found := LINK.search(said)) is None:
                    said += (await second.stdout.receive()).decode()
            link = found.group(1)
            task_id = re.search(r"[?&]task=([^&]+)", link)
            assert link.startswith(f"{dashboard}/?task=") and task_id is not None, said

            page = await context.new_page()
            page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console.page_errors.append(str(e)))
            await page.goto(link)
            card = page.locator(f'article.task-card[data-task-id="{task_id.group(1)}"]')
            await expect(card).to_have_attribute("data-state", "queued")

            await second.stdin.send(b"\n")  # the page is open: be the worker
            with anyio.fail_after(WORKER_S):
                said = b"".join([chunk async for chunk in second.stdout]).decode()
                assert await second.wait() == 0, said
            assert said.split() == ["200"] * 11, said  # start, 9 progress reports, succeed: each answered

            await expect(card).to_have_attribute("data-state", "succeeded")
            await expect(card.get_by_role("progressbar")).to_have_attribute("aria-valuenow", "100")
            seen: dict[str, Any] = await page.evaluate("window.__seen")
            progress: list[int] = seen["cards"][task_id.group(1)]["progress"]
            states: list[str] = seen["cards"][task_id.group(1)]["state"]
            # Live: the bar took the values in between, one after the other, as the worker sent them.
            between = [p for p in progress if 0 < p < 100]
            assert len(set(between)) >= 5 and between == sorted(between), progress
            assert progress[-1] == 100 and "running" in states and states[-1] == "succeeded", (
                progress,
                states,
            )
            await page.close()
    except BaseException:
        print(f"\n----- {terminal.name}: {log} -----\n{terminal.tail()}")
        raise
    finally:
        # Ctrl-C, as a newcomer stops it: to the terminal's whole process group.
        if first.returncode is None:
            os.killpg(first.pid, signal.SIGINT)
            with anyio.move_on_after(15):
                await first.wait()
        if first.returncode is None:
            os.killpg(first.pid, signal.SIGKILL)
            await first.wait()
    assert first.returncode == 0, terminal.tail()
    await wait_until(
        lambda: "Application shutdown complete" in terminal.output(), "the gateway's clean stop", 5
    )
    console.assert_clean()
