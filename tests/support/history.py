"""A history checker: what clients saw during a test (every frame, every answer), checked at the end against
the invariants a user relies on, whatever faults happened meanwhile.

Record with :meth:`History.created` (each task as created), :meth:`History.frame` (each frame a
subscriber received, ``subscriber`` naming one logical subscriber across its reconnections),
:meth:`History.callback` (each answer to a callback try, or a transport failure),
:meth:`History.delivery`, :meth:`History.notification` (each drained or relayed notification) and
:meth:`History.final` (each task's whole history as the store holds it at the end,
``GET /v1/tasks/{id}/events?cursor=0``); then :meth:`History.check` raises one ``AssertionError`` listing
every violation:

- per subscriber and task, versions only grow, and never skip outside a snapshot: an ``event`` is at the
  version held + 1, a ``delta`` starts at the version held + 1 with consecutive entries, a ``caught-up`` is
  at the version held; a ``snapshot`` may jump forward, never back;
- one terminal state per task, whoever saw it (frames, callback answers, notifications, the store);
- nothing after a terminal state: no frame with a newer version once a subscriber held a terminal task, and
  no history entry after the one that ended the task;
- at most one notification per terminal state (relayed ones counted once per ``webhook-id``: the relay is
  at least once, the receiver deduplicates), and its state is the task's;
- a delivery key always returns the same receipt;
- every callback answered 2xx that changed the task has its event in the history exactly once; one whose
  only 2xx answers were ``duplicateCallback`` (an earlier try applied it, its answer lost) at most once;
- ``cancel`` is the gateway's own event (recorded with :meth:`History.cancel`): a history holds at most one
  ``cancel`` entry, as its last (the task ends ``failed`` with ``error: "cancelled"``), and a cancel
  answered ``cancelled`` has exactly that entry.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from gateway.machine import TERMINAL, apply_event, event_from_json, task_from_json

RESUMES = ("caught-up", "delta", "snapshot")


@dataclass
class _Callback:
    task_id: str
    event: dict[str, Any]
    answers: list[dict[str, Any]] = field(default_factory=list)  # the 2xx answers' JSON


@dataclass
class History:
    # (subscriber, task id) -> frames in the order received
    frames: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    callbacks: dict[str, _Callback] = field(default_factory=dict)
    receipts: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    # (task id, state, dedupe key or None) as seen by a drain or a webhook receiver
    notifications: list[tuple[str, str, str | None]] = field(default_factory=list)
    finals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    bases: dict[str, dict[str, Any]] = field(default_factory=dict)
    answers: Counter[str] = field(default_factory=Counter)
    # task id -> the 2xx answers of its cancels (the gateway's own event, not a callback)
    cancels: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))

    # --- recording ----------------------------------------------------------------------------------------

    def created(self, task: dict[str, Any]) -> None:
        """A task as its create answered (``task``): the base its history is replayed on."""
        self.bases[task["id"]] = task

    def frame(self, subscriber: str, frame: dict[str, Any], task_id: str | None = None) -> None:
        """A frame a subscriber received (``task_id`` where the frame does not name it)."""
        key = task_id or frame.get("taskId") or frame.get("task", {}).get("id")
        if key is None:  # a pong, an error frame about no task
            return
        self.frames[(subscriber, str(key))].append(frame)

    def callback(
        self,
        task_id: str,
        callback_id: str,
        event: dict[str, Any],
        status: int | None,
        answer: dict[str, Any] | None = None,
    ) -> None:
        """One try of a callback: its status (``None``: no answer) and, for a 2xx, the answer's JSON."""
        self.answers["transport" if status is None else str(status)] += 1
        seen = self.callbacks.setdefault(callback_id, _Callback(task_id, event))
        if status is not None and 200 <= status < 300 and answer is not None:
            seen.answers.append(answer)

    def cancel(self, task_id: str, status: int | None, answer: dict[str, Any] | None = None) -> None:
        """One try of ``POST /v1/tasks/{id}/cancel``: its status (``None``: no answer) and, for a 2xx, the
        answer's JSON."""
        self.answers["transport" if status is None else str(status)] += 1
        if status is not None and 200 <= status < 300 and answer is not None:
            self.cancels[task_id].append(answer)

    def delivery(self, idempotency_key: str, status: int, answer: dict[str, Any]) -> None:
        if 200 <= status < 300:
            self.receipts[idempotency_key].append(answer["receipt"])

    def notification(self, item: dict[str, Any], dedupe_key: str | None = None) -> None:
        """A notification a drain returned (``dedupe_key`` None) or a receiver got (its ``webhook-id``)."""
        self.notifications.append((item["taskId"], item["state"], dedupe_key))

    def final(self, task_id: str, history: dict[str, Any]) -> None:
        """The task's whole history at the end (the answer to ``GET .../events?cursor=0``, a delta)."""
        assert history["mode"] == "delta", history
        self.finals[task_id] = list(history["events"])

    # --- checking -----------------------------------------------------------------------------------------

    def check(self) -> None:
        problems: list[str] = []
        terminal: dict[str, set[str]] = defaultdict(set)
        for (subscriber, task_id), frames in self.frames.items():
            problems += _check_stream(subscriber, task_id, frames, terminal[task_id])
        for callback in self.callbacks.values():
            for answer in callback.answers:
                if answer["task"]["state"] in TERMINAL:
                    terminal[callback.task_id].add(answer["task"]["state"])
        for task_id, answers in self.cancels.items():
            for answer in answers:
                if answer["task"]["state"] in TERMINAL:
                    terminal[task_id].add(answer["task"]["state"])
        for task_id, entries in self.finals.items():
            problems += _check_entries(task_id, entries, self.bases.get(task_id), terminal[task_id])
        notified: dict[tuple[str, str], set[str]] = defaultdict(set)
        drained: Counter[tuple[str, str]] = Counter()
        for task_id, state, dedupe in self.notifications:
            terminal[task_id].add(state)
            if dedupe is None:
                drained[(task_id, state)] += 1
            else:
                notified[(task_id, state)].add(dedupe)
        for (task_id, state), count in drained.items():
            if count > 1:
                problems.append(f"{task_id}: {count} drained notifications of {state}")
        for (task_id, state), ids in notified.items():
            if len(ids) > 1:
                problems.append(
                    f"{task_id}: {len(ids)} relayed notifications of {state}: {sorted(map(str, ids))}"
                )
        for task_id, states in terminal.items():
            if len(states) > 1:
                problems.append(f"{task_id}: more than one terminal state seen: {sorted(states)}")
        for key, receipts in self.receipts.items():
            if any(r != receipts[0] for r in receipts):
                problems.append(f"delivery key {key!r}: different receipts {receipts}")
        problems += self._check_effects()
        if problems:
            shown = "\n  ".join(problems[:30])
            raise AssertionError(f"{len(problems)} history violations:\n  {shown}")

    def _check_effects(self) -> list[str]:
        problems = []
        for task_id, answers in self.cancels.items():
            entries = self.finals.get(task_id)
            if entries is None or not any(a["reason"] == "cancelled" for a in answers):
                continue
            found = sum(e["event"]["type"] == "cancel" for e in entries)
            if found != 1:
                problems.append(f"{task_id}: answered as cancelled, {found} cancel entries in the history")
        for callback_id, callback in self.callbacks.items():
            entries = self.finals.get(callback.task_id)
            if entries is None or not callback.answers:
                continue
            found = sum(_without_at(e["event"]) == callback.event for e in entries)
            if any(a.get("changed") for a in callback.answers):
                if found != 1:
                    problems.append(f"{callback_id}: answered as applied, {found} times in the history")
            elif all(a.get("duplicateCallback") for a in callback.answers) and found > 1:
                problems.append(f"{callback_id}: applied by a lost try, {found} times in the history")
        return problems


