"""Database URLs and engines: SQLite (embedded default, WAL) and PostgreSQL (psycopg 3).

Users write plain URLs (``sqlite:///var/gtm.sqlite3``, ``postgresql://user@host/db``); the
async writer and the synchronous migrations each get the driver they need from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine, Table, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from gtm.audit.deadline import deadline_every_call
from gtm.errors import ConfigError, Problem

_SQLITE = {"sqlite", "sqlite+aiosqlite", "sqlite+pysqlite"}
_POSTGRES = {"postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg_async"}


def parse_url(url: str) -> URL:
    try:
        parsed = make_url(url)
    except Exception as exc:  # sqlalchemy raises ArgumentError with a generic message
        raise ConfigError([Problem("GTM_DATABASE_URL", "", f"not a database URL: {exc}")]) from exc
    if parsed.drivername not in _SQLITE | _POSTGRES:
        raise ConfigError(
            [
                Problem(
                    "GTM_DATABASE_URL",
                    "",
                    f"unsupported database {parsed.drivername!r}: use sqlite:///PATH or postgresql://...",
                )
            ]
        )
    return parsed


def is_sqlite(url: str) -> bool:
    return parse_url(url).drivername in _SQLITE


def async_url(url: str) -> URL:
    parsed = parse_url(url)
    driver = "sqlite+aiosqlite" if parsed.drivername in _SQLITE else "postgresql+psycopg"
    return parsed.set(drivername=driver)


def sync_url(url: str) -> URL:
    parsed = parse_url(url)
    driver = "sqlite" if parsed.drivername in _SQLITE else "postgresql+psycopg"
    return parsed.set(drivername=driver)


def upsert(engine: AsyncEngine, table: Table) -> Any:
    """``INSERT`` for ``table`` in the engine's dialect, which both dialects let end in
    ``ON CONFLICT ... DO UPDATE`` (``.on_conflict_do_update``)."""
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)


def _ensure_sqlite_dir(url: URL) -> None:
    if url.database and url.database != ":memory:":
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers (audit tail, the admin API) run while the writer appends.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def postgres_deadlines(silence_s: float, statement_s: float) -> dict[str, Any]:
    """libpq connection arguments that put a deadline on every call (DESIGN.md rule 10).

    Client side: ``connect_timeout`` for the whole start-up, TCP keepalives and
    ``tcp_user_timeout`` so a peer that went silent (a black-holed route: no reset, no answer)
    is given up within about ``silence_s`` by the kernel, in the middle of a statement too.
    Server side (``options``): ``statement_timeout`` and ``idle_in_transaction_session_timeout``
    end a statement or transaction left open by a client that vanished (a COPY waiting for data
    for ever), and the server's own keepalives find that client. ``silence_s`` 0: none of the
    network ones; ``statement_s`` 0: no statement timeout."""
    args: dict[str, Any] = {"connect_timeout": 3}
    gucs: list[str] = []
    if silence_s > 0:
        idle = max(1, round(silence_s / 3))
        args |= {
            "keepalives": 1,
            "keepalives_idle": idle,
            "keepalives_interval": idle,
            "keepalives_count": 2,
            "tcp_user_timeout": round(silence_s * 1000),
        }
        gucs += [
            f"tcp_keepalives_idle={idle}",
            f"tcp_keepalives_interval={idle}",
            "tcp_keepalives_count=2",
            f"idle_in_transaction_session_timeout={round(max(silence_s, statement_s) * 1000)}",
        ]
    if statement_s > 0:
        gucs.append(f"statement_timeout={round(statement_s * 1000)}")
    if gucs:
        args["options"] = " ".join(f"-c {g}" for g in gucs)
    return args


def make_async_engine(
    url: str, *, silence_s: float = 10.0, statement_s: float = 300.0, pooled: bool = True
) -> AsyncEngine:
    """An engine whose every call has a deadline on PostgreSQL (:func:`postgres_deadlines`);
    on SQLite (a local file) lock waits are bounded by ``busy_timeout``. ``pooled`` False
    (PostgreSQL): a new connection for each use, closed after it, so no connection left idle
    in a pool across a network cut can hang the next user (the audit writer's drains, which
    watch their own connection: gtm.audit.deadline)."""
    target = async_url(url)
    # JSON columns serialised with orjson: the writer inserts thousands of rows a second.
    kwargs: dict[str, Any] = {"json_serializer": _json, "json_deserializer": orjson.loads}
    if target.drivername.startswith("sqlite"):
        _ensure_sqlite_dir(target)
    else:
        # Fail fast when the server is away; the writer spools and retries on its own schedule.
        # A pooled connection is checked before use and one that failed is discarded.
        kwargs |= {"connect_args": postgres_deadlines(silence_s, statement_s)}
        kwargs |= {"pool_pre_ping": True} if pooled else {"poolclass": NullPool}
    engine = create_async_engine(target, **kwargs)
    if target.drivername.startswith("sqlite"):
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    else:
        deadline_every_call(engine, silence_s=silence_s, statement_s=statement_s)
    return engine


def make_sync_engine(url: str) -> Engine:
    target = sync_url(url)
    if target.drivername.startswith("sqlite"):
        _ensure_sqlite_dir(target)
        engine = create_engine(target)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(target, connect_args={"connect_timeout": 3})
