"""``gateway watch``: a terminal view of one task (state, a live progress bar, each entry as it comes).

What goes wrong with the link (once per distinct failure) and why it gave up go to stderr; while the bar is
live on a terminal, rich shows what is written to stderr above it."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

from gateway.client.watch import LinkStatus, WatchError, watch

EXIT_CODES = {"succeeded": 0, "failed": 1, "expired": 3}
EXIT_ERROR = 4


def describe(event: dict[str, Any]) -> str:
    kind = event["type"]
    if kind == "start":
        return f"started by {event['worker']}"
    if kind == "progress":
        return f"progress {event['progress']}%" + (f" ({event['cursor']})" if event.get("cursor") else "")
    if kind == "succeed":
        return f"succeeded: {event['resultRef']}"
    if kind == "fail":
        return f"failed{' (retryable)' if event['retryable'] else ''}: {event['error']}"
    if kind == "cancel":
        return "cancelled" + (f": {event['reason']}" if event.get("reason") else "")
    return "expired"


async def watch_in_terminal(
    base_url: str, task_id: str, token: str | None, cursor: int = 0, console: Console | None = None
) -> int:
    """Show the task until it is terminal; returns 0 (succeeded), 1 (failed), 3 (expired) or 4 (error)."""
    console = console or Console()
    state = "unknown"
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(task_id, total=100)

        def on_status(status: LinkStatus) -> None:
            # Once per change of the link or distinct failure, never once per attempt.
            print(status.message, file=sys.stderr, flush=True)

        try:
            frames = watch(base_url, {task_id: token}, cursors={task_id: cursor}, on_status=on_status)
            async for frame in frames:
                task = frame["task"]
                state = task["state"]
                kind = frame["type"]
                if kind == "event":
                    progress.console.print(f"v{frame['version']}  {describe(frame['event'])}")
                else:
                    reason = f" ({frame['reason']})" if frame.get("reason") else ""
                    progress.console.print(f"v{frame['version']}  resumed: {kind}{reason}")
                    for entry in frame.get("events", ()):
                        progress.console.print(f"v{entry['version']}  {describe(entry['event'])}")
                progress.update(
                    bar,
                    completed=task["progress"],
                    description=f"{task_id}  {state}  attempt {task['attempts']}/{task['maxAttempts']}",
                )
        except WatchError as exc:
            print(f"gateway watch: giving up: {exc}", file=sys.stderr, flush=True)
            return EXIT_ERROR
    console.print(f"{task_id}: {state}")
    return EXIT_CODES.get(state, EXIT_ERROR)
