"""Alembic environment: the same migrations on SQLite and PostgreSQL.

The URL comes from the Config (``gtm db upgrade`` sets it from the settings); batch mode lets
SQLite alter tables by copying them, which it needs for most ALTERs.
"""

from __future__ import annotations

from alembic import context

from gtm.audit.database import make_sync_engine
from gtm.audit.schema import include_object, metadata

config = context.config


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        literal_binds=True,
        render_as_batch=True,
        include_object=include_object,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url must be set"
    engine = make_sync_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            render_as_batch=True,
            include_object=include_object,
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
