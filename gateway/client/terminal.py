"""``gateway watch``: a terminal view of one task (state, a live progress bar, each entry as it comes), or
with ``--tag`` of every task carrying a tag (a line per change, each task's id first, new tasks as they are
created, until Ctrl-C). With ``--stream NAME``, the task's stream instead: its text on stdout as the worker
writes it (nothing else there, so that it can be piped or saved), its entries on stderr, and a new
attempt's text after a line on stderr that says the output starts over.

What goes wrong with the link (once per distinct failure) and why it gave up go to stderr; while the bar is
live on a terminal, rich shows what is written to stderr above it. Nothing of the task is shown before its
first frame (a task it was refused has no bar). When its reader goes away (``gateway watch ... | head``) it
stops quietly, with the exit code of a tool that SIGPIPE ended."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable
from contextlib import ExitStack, aclosing
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

from gateway.client.watch import LinkStatus, WatchError, watch, watch_tag

EXIT_CODES = {"succeeded": 0, "failed": 1, "expired": 3}
EXIT_ERROR = 4
EXIT_READER_GONE = 141  # 128 + SIGPIPE, as a shell reports a tool whose reader went away


class _Console(Console):
    """rich's console, whose broken pipe is raised to :func:`watch_in_terminal` rather than ending the
    process with exit code 1 (which says "failed" here)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def _reader_gone() -> int:
    """stdout's reader is gone: what is still buffered for it goes nowhere, not to a traceback at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_READER_GONE


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
    base_url: str,
    task_id: str,
    token: str | None,
    cursor: int = 0,
    console: Console | None = None,
    stream: str | None = None,
) -> int:
    """Show the task until it is terminal; returns 0 (succeeded), 1 (failed), 3 (expired) or 4 (error)."""
    if stream is not None:
        return await _exit_code(_stream_in_terminal(base_url, task_id, token, cursor, stream))
    console = console or _Console()
    # A title is the user's text, never rich markup.
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), TaskProgressColumn())

    async def shown() -> str:
        state = "unknown"
        line = _Line()  # the title, the status line and the batch's counts, each printed when it changes
        with ExitStack() as stack:
            progress: Progress | None = None  # the bar, from the first frame on
            frames = watch(base_url, {task_id: token}, cursors={task_id: cursor}, on_status=_say_status)
            async with aclosing(frames):
                async for frame in frames:
                    if progress is None:
                        progress = stack.enter_context(Progress(*columns, console=console, transient=False))
                        bar = progress.add_task(task_id, total=100)
                    kind = frame["type"]
                    if kind in ("metadata", "children"):
                        for said in line.live(frame):
                            progress.console.print(said, markup=False, highlight=False)  # the user's text
                        continue
                    task = frame["task"]
                    state = task["state"]
                    for said in line.task(task_id, task):
                        progress.console.print(said, markup=False, highlight=False)
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
                        description=f"{line.name or task_id}  {state}  "
                        f"attempt {task['attempts']}/{task['maxAttempts']}",
                    )
        console.print(f"{task_id}: {state}")
        return state

    return await _exit_code(shown())


async def _stream_in_terminal(base_url: str, task_id: str, token: str | None, cursor: int, name: str) -> str:
    """The text of the task's stream ``name`` on stdout as it comes, the task's entries on stderr, until
    the task and its stream have ended; returns the task's state."""
    state = "unknown"
    held: tuple[int, int] | None = None  # the attempt printed and the offset after its last chunk
    ends_line = True  # what stdout has printed ends a line (or nothing was printed)

    def note(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    followed = {task_id: {name: 0}}
    frames = watch(
        base_url, {task_id: token}, cursors={task_id: cursor}, streams=followed, on_status=_say_status
    )
    async with aclosing(frames):
        async for frame in frames:
            kind = frame["type"]
            if kind == "chunks":
                if held is not None and held != (frame["attempt"], frame["offset"]):
                    # A retry's output (or the stream sent again from its attempt's start) replaces it.
                    if not ends_line:
                        print(flush=True)
                    note(f"{task_id}: the output starts over (attempt {frame['attempt']})")
                text = "".join(frame["chunks"])
                sys.stdout.write(text)
                sys.stdout.flush()
                ends_line = text.endswith("\n") if text else ends_line
                held = (frame["attempt"], frame["offset"] + len(frame["chunks"]))
            elif kind == "event":
                state = frame["task"]["state"]
                note(f"v{frame['version']}  {describe(frame['event'])}")
            elif kind not in ("end", "metadata", "children"):
                state = frame["task"]["state"]
                note(f"v{frame['version']}  {kind}: {_summary(frame['task'])}")
    if not ends_line:
        print(flush=True)
    note(f"{task_id}: {state}")
    return state


async def _exit_code(shown: Awaitable[str]) -> int:
    """The exit code of what ``shown`` followed: the task's end, a refusal (4) or its reader gone (141)."""
    try:
        state = await shown
    except WatchError as exc:
        print(f"gateway watch: giving up: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except BrokenPipeError:
        return _reader_gone()
    return EXIT_CODES.get(state, EXIT_ERROR)


class _Line:
    """What ``gateway watch`` prints of a task beside its history: its title (with its id, once), its status
    line (``metadata.message``) and a batch's counts, each when it changes; a frame's or a task's metadata
    and counts only when not older than those printed (their ``revision``: a metadata frame may come before
    an event frame whose task holds the metadata before it)."""

    def __init__(self) -> None:
        self.name: str | None = None  # the title, once known
        self.message: str | None = None
        self.children: dict[str, Any] | None = None
        self.revision = -1

    def task(self, task_id: str, task: dict[str, Any]) -> list[str]:
        said = []
        title = task.get("title")
        if isinstance(title, str) and title != self.name:
            self.name = title
            said.append(f"{title}  ({task_id})")
        if not self._newer(task.get("revision")):
            return said
        said += self._message(task.get("metadata"))
        said += self._children(task.get("children"))
        return said

    def live(self, frame: dict[str, Any]) -> list[str]:
        if not self._newer(frame.get("revision")):
            return []
        if frame["type"] == "metadata":
            return self._message(frame.get("metadata"))
        return self._children(frame.get("children"))

    def _newer(self, revision: Any) -> bool:
        """Whether what carries ``revision`` is not older than what was printed (no revision: taken)."""
        if not isinstance(revision, int):
            return True
        if revision < self.revision:
            return False
        self.revision = revision
        return True

    def _message(self, metadata: Any) -> list[str]:
        text = metadata.get("message") if isinstance(metadata, dict) else None
        if not isinstance(text, str) or text == self.message:
            return []
        self.message = text
        return [f"  {text}"]

    def _children(self, children: Any) -> list[str]:
        if not isinstance(children, dict) or children == self.children:
            return []
        self.children = children
        counts = ", ".join(f"{children.get(k, 0)} {k}" for k in COUNTED)
        return [f"  children: {children.get('total', 0)} ({counts})"]


# A batch's counts, in the order printed.
COUNTED = ("queued", "running", "succeeded", "failed", "expired")


def _say_status(status: LinkStatus) -> None:
    # Once per change of the link or distinct failure, never once per attempt.
    print(status.message, file=sys.stderr, flush=True)


def _summary(task: dict[str, Any]) -> str:
    return f"{task['state']} {task['progress']}%, attempt {task['attempts']}/{task['maxAttempts']}"


async def watch_tag_in_terminal(base_url: str, tag: str, token: str | None) -> int:
    """Print the tasks carrying ``tag`` and each change of each, as ``gateway watch`` prints one task's,
    each line starting with the task's id, until interrupted; returns 4 when the gateway refuses (a bad
    token, a token for another tag) or cannot be a gateway."""
    shown: set[str] = set()  # the tasks whose state was printed once
    ended: set[str] = set()  # the tasks whose end was printed
    lines: dict[str, _Line] = {}  # each task's title, status line and counts, as printed

    def out(line: str) -> None:
        print(line, flush=True)

    frames = watch_tag(base_url, tag, token, on_status=_say_status)
    try:
        async with aclosing(frames):
            async for frame in frames:
                kind = frame["type"]
                if kind == "tag":
                    more = " (the newest; older ones are not listed)" if frame["more"] else ""
                    count = len(frame["taskIds"])
                    out(f"{tag}: {count} task{'' if count == 1 else 's'}{more}")
                    continue
                if kind == "added":
                    out(f"{frame['taskId']}  added")
                    continue
                line = lines.setdefault(frame["taskId"], _Line())
                if kind in ("metadata", "children"):
                    for said in line.live(frame):
                        out(f"{frame['taskId']}{said}")
                    continue
                task_id, task, version = frame["taskId"], frame["task"], frame["version"]
                for said in line.task(task_id, task):
                    out(said if said.endswith(f"({task_id})") else f"{task_id}{said}")
                if kind == "event":
                    out(f"{task_id}  v{version}  {describe(frame['event'])}")
                elif task_id not in shown:
                    out(f"{task_id}  v{version}  {_summary(task)}")
                elif kind == "snapshot":
                    out(f"{task_id}  v{version}  resumed: snapshot ({frame['reason']})  {_summary(task)}")
                else:
                    for entry in frame.get("events", ()):
                        out(f"{task_id}  v{entry['version']}  {describe(entry['event'])}")
                if task["state"] in EXIT_CODES and task_id not in ended:
                    if task_id in shown:
                        out(f"{task_id}: {task['state']}")
                    ended.add(task_id)
                shown.add(task_id)
    except WatchError as exc:
        print(f"gateway watch: giving up: {exc}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    except BrokenPipeError:
        return _reader_gone()
    return EXIT_ERROR  # pragma: no cover  (watch_tag ends only by an error or an interrupt)
