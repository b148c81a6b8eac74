"""The gateway's HTTP/1.1 client to its replicas, for the requests it relays (the hot path).

Why not httpx here (the gateway uses it for probes, metrics and admin calls): relaying is the
gateway's whole cost per request, and httpx's pool and models cost about twice the rest of a
relay together on this machine (``benchmarks/cluster/gateway_overhead.py``). The peer is always a
replica's own server (uvicorn), so the client needs little: keep-alive connections per replica,
a request with a body, a response head, and a body by ``content-length`` or chunked, each chunk
handed on as it arrives (a stream's events are not held back).

A pooled connection is reused only while the replica keeps it open: not one it has closed (its
end seen), nor one idle for longer than ``IDLE_S``, shorter than the replica's keep-alive
timeout. A request is never sent twice here: whether a failed exchange may be sent again is
the caller's to decide (a replica may have run it: a non-streamed answer's head comes only at
its end).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from urllib.parse import urlsplit

HEAD_LIMIT = 64 * 1024  # bytes of a response's status line and headers
IDLE_S = 4.0  # a pooled connection idle longer is dropped (the replica's keep-alive is 5 s)


class UpstreamError(Exception):
    """A replica did not answer (``refused``: no connection could be made, so it never saw the
    request; ``nothing_listens``: refused outright, no process on its port)."""

    def __init__(self, message: str, refused: bool = False, nothing_listens: bool = False) -> None:
        super().__init__(message)
        self.refused, self.nothing_listens = refused, nothing_listens


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def reusable(self) -> bool:
        return (not self.reader.at_eof() and not self.writer.is_closing()
                and time.monotonic() - self.idle_since < IDLE_S)

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """A response being read: ``status``, ``headers`` (lower-case names), then ``chunks()``;
    ``aclose()`` gives the connection back to the pool when the body was read to its end."""

    def __init__(self, pool: UpstreamPool, key: tuple, conn: Connection, status: int,
                 headers: dict[str, str]) -> None:
        self.pool, self.key, self.conn = pool, key, conn
        self.status, self.headers = status, headers
        self._complete = False

    async def chunks(self):
        reader = self.conn.reader
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            else:
                left = int(self.headers.get("content-length", "0"))
                while left > 0:
                    data = await reader.read(min(left, 1 << 16))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                OSError) as exc:
            raise UpstreamError(f"the answer was cut: {type(exc).__name__}: {exc}") from None
        self._complete = True

    async def aclose(self) -> None:
        keep = self._complete and self.headers.get("connection", "").lower() != "close"
        if keep:
            self.pool._give_back(self.key, self.conn)
        else:
            self.conn.close()


class UpstreamPool:
    """Keep-alive connections to each replica (``max_idle`` kept per replica)."""

    def __init__(self, headers: dict[str, str] | None = None, connect_timeout: float = 5.0,
                 max_idle: int = 256) -> None:
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}
        self.connect_timeout, self.max_idle = connect_timeout, max_idle
        self._idle: dict[tuple, list[Connection]] = defaultdict(list)

    async def send(self, url: str, path: str, body: bytes,
                   headers: dict[str, str]) -> UpstreamResponse:
        """POST ``body`` to ``url + path``; returns once the response's head has come."""
        parts = urlsplit(url)
        key = (parts.hostname, parts.port or 80)
        wanted = {**self.headers, **{k.lower(): v for k, v in headers.items()}}
        head = "".join(f"{k}: {v}\r\n" for k, v in wanted.items()
                       if k not in ("host", "content-length", "connection"))
        request = (f"POST {path} HTTP/1.1\r\nhost: {key[0]}:{key[1]}\r\n{head}"
                   f"content-length: {len(body)}\r\n\r\n").encode("latin-1") + body
        idle = self._idle[key]
        while idle:
            conn = idle.pop()
            if conn.reusable():
                return await self._exchange(key, conn, request)
            conn.close()
        return await self._exchange(key, await self._connect(key), request)

    async def _connect(self, key: tuple) -> Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(key[0], key[1], limit=HEAD_LIMIT), self.connect_timeout)
        except (OSError, TimeoutError) as exc:  # a full backlog or no file descriptors too
            raise UpstreamError(f"no connection to {key[0]}:{key[1]}: {type(exc).__name__}: "
                                f"{exc}", refused=True,
                                nothing_listens=isinstance(exc, ConnectionRefusedError)) from None
        return Connection(reader, writer)

    async def _exchange(self, key: tuple, conn: Connection, request: bytes) -> UpstreamResponse:
        try:
            conn.writer.write(request)
            await conn.writer.drain()
            raw = await conn.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, OSError) as exc:
            conn.close()
            raise UpstreamError(f"no answer: {type(exc).__name__}: {exc}") from None
        except asyncio.LimitOverrunError:
            conn.close()
            raise UpstreamError(f"a response head over {HEAD_LIMIT} bytes") from None
        except BaseException:
            conn.close()
            raise
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            conn.close()
            raise UpstreamError(f"not an HTTP response: {lines[0][:80]!r}") from None
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return UpstreamResponse(self, key, conn, status, headers)

    def _give_back(self, key: tuple, conn: Connection) -> None:
        idle = self._idle[key]
        if len(idle) < self.max_idle and not conn.writer.is_closing():
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def forget(self, url: str) -> None:
        """Close the kept connections to ``url`` (a replica gone: it comes back elsewhere)."""
        parts = urlsplit(url)
        for conn in self._idle.pop((parts.hostname, parts.port or 80), []):
            conn.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
