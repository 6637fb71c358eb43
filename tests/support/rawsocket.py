"""Raw sockets for the limits tests: bytes exactly as a hostile or broken client sends them (a header that
never ends, a WebSocket frame whose payload never comes, several messages in one write, a peer that never
reads), which well-behaved client libraries cannot produce."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
from websockets.client import ClientProtocol
from websockets.frames import Close, Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from tests.support import STEP_S


class RawStream:
    """A non-blocking TCP socket read only when asked: nothing drains its kernel buffer meanwhile (an
    asyncio stream would read ahead into its own memory)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @property
    def local_port(self) -> int:
        port: int = self.sock.getsockname()[1]
        return port

    async def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            view = view[sent:]

    async def receive(self, max_bytes: int = 65536) -> bytes:
        """The next bytes; ``anyio.EndOfStream`` once the server has closed (or reset) the connection."""
        while True:
            try:
                data = self.sock.recv(max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            except ConnectionResetError:
                raise anyio.EndOfStream from None
            if not data:
                raise anyio.EndOfStream
            return data


@asynccontextmanager
async def tcp(
    port: int, *, local_host: str = "127.0.0.1", receive_buffer: int | None = None
) -> AsyncIterator[RawStream]:
    """A TCP connection to the gateway on 127.0.0.1 from ``local_host`` (any 127.x.y.z is loopback);
    ``receive_buffer`` shrinks this side's kernel buffer (a peer that never reads fills it at once)."""
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setblocking(False)
    try:
        if receive_buffer is not None:
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        raw.bind((local_host, 0))
        try:
            raw.connect(("127.0.0.1", port))
        except BlockingIOError:
            with anyio.fail_after(STEP_S):
                await anyio.wait_writable(raw)
            error = raw.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                raise OSError(error, "connect failed") from None
        yield RawStream(raw)
    finally:
        raw.close()


async def read_until_closed(stream: RawStream, within_s: float = STEP_S) -> bytes:
    """Everything the server sends until it closes (fails if it does not close within ``within_s``)."""
    received = b""
    with anyio.fail_after(within_s):
        while True:
            try:
                received += await stream.receive()
            except anyio.EndOfStream:
                return received


def http_error(received: bytes) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of one HTTP answer."""
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, orjson.loads(body)


class RawWebSocket:
    """A WebSocket client over a raw stream (``websockets``' sans-I/O protocol): messages are framed here
    and written as one piece, and frames are read only when the test asks."""

    def __init__(self, stream: RawStream, path: str) -> None:
        self.stream = stream
        self.conn = ClientProtocol(parse_uri(f"ws://127.0.0.1{path}"), max_size=None)
        self.path = path
        self.frames: list[Frame] = []

    async def open(self, **headers: str) -> None:
        request = self.conn.connect()
        for name, value in headers.items():
            request.headers[name] = value
        self.conn.send_request(request)
        await self.flush()
        opened = False
        with anyio.fail_after(STEP_S):
            while True:
                events = await self._receive()
                self.frames += [e for e in events if isinstance(e, Frame)]
                for event in events:
                    if isinstance(event, Response):
                        assert event.status_code == 101, event
                        opened = True
                if opened:
                    return

    async def flush(self) -> None:
        data = b"".join(self.conn.data_to_send())
        if data:
            await self.stream.send(data)

    def frame(self, message: str | bytes) -> bytes:
        """One text message framed (masked) as a client sends it, not written."""
        if isinstance(message, str):
            self.conn.send_text(message.encode())
        else:
            self.conn.send_binary(message)
        return b"".join(self.conn.data_to_send())

    async def send(self, *messages: str | bytes) -> None:
        """Every message in one write, so that the server reads them together."""
        await self.stream.send(b"".join(self.frame(m) for m in messages))

    async def receive_frames(self) -> list[Frame]:
        """The frames of the next bytes that arrive (pings among them, answered already)."""
        return [e for e in await self._receive() if isinstance(e, Frame)]

    async def _receive(self) -> list[Any]:
        try:
            data = await self.stream.receive()
        except anyio.EndOfStream:
            self.conn.receive_eof()
        else:
            self.conn.receive_data(data)
        await self.flush()  # answers to pings and closes
        return list(self.conn.events_received())

    async def recv(self, within_s: float = STEP_S) -> dict[str, Any] | None:
        """The next text frame as JSON, or None once the connection is closed."""
        with anyio.fail_after(within_s):
            while True:
                while self.frames:
                    frame = self.frames.pop(0)
                    if frame.opcode == Opcode.TEXT:
                        message: dict[str, Any] = orjson.loads(frame.data)
                        return message
                if self.conn.close_rcvd is not None or self.conn.state.name == "CLOSED":
                    return None
                self.frames += [e for e in await self._receive() if isinstance(e, Frame)]

    async def close_code(self, within_s: float = STEP_S) -> int | None:
        """Read to the server's close frame; its code (None: the connection ended without one)."""
        with anyio.fail_after(within_s):
            while await self.recv(within_s) is not None:
                pass
        close: Close | None = self.conn.close_rcvd
        return None if close is None else close.code
