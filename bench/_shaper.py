"""A shaping proxy for benches: a TCP proxy on 127.0.0.1 in front of a loopback S3 server that makes the
link behave like a network, so that requests in flight matter as they do against a real object store.

    with Shaper("127.0.0.1", 8333, rtt_s=0.030, rate=32e6) as sh:
        ...  # point the client at sh.endpoint

Each direction of each connection is a link of its own: a chunk read from one side leaves when the
link has sent the chunks before it (``rate`` bytes per second, per connection and direction, as an
object store gives per connection) and arrives ``rtt_s / 2`` later. The reader of a side waits while
its link is busy, so a fast sender is held back as TCP's window would hold it, and the bytes queued
in the proxy stay at about rate x delay per connection. A new connection's handshake pays one round
trip. Connections are independent: N of them move N x ``rate``.

It runs an asyncio loop in a thread of its own (as tests/_faultproxy.py), and counts connections and
bytes per direction. Time is asyncio's monotonic clock; sleeps are good to a millisecond or so, which
at 256 KiB chunks (8 ms at 32 MB/s) keeps the rate within a few percent.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Self

CHUNK = 256 << 10
START_TIMEOUT_S = 10.0


class Shaper:
    def __init__(self, host: str, port: int, *, rtt_s: float = 0.030, rate: float = 32e6):
        self.upstream = (host, port)
        self.delay, self.rate = rtt_s / 2, rate
        self.connections = 0
        self.bytes = {"up": 0, "down": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._server = loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=main, name="shaper", daemon=True)
        self._thread.start()
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the shaping proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        up_w: asyncio.StreamWriter | None = None
        try:
            await asyncio.sleep(2 * self.delay)  # the handshake's round trip
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            await asyncio.gather(self._pipe(reader, up_w, "up"), self._pipe(up_r, writer, "down"))
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, up_w):
                if w is not None:
                    w.close()
                    with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
                        await w.wait_closed()
            self._tasks.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
        """One direction of one connection: paced on the way in, delayed on the way out."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, chunk = await queue.get()
                if not chunk:
                    break
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(chunk)
                await dst.drain()
            if dst.can_write_eof():
                with contextlib.suppress(OSError):
                    dst.write_eof()

        out = asyncio.ensure_future(deliver())
        free = loop.time()  # when this link has sent what it was given
        try:
            while chunk := await src.read(CHUNK):
                self.bytes[direction] += len(chunk)
                free = max(free, loop.time()) + len(chunk) / self.rate
                queue.put_nowait((free + self.delay, chunk))
                busy = free - loop.time()
                if busy > 0:
                    await asyncio.sleep(busy)
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(ConnectionError, OSError):
                await out
