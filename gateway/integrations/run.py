"""``Run``: one run of one job, as the job's own code sees it; what it asks to report waits in its record
(``runstate.py``) for the process's sender thread (``sender.py``), whose core (``outbox.py``) decides what
to send.

The job's side never does I/O: ``progress()`` is a lock and an assignment (the latest value replaces one the
sender has not taken yet: coalescing), ``succeed``/``fail`` leave the outcome, and only ``finish()`` waits,
for a bounded time, for the sender to have said everything. Whoever touches the record (the job's thread,
the sender's) holds ``lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from gateway.client.merge_patch import MESSAGE, check_patch
from gateway.integrations.runstate import OVER, RunState
from gateway.integrations.ticket import GatewayConfig, Ticket, error_text, result_hash, result_ref

log = logging.getLogger("gateway.integrations")


class Run(RunState):
    """One run of a job: reports its progress and outcome to the gateway task ``task_id``.

    ``attempt`` is the attempt its ``start`` began (``None`` until the gateway has answered it). ``started``
    is set once its start is answered (or given up, or the gateway cannot be reached), ``settled`` once
    nothing is left to send."""

    # The settings and ticket as install() and the job's message gave them (the record needs less of them).
    config: GatewayConfig
    ticket: Ticket | None

    def __init__(
        self,
        task_id: str,
        *,
        worker: str,
        ticket: Ticket | None,
        scheme: str,
        config: GatewayConfig,
        wake: Callable[[], None],
        cancel: Callable[[Run, str | None], Any],
        rerun: bool = False,
    ) -> None:
        self.lock = threading.Lock()
        self.started = threading.Event()
        self.settled = threading.Event()
        ttl_ms = ticket.ttl_ms if ticket is not None else config.ttl_ms
        super().__init__(
            task_id,
            worker=worker,
            ticket=ticket,
            scheme=scheme,
            config=config,
            expires_at_ms=time.time() * 1000 + ttl_ms,  # the task's deadline, bounded above until known
            rerun=rerun,
        )
        self._wake = wake
        self._cancel = cancel
        self._dropped: set[str] = set()  # the streams a dropped write was said of
        self._patches_dropped = False  # a dropped metadata patch was said

    def unblock(self) -> None:
        self.started.set()

    def over(self) -> None:
        super().over()
        self.started.set()
        self.settled.set()

    # --- the job's side -------------------------------------------------------------------------------------

    def progress(self, value: int, cursor: str = "") -> None:
        """Report ``value`` (0 to 100; ``cursor``: the job's bookmark). Never blocks: at most one callback
        goes per ``min_interval_s`` and the latest value is the one sent. Raises
        :class:`~gateway.client.TaskCancelled` once the gateway has said the task was cancelled."""
        if self.cancelled is not None:
            raise self.cancelled
        if not 0 <= value <= 100:
            raise ValueError(f"progress must be from 0 to 100, not {value!r}")
        with self.lock:
            taken = self.latest is None
            self.latest = (value, cursor)
        if taken:  # the sender may be asleep with nothing to do: tell it
            self._wake()

    def write(self, name: str, text: str) -> None:
        """Append ``text`` to the task's stream ``name`` (protocol.md, Streams). Never blocks: kept, and sent
        by the process's sender thread 50 ms after the oldest write not sent (at once past 64 KiB), all of
        it before the outcome; a batch whose answer was lost goes again with the same ``seq``. Raises
        :class:`~gateway.client.TaskCancelled` once the task was cancelled,
        :class:`~gateway.client.AttemptOver` once it went on without this run; ``ValueError`` for a name
        that is not a stream's. Past 16 MiB of a stream's text unsent (the gateway out of reach), or once the
        gateway refused the stream's text, what is written is dropped (said once)."""
        if self.cancelled is not None:
            raise self.cancelled
        if self.gone is not None:
            raise self.gone
        with self.lock:
            out = self.streams.get(name)
            idle = out is None or out.since is None
            kept = self.write_kept(name, text, time.monotonic())
            due_now = kept and self.streams[name].full()
        if not kept and name not in self._dropped:
            self._dropped.add(name)
            if name in self.refused_streams:
                why = "the gateway refused its text"
            elif self.phase == OVER or self.ended:
                why = "the run reports nothing more"
            else:
                why = "16 MiB of its text wait unsent"
            log.warning(
                "task-gateway: task %s: dropping what the job writes to stream %s (%s)",
                self.task_id,
                name,
                why,
            )
        if kept and (idle or due_now):  # the sender may be asleep with nothing to send: tell it
            self._wake()

    def metadata(self, patch: Mapping[str, Any]) -> None:
        """Merge ``patch`` into the task's metadata (RFC 7396: ``None`` removes a key; protocol.md, Metadata),
        shown live to whoever follows the task. Never blocks: kept, and sent by the process's sender thread
        after what the job reported before it (its progress), as this run's attempt, all of it before the
        outcome; waiting patches that one patch can say go as one, and a patch whose answer was lost goes
        again. Raises :class:`~gateway.client.TaskCancelled` once the task was cancelled,
        :class:`~gateway.client.AttemptOver` once it went on without this run, ``ValueError`` for a patch
        that is not a JSON object of at most 8 KiB. A patch the gateway refuses (the metadata would pass
        8 KiB) is dropped, with a WARNING."""
        if self.cancelled is not None:
            raise self.cancelled
        if self.gone is not None:
            raise self.gone
        checked = check_patch(patch)
        with self.lock:
            kept = self.metadata_kept(checked)
        if kept:
            self._wake()
        elif not self._patches_dropped:
            self._patches_dropped = True
            log.warning(
                "task-gateway: task %s: dropping the job's metadata patches (the run reports nothing more)",
                self.task_id,
            )

    def message(self, text: str) -> None:
        """The status line a person reads under the progress bar (``metadata.message``):
        ``metadata({"message": text})``."""
        self.metadata({MESSAGE: text})

    def succeed(self, value: Any) -> None:
        """The job returned ``value``: ``resultRef`` is a returned string, else ``<scheme>://<task id>``;
        ``resultHash`` the SHA-256 of its JSON. Sent after the latest progress."""
        event = {
            "type": "succeed",
            "resultRef": result_ref(value, self.scheme, self.task_id),
            "resultHash": result_hash(value),
        }
        self._end(event)

    def fail(self, error: BaseException | str, *, retryable: bool) -> None:
        """The job failed: ``retryable`` when the queue will run it again (the gateway requeues the task
        while it has attempts left)."""
        self._end({"type": "fail", "error": error_text(error), "retryable": retryable})

    def _end(self, event: dict[str, Any]) -> None:
        with self.lock:
            if self.outcome is None:
                self.outcome = event
        self._wake()

    def cancel(self, reason: str | None = None) -> None:
        """The queue revoked the job: cancel its gateway task (the API key's ``POST .../cancel``). Never
        blocks: the sender sends it once this run's start is answered (the task made first, if the run makes
        it), retried like the run's callbacks until the task's deadline."""
        self._cancel(self, reason)

    def finish(self) -> None:
        """The run is over. Waits, at most ``timeout_s`` and not at all while the gateway cannot be reached,
        for what it reported to be answered; the rest is sent in the background until the task's deadline."""
        with self.lock:
            self.finished = True
        self._wake()
        if not self.unreachable:
            self.settled.wait(self.config.timeout_s)

    # --- another process takes over ------------------------------------------------------------------------

    def pending(self) -> dict[str, Any] | None:
        """What this finished run has not had answered yet, for another process to send (an RQ work horse
        exits after its job: its worker's main process sends the rest, :meth:`Reporter.adopt`); ``None``
        when nothing is left. From now on this process's sender sends nothing more of the run (a request
        on its way may still arrive: every callback id but the start's is stable, and the start's is handed
        over with it, so a repeat changes nothing). JSON-able: the callback token, the attempt, the ids and
        the deadline go with it."""
        with self.lock:
            return super().pending()

    def resume(self, pending: Mapping[str, Any]) -> None:
        """Take up where the run ``pending`` (:meth:`pending`, in another process) stopped: a finished run
        whose remaining callbacks go with their ids, in their order."""
        with self.lock:
            super().resume(pending)
