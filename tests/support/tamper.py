"""Acting as an attacker who holds the database's superuser password: on PostgreSQL the
evidence tables' triggers refuse edits (migration 0007), so the attacker switches them off for
the transaction first, as such a password allows."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection


async def triggers_off(conn: AsyncConnection) -> None:
    if conn.dialect.name == "postgresql":
        await conn.execute(text("SET LOCAL session_replication_role = replica"))
