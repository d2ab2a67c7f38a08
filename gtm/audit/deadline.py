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
import select
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
        if self.fd is not None and _answered(self.fd):
            # The peer's answer is waiting, not yet read: the process was slow to get to it
            # (a stalled loop), the peer was not silent. Read before the next deadline.
            self.progress()
            return
        self.fired = True
        if self.fd is not None:
            _shut(self.fd)


def _answered(fd: int) -> bool:
    """Whether something waits to be read on ``fd`` (poll: any descriptor number)."""
    poller = select.poll()
    try:
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    except OSError:
        return False


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


# A statement's deadline when the server has no statement timeout (0 in the settings), as the
# audit's calls have (gtm.runtime): long statements are not cut, and still none waits for ever.
UNTIMED_STATEMENT_S = 3600.0


def deadline_every_call(engine: AsyncEngine, *, silence_s: float, statement_s: float) -> None:
    """A deadline on every call ``engine`` makes on its connections (DESIGN.md rule 10), for
    the users that watch none of their own (the admin API and its loops, the control log, the
    fleet's reads): past it, the call's socket is shut down, so it fails at once with an error
    the callers already handle, and its connection is discarded.

    The kernel's ``tcp_user_timeout`` and keepalives (gtm.audit.database) give up a black-holed
    route, but not a peer that keeps acknowledging while it never answers: a server whose
    process is frozen, a proxy in between that swallows what it is sent. Each statement may
    take ``statement_s`` (the server's own ``statement_timeout``; :data:`UNTIMED_STATEMENT_S`
    where that is 0) plus ``silence_s``; a commit or a rollback the same; the pool's ping
    before it hands out a kept connection, ``silence_s`` (a ``SELECT 1``)."""
    after_s = (statement_s or UNTIMED_STATEMENT_S) + silence_s
    sync = engine.sync_engine
    dialect = sync.dialect
    # Each statement's watch, by its execution context (alive from before the statement to
    # after it, and handed to the error handler: its cursor is not, in SQLAlchemy 2.1).
    watches: dict[int, Watch] = {}

    def arm(driver_connection: object, seconds: float) -> Watch | None:
        try:
            return Watch(_socket_of(driver_connection), seconds)
        except RuntimeError:  # no running loop (a connection closed by the collector)
            return None

    def before_execute(conn: Any, _cursor: Any, _s: Any, _p: Any, context: Any, _m: Any) -> None:
        # The connection is live here (it is executing): reading it reconnects nothing.
        watch = arm(conn.connection.driver_connection, after_s)
        if watch is not None:
            stale = watches.pop(id(context), None)
            if stale is not None:
                stale.cancel()
            watches[id(context)] = watch

    def after_execute(_conn: Any, _cursor: Any, _s: Any, _p: Any, context: Any, _m: Any) -> None:
        # A call that returned was never cut: a deadline due while its answer waited unread
        # was moved on (Watch._fire), and once the answer is read the call returns at once.
        watch = watches.pop(id(context), None)
        if watch is not None:
            watch.cancel()

    def failed(context: Any) -> None:
        # Never through context.connection's own connection: on a connection already
        # invalidated that would connect again, in the middle of this error.
        execution = context.execution_context
        watch = watches.pop(id(execution), None) if execution is not None else None
        if watch is not None:
            watch.cancel()
            if watch.fired:
                context.is_disconnect = True  # its socket is shut: the connection must go

    def within(call: Any, seconds: float) -> Any:
        def bounded(dbapi_connection: Any) -> Any:
            watch = arm(dialect.get_driver_connection(dbapi_connection), seconds)
            try:
                return call(dbapi_connection)
            finally:
                if watch is not None:
                    watch.cancel()

        return bounded

    event.listen(sync, "before_cursor_execute", before_execute)
    event.listen(sync, "after_cursor_execute", after_execute)
    event.listen(sync, "handle_error", failed)
    # The dialect's own calls that run no statement through a cursor event: this engine's
    # dialect alone (each engine has its own instance). A cut ping fails as a disconnect, so
    # the pool opens another connection.
    for name, seconds in (
        ("do_commit", after_s),
        ("do_rollback", after_s),
        ("do_ping", silence_s or after_s),
    ):
        setattr(dialect, name, within(getattr(dialect, name), seconds))


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