def _without_at(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k != "atMs"}


def _check_stream(
    subscriber: str, task_id: str, frames: list[dict[str, Any]], terminal: set[str]
) -> list[str]:
    where = f"{subscriber} on {task_id}"
    problems = []
    held: int | None = None  # the version the subscriber holds (None: nothing yet)
    ended_at: int | None = None  # the version at which it held a terminal task
    for n, frame in enumerate(frames):
        kind, version = frame.get("type"), frame.get("version")
        if kind not in (*RESUMES, "event") or not isinstance(version, int):
            continue
        if ended_at is not None and version > ended_at:
            problems.append(f"{where}: frame {n} ({kind} v{version}) after the terminal state at v{ended_at}")
        if held is not None:
            if version < held:
                problems.append(f"{where}: frame {n} ({kind}) goes back from v{held} to v{version}")
            elif kind == "event" and version != held + 1:
                problems.append(f"{where}: frame {n} event at v{version}, holding v{held} (a skip)")
            elif kind == "caught-up" and version != held:
                problems.append(f"{where}: frame {n} caught-up at v{version}, holding v{held}")
            elif kind == "delta":
                versions = [e["version"] for e in frame.get("events", [])]
                if versions != list(range(held + 1, version + 1)):
                    problems.append(f"{where}: frame {n} delta {versions}, holding v{held}, to v{version}")
        held = version if held is None else max(held, version)
        state = frame.get("task", {}).get("state")
        if state in TERMINAL:
            terminal.add(state)
            ended_at = version if ended_at is None else min(ended_at, version)
    return problems


def _check_entries(
    task_id: str, entries: list[dict[str, Any]], base: dict[str, Any] | None, terminal: set[str]
) -> list[str]:
    """The store's history: versions 1..n in order and, replayed on the state machine from the task as
    created (where known), nothing after the entry that ended the task; its terminal state joins the
    others seen."""
    problems = []
    versions = [e["version"] for e in entries]
    if versions != list(range(1, len(entries) + 1)):
        problems.append(f"{task_id}: history versions {versions}")
    cancels = [e["version"] for e in entries if e["event"]["type"] == "cancel"]
    if cancels and cancels != [versions[-1]]:
        problems.append(f"{task_id}: cancel entries at {cancels}, not one ending the history")
    if base is None:
        return problems
    task = task_from_json(base)
    for entry in entries:
        if task.state in TERMINAL:
            problems.append(f"{task_id}: entry v{entry['version']} after the terminal state {task.state}")
            break
        task = apply_event(task, event_from_json(entry["event"])).task
    if task.state in TERMINAL:
        terminal.add(task.state)
    return problems
