"""``gateway serve --workers N``: N gateway processes accepting on one port.

The parent binds the port once and starts N children (spawned, so each builds its own event loop,
database pool and bus listener); each child is a whole gateway, and news of commits travels between them
on the bus. A child that dies is started again; SIGTERM or SIGINT stops them all, each saying ``1001`` to
its subscribers first, who reconnect to another process (or the next deployment) with their cursors. A
child whose parent is gone (killed with SIGKILL) stops too, the same way.

On Linux each child accepts on a listening socket of its own, bound to the port with ``SO_REUSEPORT``: the
kernel hands each new connection to one of them by a hash of its addresses, so the children hold even
shares. (On one shared socket, whichever child woke first took the connection: at 47,000 sockets over 6
children one held 17,889 and another 3,084, so one reached its descriptor limit while others idled.) The
parent's own socket holds the port and is never listened on: it takes no connections, and a second
``gateway serve`` on the port fails at start (its bound socket, without ``SO_REUSEPORT``, conflicts with
the children's listening ones). Elsewhere the children share the parent's socket.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import secrets
import signal
import socket
import sys
import threading
import time
from multiprocessing.process import BaseProcess
from types import FrameType

from pydantic import SecretStr

from gateway.settings import Settings

log = logging.getLogger("gateway")

# How long a stop waits for a child to close its sockets before it is killed.
STOP_GRACE_S = 15.0
# How often the parent looks at its children.
WATCH_S = 0.5
# A child that dies is restarted after a pause that doubles while the children of its slot keep dying (a
# crash loop must not spin the CPU), back to the first once the slot's child has lived a while
# (GATEWAY_WORKER_STABLE_S).
RESTART_DELAY_S = (1.0, 30.0)
# The exit code of a process that could not start (uvicorn's).
STARTUP_FAILED = 3
# The accept queue of each child's listening socket (uvicorn's default; its server listens again with it).
BACKLOG = 2048


def serve_workers(
    settings: Settings, workers: int, *, deployment_id: str, secret_source: str | None = None
) -> int:
    """Run ``workers`` gateway processes; ``secret_source`` says where ``settings.secret`` came from and
    ``deployment_id`` is the database's (for the start-up lines, said here once rather than by every
    child)."""
    from gateway.server.serve import bind_socket
    from gateway.server.startup import announce

    if settings.secret is None:
        # Every child must sign and accept the same tokens: one random secret for all, made here.
        settings = settings.model_copy(update={"secret": SecretStr(secrets.token_urlsafe(32))})
        log.warning(
            "GATEWAY_SECRET is not set: the %d workers share a random secret made at start; tokens stop "
            "working when the gateway restarts (set GATEWAY_SECRET to keep them)",
            workers,
        )
    sock = bind_socket(settings.host, settings.port)  # bound, never listened on: it holds the port
    host, port = sock.getsockname()[:2]
    spread = reuseport_available()
    log.info("%d worker processes on http://%s:%d", workers, host, port)
    announce(settings, secret_source, host, port, deployment_id=deployment_id)
    context = multiprocessing.get_context("spawn")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def start(index: int) -> tuple[BaseProcess, float]:
        # Each child gets a listening socket of its own, made here (listening before the child starts, so
        # the port stays taken while children start) and passed to it; this process's copy is closed at
        # once, so that the socket lives and dies with its child (a restarted child gets a new one).
        listener = reuseport_listener(sock) if spread else sock
        try:
            child = context.Process(target=_child, args=(settings, listener), name=f"gateway-worker-{index}")
            child.start()
        finally:
            if listener is not sock:
                listener.close()
        return child, time.monotonic()

    children = [start(i) for i in range(workers)]
    first_run = set(range(workers))  # workers still in the launch of the gateway itself
    backoff = RestartBackoff(workers, stable_s=settings.worker_stable_s)
    restart_at: dict[int, float] = {}
    code = 0
    try:
        while not stop.wait(WATCH_S):
            now = time.monotonic()
            for index, (child, started) in enumerate(children):
                if child.is_alive():
                    continue
                if index in first_run and child.exitcode == STARTUP_FAILED:
                    # It could not start (a bad setting, the database unreachable): so could no other.
                    log.error("worker %d could not start (see above); stopping the gateway", index)
                    code = STARTUP_FAILED
                    stop.set()
                    break
                first_run.discard(index)
                if index not in restart_at:
                    delay = backoff.after_exit(index, lived_s=now - started)
                    log.warning(
                        "worker %d (pid %s) exited with %s; starting it again in %.0f s",
                        index,
                        child.pid,
                        child.exitcode,
                        delay,
                    )
                    restart_at[index] = now + delay
                elif now >= restart_at[index]:
                    del restart_at[index]
                    children[index] = start(index)
    finally:
        for child, _ in children:
            if child.is_alive():
                child.terminate()  # SIGTERM: the child's uvicorn shuts down gracefully
        deadline = time.monotonic() + STOP_GRACE_S  # one deadline for all, not one per child
        for child, _ in children:
            child.join(max(0.0, deadline - time.monotonic()))
        for child, _ in children:
            if child.is_alive():
                child.kill()
                child.join()
        sock.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code


class RestartBackoff:
    """How long each worker slot waits before its dead child is started again: the first delay, doubled at
    each death of that slot's children up to the cap, and the first again once the slot's child had lived
    ``stable_s``. Each slot's own: a worker that keeps crashing backs off without holding back the
    restart of another that died once (with one shared delay, a few kills of different workers left every
    restart waiting the cap)."""

    def __init__(
        self,
        slots: int,
        *,
        stable_s: float,
        first_s: float = RESTART_DELAY_S[0],
        cap_s: float = RESTART_DELAY_S[1],
    ) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.stable_s = stable_s
        self._next = [first_s] * slots

    def after_exit(self, slot: int, *, lived_s: float) -> float:
        """The delay before ``slot`` is started again, its child having died after ``lived_s``."""
        if lived_s >= self.stable_s:
            self._next[slot] = self.first_s
        delay = self._next[slot]
        self._next[slot] = min(delay * 2, self.cap_s)
        return delay


def reuseport_available() -> bool:
    """Whether the children can each listen on a socket of their own that the kernel balances (Linux's
    ``SO_REUSEPORT``; the BSDs' and macOS's lets several sockets bind but hands the connections to one)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def reuseport_listener(holder: socket.socket) -> socket.socket:
    """A listening socket on ``holder``'s address (its port, also one picked for port 0) in the port's
    ``SO_REUSEPORT`` group. ``holder`` (``SO_REUSEADDR``, bound, not listening) is no member: it takes no
    connections, and it does not keep this one from binding."""
    listener = socket.socket(holder.family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        listener.bind(holder.getsockname())
        listener.listen(BACKLOG)
    except BaseException:
        listener.close()
        raise
    return listener


def _child(settings: Settings, sock: socket.socket) -> None:
    _stop_with_parent()
    from gateway.server.serve import GatewayServer, server_config, setup_logging, tune_interpreter
    from gateway.web.app import create_app

    setup_logging(settings)
    app = create_app(settings)
    config = server_config(
        app, settings.host, settings.port, log_level=settings.log_level, proxy_headers=True
    )
    server = GatewayServer(config, app)
    tune_interpreter()
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(STARTUP_FAILED)
    if server.failed:
        sys.exit(1)


def _stop_with_parent() -> None:
    """Stop this child when its parent is gone (killed with SIGKILL, say), so that no orphan keeps the port
    and the database: as on SIGTERM (each subscriber told ``1001``), and at once if it has not stopped
    ``STOP_GRACE_S`` later, as the parent would have killed it.

    A thread waits on ``multiprocessing.parent_process().sentinel``: under 'spawn' it is the read end of a
    pipe whose other end only the parent holds, so it is readable once the parent has died, however it
    died, even before this thread started (Linux's ``prctl(PR_SET_PDEATHSIG)`` is missed if the parent died
    before the child asked for it, follows the parent's thread rather than its process, and exists on Linux
    only; and either way the child must bound its own stop, which no signal does)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        multiprocessing.connection.wait([sentinel])
        log.warning("worker pid %d: its parent (pid %s) is gone; stopping", os.getpid(), parent.pid)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown, or the end before it runs
        time.sleep(STOP_GRACE_S)
        log.error(
            "worker pid %d: not stopped %.0f s after its parent died; exiting", os.getpid(), STOP_GRACE_S
        )
        os._exit(1)

    threading.Thread(target=watch, name="gateway-parent-watch", daemon=True).start()
