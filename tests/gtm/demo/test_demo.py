"""`make demo` runs to the end: the walkthrough, then the live topology (regional balancers,
simulated instances, DNS and the HTTP front) answering, and a failover."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_demo_once(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gtm.demo", "--once"],
        cwd=ROOT,
        env=os.environ | {"GTM_DEMO_VAR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "fail_closed" in text and "(outside the database): intact" in text
    # A US resolver's client with EU personal data is answered from Dublin.
    assert any(
        line.split()[:4] == ["chat.eu.gtm.example.", "A", "8.8.8.0/24", "192.0.2.30"]
        for line in text.splitlines()
    )
    assert "NXDOMAIN" in text
    assert "all 6 regions up" in text
    pushed = next(line for line in text.splitlines() if "pushed by the balancers" in line)
    assert int(pushed.rsplit(" ", 1)[1]) > 0
    # Through the front to the EU region's balancer and its simulated instance.
    assert "POST chat.eu.gtm.example from 8.8.8.8: 307 -> eu-west" in text
    assert "-> 200 'tok1" in text and ": 451 " in text
    # And as a user makes the call: curl follows the redirect to the balancer (CI has curl).
    # Its port is the topology's (8103) unless that was taken, as when another demo runs.
    up = next(line for line in text.splitlines() if " balancers up: " in line)
    balancers = dict(item.split(" ") for item in up.split(": ", 1)[1].split(", "))
    assert (
        "curl -L POST chat.eu.gtm.example from 8.8.8.8: 1 redirect(s), answered by "
        f"{balancers['eu-west']}/v1/chat/completions (200): 'tok1" in text
    )
    assert "answer moved 192.0.2.40 -> 192.0.2.30" in text
    # The operator drains eu-west as well: EU personal data fails closed, the rest goes on.
    assert "Berlin asks chat.eu.gtm.example.   -> NODATA" in text
    assert "Berlin asks chat.gtm.example.      -> 192.0.2.50" in text
    assert "override  set: drained" in text and "by demo-operator: GPU driver upgrade" in text
    # It ends with the fleet whole again: no region left down or drained.
    assert "Back to a whole fleet" in text
    assert text.count("all 6 regions up") == 2
    # The console: its URL, a token for each demo person, traffic on the map, a proposal.
    assert "console: http://127.0.0.1:" in text
    people = {}
    for person in ("demo-operator", "demo-author", "demo-approver", "demo-auditor", "demo-admin"):
        line = next(line for line in text.splitlines() if line.strip().startswith(person))
        assert line.split()[-1].startswith("gtm_")
        people[person] = line
    # Four-eyes, seen as itself: the author holds the approver role, and is refused anyway.
    assert "policy-approver" in people["demo-author"] and "admin" in people["demo-admin"]
    four_eyes = next(line for line in text.splitlines() if line.startswith("four-eyes:"))
    assert "refused, HTTP 403" in four_eyes and "may not approve it" in four_eyes
    # What the admin CLI needs, printed as a shell takes it.
    assert "export GTM_ADMIN_URL=http://127.0.0.1:" in text
    assert f"""$1 == "demo-operator" {{print $2}}' {tmp_path / "demo-tokens"})""" in text
    assert (tmp_path / "demo-tokens").stat().st_mode & 0o777 == 0o600
    live = next(line for line in text.splitlines() if line.startswith("live traffic on the map"))
    assert int(live.split()[5]) > 0
    assert "it waits for demo-approver" in text
    # The CLI reads the demo's database: the commands it suggests work as printed.
    assert (tmp_path / "gtm.sqlite3").exists()
    for suggested in ("gtm audit tail", "gtm region status"):
        line = next(line for line in text.splitlines() if suggested in line)
        args = line.split(".venv/bin/gtm ", 1)[1].split()
        run = subprocess.run(
            [sys.executable, "-m", "gtm", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip()
