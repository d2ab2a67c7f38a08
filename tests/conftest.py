from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import hypothesis
import psycopg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.audit import migrate
from gtm.audit.database import make_async_engine
from gtm.decision import memos
from gtm.decision.geoip import GeoDatabase
from gtm.decision.memos import MemoLimits
from gtm.decision.policy import PolicySet, load_policy
from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import Topology, load_topology
from gtm.geodns import wire
from tests.support.geoip import build_city_db
from tests.support.postgres import postgres_database

# Property tests draw the same examples on every run (derandomized), so a test that passes
# keeps passing and a landing never waits on the luck of a draw; HYPOTHESIS_PROFILE=explore
# draws new ones each run, for looking for failures on purpose.
hypothesis.settings.register_profile("deterministic", derandomize=True, database=None)
hypothesis.settings.register_profile("explore", derandomize=False)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo.yaml"
POLICIES = ROOT / "policies"


@pytest.fixture(autouse=True)
def _default_memo_limits() -> Iterator[None]:
    """The slow path's memo limits are process-wide, and a node sets them from its budget: the
    default budget's are in force at the start of each test and put back after it, so a tiny
    budget does not outlive its test."""

    def defaults() -> None:
        memos.bound(MemoLimits.from_mb(memos.DEFAULT_BUDGET_MB))
        wire.bound_memos(wire.parsed_entries(memos.DEFAULT_BUDGET_MB))

    defaults()
    yield
    defaults()


@pytest.fixture(scope="session")
def geoip_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_city_db(tmp_path_factory.mktemp("geoip") / "city.mmdb")


@pytest.fixture(scope="session")
def topology() -> Topology:
    return load_topology(DEMO)


@pytest.fixture(scope="session")
def policy(topology: Topology) -> PolicySet:
    return load_policy([POLICIES], topology)


@pytest.fixture
def snapshot(topology: Topology, policy: PolicySet, geoip_path: Path) -> Snapshot:
    return Snapshot(1, topology, policy, GeoDatabase(geoip_path), built_at=1000.0)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.fixture
def postgres_logins(postgres_url: str) -> Iterator[dict[str, str]]:
    """A migrated PostgreSQL database and a login of each GTM role (migration 0007), as URLs."""
    migrate.downgrade(postgres_url, "base")
    migrate.upgrade(postgres_url)
    owner = make_url(postgres_url)
    made = {}
    with psycopg.connect(owner.set(drivername="postgresql").render_as_string(False),
                         autocommit=True) as conn:  # fmt: skip
        for role in ("gtm_node", "gtm_admin", "gtm_reader"):
            name = f"{role}_{secrets.token_hex(3)}"
            conn.execute(f"CREATE ROLE {name} LOGIN IN ROLE {role}")
            made[role] = owner.set(username=name).render_as_string(hide_password=False)
        yield made
        for url in made.values():
            conn.execute(f"DROP OWNED BY {make_url(url).username}")
            conn.execute(f"DROP ROLE {make_url(url).username}")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty store: a SQLite file, and the real PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'store.sqlite3'}"
    else:
        url = request.getfixturevalue("postgres_url")
        migrate.downgrade(url, "base")  # each test starts from an empty schema
    migrate.upgrade(url)
    return url


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    eng = make_async_engine(database_url)
    yield eng
    await eng.dispose()
