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


def make_async_engine(url: str) -> AsyncEngine:
    target = async_url(url)
    # JSON columns serialised with orjson: the writer inserts thousands of rows a second.
    kwargs: dict[str, Any] = {"json_serializer": _json, "json_deserializer": orjson.loads}
    if target.drivername.startswith("sqlite"):
        _ensure_sqlite_dir(target)
    else:
        # Fail fast when the server is away; the writer spools and retries on its own schedule.
        kwargs |= {"pool_pre_ping": True, "connect_args": {"connect_timeout": 3}}
    engine = create_async_engine(target, **kwargs)
    if target.drivername.startswith("sqlite"):
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


def make_sync_engine(url: str) -> Engine:
    target = sync_url(url)
    if target.drivername.startswith("sqlite"):
        _ensure_sqlite_dir(target)
        engine = create_engine(target)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(target, connect_args={"connect_timeout": 3})
