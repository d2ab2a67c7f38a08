"""`gtm --help` loads no command group's machinery: the groups are imported when one of their
commands runs (gtm.cli.lazy), and the root's list of them says what the groups themselves say.
How long it takes is measured in bench/cli_startup.py, not here."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import typer.main
from typer.testing import CliRunner

from gtm.cli.main import LAZY_GROUPS, app
from tests.conftest import ROOT

# What the node, the admin service and the audit store bring: none of it to print help.
HEAVY = ("sqlalchemy", "fastapi", "alembic", "psycopg", "dns", "gtm.admin", "gtm.node",
         "gtm.audit", "gtm.decision", "gtm.fleet", "gtm.runtime", "regional_lb")  # fmt: skip

_PROBE = """
import sys
from typer.testing import CliRunner
from gtm.cli.main import app
result = CliRunner().invoke(app, sys.argv[1:])
assert result.exit_code == 0, result.output
print(" ".join(sorted(sys.modules)))
"""


def _loaded_by(*args: str, env: dict[str, str] | None = None) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        cwd=ROOT,
        env=os.environ | (env or {}),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(out.stdout.split())


def test_help_loads_none_of_the_commands_machinery() -> None:
    loaded = _loaded_by("--help")
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY))
    assert heavy == [], heavy
    # A group's own help loads that group, and only what it needs: the proposal commands are
    # clients of the admin API, and load neither the admin service nor the database.
    proposal = _loaded_by("proposal", "show", "--help")
    assert "gtm.cli.control" in proposal
    for module in ("sqlalchemy", "fastapi", "gtm.admin.app", "gtm.fleet", "gtm.runtime"):
        assert module not in proposal, module


def test_reading_commands_load_no_migrations_or_node_on_a_current_database(
    tmp_path: Path,
) -> None:
    """`gtm region status` and `gtm audit tail` are what an operator runs most: on a database
    already at the schema's head they load neither alembic nor a node's moving parts; on a
    fresh one region status still answers (it migrates first, then reads)."""
    env = {"GTM_DATABASE_URL": f"sqlite:///{tmp_path / 'gtm.sqlite3'}"}
    fresh = _loaded_by("region", "status", env=env)
    assert "alembic" in fresh  # the fresh file was migrated
    for command in (("region", "status"), ("audit", "tail"), ("region", "events")):
        loaded = _loaded_by(*command, env=env)
        for module in ("alembic", "gtm.runtime", "gtm.audit.writer", "fastapi"):
            assert module not in loaded, (command, module)


def test_the_root_lists_each_group_with_its_own_help() -> None:
    for name, (target, help_line) in LAZY_GROUPS.items():
        module, _, attribute = target.partition(":")
        group = getattr(importlib.import_module(module), attribute)
        assert group.info.help == help_line, name
        assert typer.main.get_group(group).commands, name
    listing = CliRunner().invoke(app, ["--help"]).output
    for name, (_, help_line) in LAZY_GROUPS.items():
        # The line as shown (the terminal may wrap its end).
        assert f" {name} " in listing and help_line[:30] in listing, name


def test_a_lazy_group_runs_its_commands() -> None:
    result = CliRunner().invoke(app, ["admin", "openapi"])
    assert result.exit_code == 0, result.output
    assert '"/v1/proposals/{proposal_id}/activate"' in result.output
    unknown = CliRunner().invoke(app, ["nosuch"])
    assert unknown.exit_code == 2 and "No such command" in unknown.output
