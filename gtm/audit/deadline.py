"""A deadline on one database connection: no progress for ``after_s`` and its socket is shut
down, so every await on it fails at once, and the connection is discarded, never reused.

Why not ``asyncio.timeout``: cancelling a statement that waits on a silent peer leaves the
cleanup on the way out (psycopg ending a COPY, the rollback when the connection goes back to
the pool) waiting on that same peer, with no timeout left to end it. A black-holed route keeps a
TCP connection open and silent for as long as the kernel retransmits (many minutes; for ever
when something in between still acknowledges): the audit writer hung there, and its rows
reached the database minutes after the network was back (issue 33). Shutting the socket down
makes the driver's wait, and every later call on it, end with an error the caller already
handles; the connection is then invalidated, so the pool opens a new one.

The deadline moves with progress (:meth:`Watch.progress`, called between chunks of work), so a
long drain that keeps moving is never cut; one that stops moving is, within ``after_s``.
A connection without a socket (SQLite: a local file, which cannot go silent; its lock waits
are bounded by ``busy_timeout``) is watched for nothing.

:class:`EngineSockets` does the same to all of one engine's connections at once, for a user that
cannot watch each call (the state sync, whose rounds go through many short calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import traceback
import weakref
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine


class DeadlineExceeded(TimeoutError):
    """A database call made no progress within its deadline; its connection was discarded."""


class Watch:
    """One connection's deadline: :meth:`progress` moves it; past it, the socket is shut."""

    def __init__(self, fd: int | None, after_s: float) -> None:
        self.fd = fd
        self.after_s = after_s
        self.fired = False
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        self.progress()

    def progress(self) -> None:
        if self.fd is None or self.fired:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_later(self.after_s, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self.fired = True
        if self.fd is not None:
            _shut(self.fd)


def _shut(fd: int) -> None:
    # A duplicate of the driver's descriptor: shutting it down ends the connection for every
    # holder (the driver's wait wakes to an error), closing it closes only ours.
    with contextlib.suppress(OSError):
        dup = os.dup(fd)
        with socket.socket(fileno=dup) as sock:
            sock.shutdown(socket.SHUT_RDWR)


def _socket_of(driver_connection: object) -> int | None:
    fileno = getattr(driver_connection, "fileno", None)
    if not callable(fileno):
        return None  # aiosqlite: a file in a thread, no socket
    try:
        fd = fileno()
    except Exception:  # a closed connection: nothing to watch
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


class EngineSockets:
    """Every connection an engine holds, pooled or in use, so all their sockets can be shut at
    once: for an engine with one user (the state sync's), whose work stuck past any deadline
    in a cancelled call's cleanup (the rollback of a connection going back to the pool, which
    waits on the silent peer, under a shield no timeout reaches) is ended that way. The pool
    then finds those connections dead (its check before use) and opens new ones."""

    def __init__(self, engine: AsyncEngine) -> None:
        # Pool entries, which live as long as the pool keeps a slot: the connection each holds
        # now is read at the cut, so a descriptor closed and reused since is never shut.
        self._entries: weakref.WeakSet[Any] = weakref.WeakSet()
        self.cuts = 0  # times shut_all was called
        event.listen(engine.sync_engine, "connect", self._connected)

    def _connected(self, _dbapi_connection: Any, entry: Any) -> None:
        self._entries.add(entry)

    def shut_all(self) -> int:
        """Shut down every open connection's socket; how many there were."""
        self.cuts += 1
        shut = 0
        for entry in list(self._entries):
            adapted = entry.dbapi_connection
            fd = None if adapted is None else _socket_of(adapted.driver_connection)
            if fd is not None:
                _shut(fd)
                shut += 1
        return shut


@contextlib.asynccontextmanager
async def watched(conn: AsyncConnection, after_s: float) -> AsyncIterator[Watch]:
    """Watch ``conn`` for the block: past the deadline, :class:`DeadlineExceeded` (an
    ``OSError``) is raised from whatever error the shut socket caused, and ``conn`` is
    invalidated so nothing reuses it."""
    raw = await conn.get_raw_connection()
    watch = Watch(_socket_of(raw.driver_connection), after_s)
    try:
        yield watch
    except BaseException as exc:
        if not watch.fired:
            raise
        with contextlib.suppress(Exception):
            await conn.invalidate()
        raise DeadlineExceeded(
            f"no progress for {after_s:g} s: the connection was discarded"
        ) from exc
    else:
        if watch.fired:  # fired as the block ended: its socket is shut all the same
            with contextlib.suppress(Exception):
                await conn.invalidate()
    finally:
        watch.cancel()


def release(exc: BaseException) -> None:
    """Let go of what a failed database call's frames hold. A connection attempt that timed
    out keeps its half-open socket referenced from its frame, which the exception's traceback
    keeps alive in a cycle: freed only by a full garbage collection, minutes later, while every
    retry adds one (sockets piled up in CLOSE-WAIT during a cut). Clearing the frames' locals
    frees it at once."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        orig = getattr(e, "orig", None)
        pending += [e.__cause__, e.__context__, orig if isinstance(orig, BaseException) else None]
