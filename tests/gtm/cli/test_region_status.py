"""``gtm region status`` recounts the fleet's state as the nodes do: rows of
``health_observations`` that are no member's signed word (made-up observers, dated ten years
ahead, as issue 31's attack wrote them) change nothing it shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import create_engine, insert

from gtm.audit import migrate
from gtm.audit.schema import health_observations
from tests.conftest import ROOT


def test_forged_observations_do_not_move_what_region_status_shows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'gtm.sqlite3'}"
    migrate.upgrade(url)
    later = int((time.time() + 10 * 365 * 86400) * 1e6)
    engine = create_engine(url)
    with engine.begin() as conn:
        for node in ("ghost-1", "ghost-2"):
            conn.execute(
                insert(health_observations),
                {
                    "node": node,
                    "region": "eu-central",
                    "state": "down",
                    "since_us": later,
                    "observed_at_us": later,
                    "detail": "made up",
                },
            )
    engine.dispose()
    out = subprocess.run(
        [sys.executable, "-m", "gtm", "region", "status", "--json"],
        env=os.environ | {"GTM_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["region"]: r for r in json.loads(out.stdout)}
    assert rows["eu-central"]["state"] != "down", rows["eu-central"]
