"""The reference pages of the docs site are generated from the code (tools/reference_docs.py):
a command, setting, metric or admin API operation added without regenerating them fails here,
and so does a setting nobody explained."""

from __future__ import annotations

import subprocess
import sys

from gtm.settings import Settings
from tests.conftest import ROOT

REFERENCE = ROOT / "docs" / "reference"


def test_the_committed_reference_pages_are_what_the_code_writes() -> None:
    # A fresh process: the metrics page reads the process-wide Prometheus registry, which
    # other tests' nodes add collectors to.
    out = subprocess.run(
        [sys.executable, "tools/reference_docs.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_pages_name_every_setting_command_and_metric() -> None:
    """The generator walks the code; spot-check that what it walks is the whole of it."""
    settings = (REFERENCE / "settings.md").read_text()
    missing = [n for n in Settings.model_fields if f"| `GTM_{n.upper()}` |" not in settings]
    assert not missing, missing
    cli = (REFERENCE / "cli.md").read_text()
    for command in ("gtm proposal activate", "gtm audit verify", "gtm region status",
                    "regional-lb"):  # fmt: skip
        assert f"`{command}`" in cli, command
    assert "`--acknowledge-leak`" in cli
    metrics = (REFERENCE / "metrics.md").read_text()
    for metric in ("gtm_audit_rows_written_total", "gtm_dns_responses_total",
                   "gtm_front_connections_open", "regional_lb_pick_seconds"):  # fmt: skip
        assert f"| `{metric}` |" in metrics, metric
    schema = (REFERENCE / "policy-schema.md").read_text()
    assert "| `trusted_resolvers` |" in schema and "## `Rule`" in schema
    api = (REFERENCE / "admin-api.md").read_text()
    assert "## `POST /v1/proposals/{proposal_id}/activate`" in api


def test_every_setting_has_a_meaning_in_the_code() -> None:
    """A description, or a comment it stands under in gtm/settings.py: the page says what
    each one is for."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import reference_docs
    finally:
        sys.path.remove(str(ROOT / "tools"))
    comments = reference_docs.setting_comments((ROOT / "gtm" / "settings.py").read_text())
    silent = [
        name
        for name, info in Settings.model_fields.items()
        if not info.description and not any(comments.get(name, ("", "")))
    ]
    assert not silent, f"settings with no description or comment: {silent}"
