"""The gateway's HTTP/1.1 client to its replicas, against a raw asyncio server: bodies by
content-length and chunked (each chunk handed on as it comes), keep-alive reuse, a connection
the server closed never reused, a refused connection and a cut answer named."""

from __future__ import annotations

import asyncio
import socket

import pytest

from orthrus_real.cluster.upstream import UpstreamError, UpstreamPool


async def serve(handler) -> tuple[asyncio.AbstractServer, str, list]:
    """A server answering each request on a connection with ``handler(writer, n)``; the
    connections it accepted are listed."""
    accepted: list = []

    async def on_connect(reader, writer):
        accepted.append(writer)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                n += 1
                if not await handler(writer, n):
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", accepted


async def read_all(resp) -> list[bytes]:
    out = [chunk async for chunk in resp.chunks()]
    await resp.aclose()
    return out


def test_bodies_by_length_and_chunked_and_a_kept_connection():
    async def handler(writer, n):
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 7\r\n\r\n{\"a\":1}")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for part in (b"data: 1\n\n", b"data: 2\n\n"):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
                await asyncio.sleep(0.05)
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def go():
        server, url, accepted = await serve(handler)
        pool = UpstreamPool({"authorization": "Bearer k"})
        first = await pool.send(url, "/v1/embeddings", b'{"x": 1}', {"content-type": "a/b"})
        assert first.status == 200 and first.headers["content-type"] == "application/json"
        assert await read_all(first) == [b'{"a":1}']
        second = await pool.send(url, "/v1/completions", b"{}", {})
        assert second.headers["content-type"] == "text/event-stream"
        assert await read_all(second) == [b"data: 1\n\n", b"data: 2\n\n"]  # each as it came
        assert len(accepted) == 1  # one connection, kept alive between the two
        pool.close()
        server.close()

    asyncio.run(go())


def test_a_connection_the_server_closed_is_not_reused_and_failures_are_named():
    async def close_after_one(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        return False  # then close the connection

    async def cut(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab")
        await writer.drain()
        return False

    async def go():
        server, url, accepted = await serve(close_after_one)
        pool = UpstreamPool()
        for _ in range(2):
            assert await read_all(await pool.send(url, "/p", b"", {})) == [b"ok"]
            await asyncio.sleep(0.05)  # the close reaches the pooled connection
        assert len(accepted) == 2  # the closed one was not used again
        server.close()
        server, url, _ = await serve(cut)
        resp = await pool.send(url, "/p", b"", {})
        with pytest.raises(UpstreamError, match="cut"):
            await read_all(resp)
        server.close()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        with pytest.raises(UpstreamError) as refused:
            await pool.send(f"http://127.0.0.1:{free}", "/p", b"", {})
        assert refused.value.refused

    asyncio.run(go())
