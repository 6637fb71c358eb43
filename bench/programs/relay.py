"""Workload 13's stand-in for netem (bench/workloads/hosts.py), in a process of its own, run in the
PostgreSQL host's network namespace:

    python -m bench.programs.relay LISTEN PORT TARGET_PORT DELAY_MS

Prints ``ready`` once it listens.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import sys
import threading
import time


def relay_main(listen: str, port: int, target_port: int, delay_ms: float) -> None:
    """The stand-in for netem: accept on ``listen:port``, connect to 127.0.0.1:``target_port``, and carry
    each chunk read on either side to the other ``delay_ms`` after it was read, in order (a thread reads, a
    thread writes, per direction: ``time.sleep`` wakes within tens of microseconds, asyncio's timers within
    a millisecond)."""
    delay = delay_ms / 1000

    def carry(src: socket.socket, dst: socket.socket) -> None:
        chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def write() -> None:
            try:
                while True:
                    due, chunk = chunks.get()
                    if not chunk:
                        break
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    dst.sendall(chunk)
            except OSError:
                pass
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            with contextlib.suppress(OSError):
                src.shutdown(socket.SHUT_RD)

        threading.Thread(target=write, daemon=True).start()
        try:
            while chunk := src.recv(65536):
                chunks.put((time.monotonic() + delay, chunk))
        except OSError:
            pass
        chunks.put((0.0, b""))

    server = socket.create_server((listen, port), backlog=512)
    print("ready", flush=True)
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(("127.0.0.1", target_port))
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=carry, args=(client, upstream), daemon=True).start()
        threading.Thread(target=carry, args=(upstream, client), daemon=True).start()


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: python -m bench.programs.relay LISTEN PORT TARGET_PORT DELAY_MS")
    relay_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
