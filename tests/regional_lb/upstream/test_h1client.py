"""The proxy's upstream HTTP/1.1 client against a scripted server on a loopback socket.

Each test's server is a plain asyncio stream server whose handler plays one behaviour of an
inference instance: keep-alive, chunked streaming, closing an idle connection, going silent,
sending garbage, or seeing the client go away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from regional_lb.upstream.h1client import ConnectFailed, H1Client, HopBroken, HopTimeout

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """Serve ``handler`` on a free loopback port; yields the URL and a list that records the
    number of each connection accepted (so tests can see reuse)."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted) + 1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        srv.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request: its head and its body (content-length framed, as the client sends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


def ok(body: bytes, *extra: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
        % (len(body), b"".join(h + b"\r\n" for h in extra), body)
    )


async def test_posts_keep_the_connection_alive_and_send_path_headers_and_body() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await read_request(reader)
            seen.append((head, body))
            writer.write(ok(b'{"n":%d}' % len(seen)))
            await writer.drain()

    client = H1Client(connect_timeout=1.0)
    async with server(handler) as (url, accepted):
        for n in (1, 2, 3):
            resp = await client.post(
                url + "/base", "/v1/chat", b'{"a":1}', [(b"x-tier", b"batch")], 1.0
            )
            assert resp.status == 200
            assert resp.header(b"content-type") == b"application/json"
            assert await resp.read(1.0) == b'{"n":%d}' % n
            resp.close()
        client.close()
    assert accepted == [1]  # one connection for all three
    head, body = seen[0]
    assert head.startswith(b"POST /base/v1/chat HTTP/1.1\r\n")
    assert b"\r\nx-tier: batch\r\n" in head and b"\r\ncontent-length: 7\r\n" in head
    assert body == b'{"a":1}'


async def test_a_chunked_stream_arrives_piece_by_piece_without_its_framing() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"6\r\ndata:1\r\n")
        await writer.drain()
        await release.wait()  # the second piece only after the client saw the first
        writer.write(b"6\r\ndata:2\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    client = H1Client(connect_timeout=1.0)
    async with server(handler) as (url, _):
        resp = await client.post(url, "/v1/completions", b"{}", [], 1.0)
        pieces = resp.chunks(1.0)
        assert await anext(pieces) == b"data:1"
        release.set()
        assert b"".join([p async for p in pieces]) == b"data:2"
        resp.close()
        client.close()


async def test_an_idle_connection_the_instance_closed_is_replaced_transparently() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # Keep-alive promised, then the connection closed right after the answer: the next
        # request finds it dead (as when a server's idle timer fires first).
        writer.write(ok(b"{}"))
        await writer.drain()

    client = H1Client(connect_timeout=1.0)
    async with server(handler) as (url, accepted):
        for _ in range(2):
            resp = await client.post(url, "/v1/completions", b"{}", [], 1.0)
            assert await resp.read(1.0) == b"{}"
            resp.close()
            await asyncio.sleep(0.05)  # the close reaches the client while it is idle
        client.close()
    assert accepted == [1, 2]


async def test_an_unfinished_answer_closed_early_aborts_its_connection() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        try:
            rest = await reader.read()
        except ConnectionError:  # reset: the client aborted the connection
            rest = b""
        if rest == b"" and len(accepted) == 1:
            gone.set()

    client = H1Client(connect_timeout=1.0)
    async with server(handler) as (url, accepted):
        resp = await client.post(url, "/v1/chat/completions", b"{}", [], 1.0)
        assert await anext(resp.chunks(1.0)) == b"first"
        resp.close()  # the client went away: the instance must see it and stop
        await asyncio.wait_for(gone.wait(), 2.0)
        # And that connection is not handed out again: the next request opens another.
        resp2 = await client.post(url, "/v1/chat/completions", b"{}", [], 1.0)
        assert resp2.status == 200
        resp2.close()
        client.close()
    assert accepted == [1, 2]


async def test_each_phase_has_its_own_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        await reader.read()

    client = H1Client(connect_timeout=1.0)
    async with server(silent) as (url, _):
        with pytest.raises(HopTimeout) as first:
            await client.post(url, "/v1/completions", b"{}", [], 0.2)
        assert first.value.phase == "first_byte"
    async with server(stalls) as (url, _):
        resp = await client.post(url, "/v1/completions", b"{}", [], 1.0)
        with pytest.raises(HopTimeout) as read:
            await resp.read(0.2)
        assert read.value.phase == "read"
        resp.close()
    client.close()


async def test_refused_garbage_and_cut_answers_are_hop_errors() -> None:
    client = H1Client(connect_timeout=1.0)

    async def nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pass

    async with server(nothing) as (url, _):
        pass  # the port is closed again: nothing listens there now
    with pytest.raises(ConnectFailed):
        await client.post(url, "/v1/completions", b"{}", [], 1.0)

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with server(garbage) as (url, _):
        with pytest.raises(HopBroken, match="invalid HTTP"):
            await client.post(url, "/v1/completions", b"{}", [], 1.0)

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly-part")
        await writer.drain()  # then the handler returns and the connection closes

    async with server(cut) as (url, _):
        resp = await client.post(url, "/v1/completions", b"{}", [], 1.0)
        with pytest.raises(HopBroken, match="before the answer ended"):
            await resp.read(1.0)
        resp.close()
    client.close()
