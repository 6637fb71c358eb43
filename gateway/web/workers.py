"""``gateway serve --workers N``: N gateway processes accepting on one listening socket.

The parent binds the socket once and starts N children (spawned, so each builds its own event loop,
database pool and bus listener); each child is a whole gateway, and news of commits travels between them
on the bus. A child that dies is started again; SIGTERM or SIGINT stops them all, each saying ``1001`` to
its subscribers first, who reconnect to another process (or the next deployment) with their cursors.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import threading
from multiprocessing.process import BaseProcess
from types import FrameType

from gateway.settings import Settings

log = logging.getLogger("gateway")

# How long a stop waits for a child to close its sockets before it is killed.
STOP_GRACE_S = 15.0
# A child that dies is restarted, but not faster than this (a crash loop must not spin the CPU).
RESTART_DELAY_S = 1.0


def serve_workers(settings: Settings, workers: int) -> int:
    from gateway.web.server import bind_socket

    sock = bind_socket(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    log.info("%d worker processes on http://%s:%d", workers, host, port)
    context = multiprocessing.get_context("spawn")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def start(index: int) -> BaseProcess:
        child = context.Process(target=_child, args=(settings, sock), name=f"gateway-worker-{index}")
        child.start()
        return child

    children = [start(i) for i in range(workers)]
    try:
        while not stop.wait(RESTART_DELAY_S):
            for index, child in enumerate(children):
                if not child.is_alive():
                    log.warning(
                        "worker %d (pid %s) exited with %s; starting it again",
                        index,
                        child.pid,
                        child.exitcode,
                    )
                    children[index] = start(index)
    finally:
        for child in children:
            if child.is_alive():
                child.terminate()  # SIGTERM: the child's uvicorn shuts down gracefully
        for child in children:
            child.join(STOP_GRACE_S)
            if child.is_alive():
                child.kill()
                child.join()
        sock.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def _child(settings: Settings, sock: socket.socket) -> None:
    from gateway.web.app import create_app
    from gateway.web.server import GatewayServer, server_config

    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = create_app(settings)
    config = server_config(
        app, settings.host, settings.port, log_level=settings.log_level, proxy_headers=True
    )
    GatewayServer(config, app).run(sockets=[sock])
