"""A TCP proxy for the tests, on 127.0.0.1, between Ravex and an S3 server: it breaks the
connections on command.

It runs an asyncio loop in a thread of its own, so that a synchronous test can switch the
fault at any moment, also while a ``ravex`` subprocess is uploading through it. One fault
is in force at a time; it applies to the connections open when it was set and to those
opened later (each counts its bytes afresh from the moment the fault was set):

- ``passthrough()``: every byte goes through;
- ``delay(s)``: each chunk (at most 64 KiB) waits ``s`` seconds before it goes on;
- ``cut(after, direction)``: a connection that carries ``after`` bytes in that direction
  ("up": client to server, "down": server to client) forwards exactly those and is closed
  (a FIN, or an RST with ``rst=True``; a socket closed with bytes still unread sends an RST
  all the same, so a cut "up" mid-body reaches the client as a reset either way);
- ``reset()``: new connections are reset at once, open ones at their next chunk;
- ``blackhole()``: connections are accepted and held, nothing goes either way and nothing
  is answered, until the fault changes (then they go on) or the proxy stops;
- ``fail_request(...)``: the k-th HTTP request that matches (a method, a substring of its
  target) is reset before the server sees it, or its answer is lost after the server acted
  on it ("drop_response"), or it is answered with a status of the proxy's (a 503 SlowDown)
  and the server never sees it.

``cut``, ``reset`` and ``fail_request`` fire ``times`` times and then let everything
through; ``fired`` says how often the current fault fired. ``bytes_up``, ``bytes_down``,
``connections`` and ``requests`` (``(method, target)`` of each request seen) count the
traffic, so a test can wait (``wait_until``, always with a deadline) until an upload is
under way. The HTTP parsing is only what counting requests needs: a request line,
headers and a Content-Length body; a chunked body ends the counting on that connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

CHUNK = 64 << 10
MAX_HEADER = 64 << 10
START_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0


@dataclass
class Fault:
    kind: str = "pass"  # pass | delay | cut | reset | blackhole | request
    seconds: float = 0.0
    after: int = 0
    direction: str = "up"
    rst: bool = False
    times: int | None = None  # None: every time
    # fail_request: which requests, which of them, and what happens
    method: str | None = None
    target: str | None = None
    nth: int = 1
    action: str = "reset"  # reset | drop_response | status
    status: int = 503
    gen: int = 0
    fired: int = 0
    matched: int = 0


@dataclass(eq=False)  # hashed by identity: the proxy keeps a set of them
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    gen: int = -1
    count: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    head: bytes = b""
    body_left: int = 0
    opaque: bool = False  # the request stream is no longer parsed (a chunked body)
    swallow: bool = False  # the current request's bytes are not forwarded
    answer: bytes | None = None  # the proxy's own answer, sent once the request is swallowed
    drop_response: bool = False
    rst_on_drop: bool = False


class _Close(Exception):
    def __init__(self, rst: bool):
        self.rst = rst


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._fault = Fault()
        self._gen = 0
        self._conns: set[_Conn] = set()
        self.connections = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.requests: list[tuple[str, str]] = []
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self.port = 0

    # ---------------------------------------------------------------- control (any thread)

    def start(self) -> Self:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._error is not None:
            raise RuntimeError(f"the fault proxy did not start: {self._error!r}")
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._thread.ident is None:  # never started
            self._loop.close()
            return
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            raise RuntimeError("the fault proxy's thread did not stop in 10 s")

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _set(self, **kw: Any) -> Fault:
        with self._lock:
            self._gen += 1
            self._fault = Fault(gen=self._gen, **kw)
            return self._fault

    def passthrough(self) -> None:
        self._set()

    def delay(self, seconds: float, direction: str = "both") -> None:
        self._set(kind="delay", seconds=seconds, direction=direction)

    def cut(self, after: int, direction: str = "up", *, rst: bool = False, times: int | None = 1) -> None:
        self._set(kind="cut", after=after, direction=direction, rst=rst, times=times)

    def reset(self, times: int | None = None) -> None:
        self._set(kind="reset", rst=True, times=times)

    def blackhole(self) -> None:
        self._set(kind="blackhole")

    def fail_request(self, *, method: str | None = None, target: str | None = None, nth: int = 1, action: str = "reset",
                     status: int = 503, rst: bool = False, times: int | None = 1) -> None:
        assert action in ("reset", "drop_response", "status"), action
        self._set(kind="request", method=method, target=target, nth=nth, action=action, status=status, rst=rst, times=times)

    @property
    def fired(self) -> int:
        """How often the fault set last has fired."""
        return self._fault.fired

    def wait_until(self, what: Callable[[], bool], timeout: float, poll: float = 0.01) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not within {timeout} s: {getattr(what, '__name__', what)}")
            time.sleep(poll)

    # ---------------------------------------------------------------- the loop's thread

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0, limit=CHUNK))
            self.port = int(self._server.sockets[0].getsockname()[1])
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
            self._loop.close()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            _abort(c.client, rst=False)
            if c.server is not None:
                _abort(c.server, rst=False)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    def _current(self, conn: _Conn) -> Fault:
        with self._lock:
            f = self._fault
            if conn.gen != f.gen:
                conn.gen, conn.count = f.gen, {"up": 0, "down": 0}
            return f

    def _fire(self, f: Fault) -> bool:
        """Whether ``f`` fires once more (then counted; at its last time the proxy lets everything through)."""
        with self._lock:
            if f is not self._fault or (f.times is not None and f.fired >= f.times):
                return False
            f.fired += 1
            if f.times is not None and f.fired >= f.times:
                self._gen += 1
                self._fault = Fault(gen=self._gen, fired=f.fired)
            return True

    async def _held(self) -> None:
        """While the fault is a black hole: wait (the proxy's stop cancels the wait)."""
        while self._fault.kind == "blackhole":
            await asyncio.sleep(0.02)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        with self._lock:
            self.connections += 1
            self._conns.add(conn)
        try:
            f = self._current(conn)
            if f.kind == "reset" and self._fire(f):
                raise _Close(rst=True)
            await self._held()
            up_reader, conn.server = await asyncio.wait_for(asyncio.open_connection(*self.upstream, limit=CHUNK), CONNECT_TIMEOUT_S)
            pumps = [asyncio.ensure_future(self._pump(conn, reader, "up")), asyncio.ensure_future(self._pump(conn, up_reader, "down"))]
            try:
                done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
            finally:
                for t in pumps:
                    t.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
            _abort(writer, rst=False)
        except _Close as c:
            _abort(writer, rst=c.rst)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            # (cancelled: the proxy stops; the handler ends as any other, or asyncio logs it)
            _abort(writer, rst=False)
        finally:
            if conn.server is not None:
                _abort(conn.server, rst=False)
            with self._lock:
                self._conns.discard(conn)

    async def _pump(self, conn: _Conn, src: asyncio.StreamReader, d: str) -> None:
        dst = conn.server if d == "up" else conn.client
        assert dst is not None
        while True:
            data = await src.read(CHUNK)
            if not data:
                return
            await self._held()
            close: bool | None = None
            if d == "down" and conn.drop_response:
                raise _Close(rst=conn.rst_on_drop)  # the server acted on the request; its answer is lost
            segments, close = self._requests(conn, data) if d == "up" else ([data], None)
            for seg in segments:
                await self._forward(conn, d, seg, dst)
            if close is not None:
                raise _Close(rst=close)
            if conn.answer is not None and conn.body_left == 0:
                answer, conn.answer = conn.answer, None
                conn.client.write(answer)
                await conn.client.drain()

    async def _forward(self, conn: _Conn, d: str, data: bytes, dst: asyncio.StreamWriter) -> None:
        f = self._current(conn)
        close: bool | None = None  # after forwarding: None, or whether the close is an RST
        if f.kind == "delay" and f.direction in (d, "both"):
            await asyncio.sleep(f.seconds)
        elif f.kind == "reset" and self._fire(f):
            raise _Close(rst=True)
        elif f.kind == "cut" and f.direction == d and conn.count[d] + len(data) >= f.after and self._fire(f):
            data, close = data[:max(0, f.after - conn.count[d])], f.rst
        conn.count[d] += len(data)
        if data:
            with self._lock:  # counted first: a peer that has the bytes finds them counted
                if d == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
            dst.write(data)
            await dst.drain()
        if close is not None:
            raise _Close(rst=close)

    def _requests(self, conn: _Conn, data: bytes) -> tuple[list[bytes], bool | None]:
        """The client's bytes that go on to the server, and whether the connection is then
        closed (None: no; else whether with an RST), counting each request and deciding the
        fate of those the fault names."""
        out: list[bytes] = []
        while data:
            if conn.opaque:
                out.append(data)
                break
            if conn.body_left:
                n = min(conn.body_left, len(data))
                if not conn.swallow:
                    out.append(data[:n])
                conn.body_left -= n
                data = data[n:]
                continue
            conn.swallow = False
            conn.head += data
            end = conn.head.find(b"\r\n\r\n")
            if end < 0:
                if len(conn.head) > MAX_HEADER:
                    conn.opaque = True
                    out.append(conn.head)
                    conn.head = b""
                break
            head, data = conn.head[:end + 4], conn.head[end + 4:]
            conn.head = b""
            lines = head.decode("latin-1").split("\r\n")
            method, _, rest = lines[0].partition(" ")
            target = rest.rpartition(" ")[0]
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
            with self._lock:
                self.requests.append((method, target))
            if headers.get("transfer-encoding", "").lower() == "chunked":
                conn.opaque = True
            else:
                conn.body_left = int(headers.get("content-length", "0") or 0)
            f = self._current(conn)
            if f.kind == "request" and (f.method is None or f.method == method) and (f.target is None or f.target in target):
                with self._lock:
                    f.matched += 1
                    nth = f.matched
                if nth >= f.nth and self._fire(f):
                    if f.action == "reset":  # before the server sees a byte of it
                        return out, True
                    if f.action == "drop_response":
                        conn.drop_response, conn.rst_on_drop = True, f.rst
                    else:  # answered here; the server never sees it
                        conn.swallow, conn.answer = True, _answer(f.status)
                        continue
            out.append(head)
        return out, None


def _answer(status: int) -> bytes:
    code = {503: "SlowDown", 500: "InternalError"}.get(status, "ProxyError")
    body = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>from the fault proxy</Message></Error>'.encode()
    return (f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _abort(writer: asyncio.StreamWriter, rst: bool) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        if rst:
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()
