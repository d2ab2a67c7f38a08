from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gtm.decision.geoip import GeoDatabase
from gtm.decision.policy import PolicySet, load_policy
from gtm.decision.snapshot import Snapshot
from gtm.decision.topology import Topology, load_topology
from tests.support.geoip import build_city_db
from tests.support.postgres import postgres_database

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "demo.yaml"
POLICIES = ROOT / "policies"


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
