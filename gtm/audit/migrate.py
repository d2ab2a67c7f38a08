"""Running the alembic migrations from code (``gtm db upgrade``, ``gtm serve``, tests)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from gtm.audit.database import make_sync_engine, sync_url


def _script_location() -> Path:
    # Installed wheels carry the migrations inside the package; a checkout has them at the top.
    package = Path(__file__).resolve().parents[1]
    packaged = package / "migrations"
    return packaged if packaged.is_dir() else package.parent / "migrations"


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_script_location()))
    url = sync_url(database_url).render_as_string(hide_password=False)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def current_revision(database_url: str) -> str | None:
    engine = make_sync_engine(database_url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision(database_url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
