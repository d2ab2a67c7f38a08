"""A TCP relay on loopback that a test can cut and restore: a database (or any peer) that goes
away mid-run and comes back on the same address.

Two kinds of cut:

- :meth:`TcpProxy.stop` resets: open connections are aborted and new ones refused, so a client
  fails fast (a peer that is down).
- :meth:`TcpProxy.blackhole` hangs: connections stay open and new ones are accepted, but nothing
  is forwarded either way (a dropped route, a firewall losing its state). :meth:`TcpProxy.heal`
  passes new connections again; the ones that were open during the cut stay dead, as flows
  behind a stateful firewall that forgot them do: a client that waits on one without a
  deadline waits for ever.
"""

from __future__ import annotations

import asyncio
import contextlib


class _Link:
    """One client connection: its writers, and whether the cut froze it."""

    def __init__(self, frozen: bool) -> None:
        self.frozen = frozen
        self.writers: list[asyncio.StreamWriter] = []
        self.client_gone = asyncio.Event()


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.blackholed = False
        self.accepted = 0  # connections accepted, over the proxy's life
        self.dropped_bytes = 0  # bytes a frozen connection swallowed
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Refuse new connections and cut every open one."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self._links):
            link.client_gone.set()
            for writer in link.writers:
                writer.transport.abort()
        self._links.clear()

    def blackhole(self) -> None:
        """From now on forward nothing, on open connections or on new ones, and close none."""
        self.blackholed = True
        for link in self._links:
            link.frozen = True

    def heal(self) -> None:
        """New connections pass again (the ones open during the cut stay frozen)."""
        self.blackholed = False

    def frozen_open(self) -> int:
        """Connections the cut froze that their client has not closed yet."""
        return sum(1 for link in self._links if link.frozen)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        link = _Link(self.blackholed)
        link.writers.append(writer)
        self._links.add(link)
        try:
            if link.frozen:
                await self._swallow(reader)
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                writer.transport.abort()
                return
            link.writers.append(up_writer)
            await asyncio.gather(
                self._pipe(link, reader, up_writer, from_client=True),
                self._pipe(link, up_reader, writer, from_client=False),
                return_exceptions=True,
            )
        finally:
            self._links.discard(link)
            for w in link.writers:
                with contextlib.suppress(Exception):
                    w.transport.abort()

    async def _swallow(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                self.dropped_bytes += len(data)

    async def _pipe(
        self,
        link: _Link,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        from_client: bool,
    ) -> None:
        try:
            while data := await reader.read(65536):
                if link.frozen:
                    self.dropped_bytes += len(data)
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side closed: the connection ends end-to-end; but across a cut the client
            # never hears that the server went (only its own giving up ends a frozen link).
            if from_client:
                link.client_gone.set()
            elif link.frozen:
                await link.client_gone.wait()
            for w in link.writers:
                with contextlib.suppress(Exception):
                    w.transport.abort()
