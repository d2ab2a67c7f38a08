"""The ``gtm`` command end to end, as a user runs it (subprocesses, real files)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import DEMO, POLICIES, ROOT
from tests.support.geoip import build_city_db

GTM = [sys.executable, "-m", "gtm"]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    geoip = build_city_db(tmp_path / "city.mmdb")
    return os.environ | {
        "GTM_CONFIG": str(DEMO),
        "GTM_POLICIES": json.dumps([str(POLICIES)]),
        "GTM_GEOIP_PATH": str(geoip),
        "GTM_DATABASE_URL": f"sqlite:///{tmp_path / 'g.sqlite3'}",
        "GTM_SPOOL_DIR": str(tmp_path / "spool"),
        "GTM_NODE_ID": "cli-node",
        "GTM_PROBES": "false",
    }


def run(args: list[str], env: dict[str, str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GTM, *args], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT, **kw
    )  # type: ignore[call-overload]


def test_explain_json(env: dict[str, str]) -> None:
    out = run(
        ["explain", "--client", "203.0.113.8", "--name", "chat.eu.gtm.example.", "--json"], env
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["outcome"] == "answer"
    assert d["region"] == "eu-west"
    assert d["answer"]["ipv4"] == ["192.0.2.30"]
    assert {c["region"]: c["status"] for c in d["candidates"]}["us-east"] == "dropped"
    assert all({"region", "status", "reason"} <= set(c) for c in d["candidates"])
    assert set(d["versions"]) == {"snapshot", "topology", "policy", "geoip"}


def test_explain_with_ecs_and_a_what_if_state(env: dict[str, str], tmp_path: Path) -> None:
    state = tmp_path / "state.yaml"
    state.write_text("health: {eu-west: down, eu-central: down}\n")
    out = run(
        [
            "explain",
            "--client",
            "203.0.113.8",
            "--ecs",
            "198.51.100.0/24",
            "--name",
            "chat.eu.gtm.example",
            "--state",
            str(state),
            "--json",
        ],
        env,
    )
    d = json.loads(out.stdout)
    assert d["outcome"] == "fail_closed"
    assert d["dns_failure"] == "nodata"
    assert d["answer"]["ipv4"] == []
    assert d["location"]["country"] == "DE"
    # The shipped policies trust no resolver: the ECS was judged with the sender's address.
    assert d["residency_basis"] == "ecs+address"
    text = run(["explain", "--client", "198.51.100.3", "--name", "chat.gtm.example"], env)
    assert text.returncode == 0
    assert "-> eu-central" in text.stdout
    assert "nearest" in text.stdout
    assert "residency judged on address" in text.stdout


def test_bad_arguments_and_documents_exit_2_with_every_reason(
    env: dict[str, str], tmp_path: Path
) -> None:
    out = run(["explain", "--client", "not-an-ip", "--name", "chat.gtm.example"], env)
    assert out.returncode == 2
    assert "does not appear to be an IPv4 or IPv6" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: '1'\nrules:\n  - {id: r, match: {residency_class: [x]}, "
        "allow: {regions: [mars]}, on_unavailable: fail_static}\n  - {id: Q}\n"
    )
    out = run(["policy", "validate", str(bad)], env)
    assert out.returncode == 2
    assert "rules[0]" in out.stderr
    assert "rules[1].id" in out.stderr
    assert "rules[1].match" in out.stderr
    assert "rules[1].allow" in out.stderr
    ok = run(["policy", "validate", "--config", str(DEMO), str(POLICIES)], env)
    assert ok.returncode == 0
    assert "3 document(s)" in ok.stdout


def test_missing_geoip_file_names_the_setting(env: dict[str, str], tmp_path: Path) -> None:
    out = run(
        ["explain", "--client", "1.2.3.4", "--name", "chat.gtm.example"],
        env | {"GTM_GEOIP_PATH": str(tmp_path / "absent.mmdb")},
    )
    assert out.returncode == 2
    assert "GTM_GEOIP_PATH" in out.stderr


def test_serve_runs_until_sigterm_and_audit_commands_work(env: dict[str, str]) -> None:
    proc = subprocess.Popen([*GTM, "serve"], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 30
        started = ""
        while time.monotonic() < deadline and "gtm.started" not in started:
            started += proc.stderr.readline()
        assert "gtm.started" in started, started
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr is not None:
            proc.stderr.close()
    # serve migrated the database: the audit commands work on it.
    newest = max(p.name[:4] for p in (ROOT / "migrations" / "versions").glob("[0-9]*.py"))
    assert run(["db", "current"], env).stdout.strip() == f"current {newest}, newest {newest}"
    verify = run(["audit", "verify"], env)
    assert verify.returncode == 0
    assert "0 decision row(s) and 0 region event(s) checked" in verify.stdout


def test_serve_refuses_bad_listen_addresses(env: dict[str, str]) -> None:
    out = run(["serve", "--admin", "localhost:8080"], env)
    assert out.returncode == 2 and "is not an IP address" in out.stderr
    bad = run(["serve", "--dns", "localhost:53x"], env)
    assert bad.returncode == 2 and "HOST:PORT" in bad.stderr


def test_audit_tail_and_export(env: dict[str, str], tmp_path: Path) -> None:
    seed = (
        "import asyncio\n"
        "from ipaddress import ip_address\n"
        "from gtm.settings import load_settings\nfrom gtm.runtime import Runtime\n"
        "from gtm.audit.record import record_of\n"
        "from gtm.decision.routing import DecisionRequest, Channel, decide\n"
        "async def main():\n"
        "    rt = Runtime(load_settings()); await rt.start()\n"
        "    for i in range(7):\n"
        "        req = DecisionRequest(Channel.HTTP, ip_address(f'198.51.100.{i}'), 'chat', 'c')\n"
        "        rt.count(record_of(decide(req, rt.store.current, 0.0), channel='http',"
        " name='chat.gtm.example'))\n"
        "    await rt.stop()\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", seed], env=env, cwd=ROOT, check=True, timeout=60)
    tail = run(["audit", "tail", "--json"], env)
    rows = [json.loads(line) for line in tail.stdout.splitlines()]
    assert len(rows) == 1
    assert rows[0]["count"] == 7
    assert rows[0]["region"] == "eu-central"
    out_file = tmp_path / "export.csv"
    exp = run(["audit", "export", "--format", "csv", "-o", str(out_file)], env)
    assert exp.returncode == 0
    assert "exported 1 row(s)" in exp.stderr
    assert out_file.read_text().splitlines()[0].startswith("node,node_seq,")
    future = run(["audit", "export", "--since", "2999-01-01T00:00:00+00:00"], env)
    assert future.stdout == ""
    assert "exported 0 row(s)" in future.stderr
    assert run(["audit", "verify"], env).returncode == 0


def test_verify_says_unanchored_rows_are_normal_and_what_it_concluded(
    env: dict[str, str],
) -> None:
    """Rows a running node wrote after its last checkpoint: listed, said to be normal, and the
    verdict said in words. (A node killed before it checkpointed leaves them; its sealed rows
    are in the database.)"""
    seed = (
        "import asyncio, os\n"
        "from ipaddress import ip_address\n"
        "from gtm.settings import load_settings\nfrom gtm.runtime import Runtime\n"
        "from gtm.audit.record import record_of\n"
        "from gtm.decision.routing import DecisionRequest, Channel, decide\n"
        "async def main():\n"
        "    rt = Runtime(load_settings()); await rt.start()\n"
        "    req = DecisionRequest(Channel.HTTP, ip_address('198.51.100.1'), 'chat', 'c')\n"
        "    rt.count(record_of(decide(req, rt.store.current, 0.0), channel='http',"
        " name='chat.gtm.example'))\n"
        "    await rt.writer.flush()\n"
        "    os._exit(0)  # no stop: no checkpoint after the row\n"
        "asyncio.run(main())\n"
    )
    subprocess.run([sys.executable, "-c", seed], env=env, cwd=ROOT, check=True, timeout=60)
    verify = run(["audit", "verify"], env | {"GTM_AUDIT_CHECKPOINT_INTERVAL_S": "10"})
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert re.search(
        r"^UNANCHORED \S+: 1 row\(s\) after its newest checkpoint$", verify.stdout, re.M
    )
    assert "(normal while a node runs: it checkpoints a chain that moved every 10 s" in (
        verify.stdout
    )
    assert verify.stdout.rstrip().splitlines()[-1].startswith("no break: ")


def test_a_what_if_state_file_gets_every_problem_with_its_path(
    env: dict[str, str], tmp_path: Path
) -> None:
    state = tmp_path / "state.yaml"
    state.write_text("capacity: {eu-central: 0.97}\nhealth: {eu-cental: down, us-east: sideways}\n")
    args = ["explain", "--client", "8.8.8.8", "--name", "chat.gtm.example", "--state", str(state)]
    out = run(args, env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "3 problem(s)" in out.stderr
    assert "capacity.eu-central: Input should be a valid dictionary" in out.stderr
    assert "health.eu-cental: no region 'eu-cental' in the topology" in out.stderr
    assert "health.us-east: Input should be 'up'" in out.stderr
    state.write_text("health: {eu-central: down}\ncapacity: {eu-west: {utilisation: 0.5}}\n")
    ok = run(args, env)
    assert ok.returncode == 0, ok.stderr


def test_report_key_derives_one_regions_key_only(env: dict[str, str]) -> None:
    from regional_lb.capacity_report import region_secret

    with_secret = env | {"GTM_REPORT_SECRET": "fleet-secret"}
    out = run(["report-key", "eu-west"], with_secret)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == region_secret(b"fleet-secret", "eu-west").decode()
    assert out.stdout.strip() != run(["report-key", "us-east"], with_secret).stdout.strip()
    assert run(["report-key", "mars"], with_secret).returncode == 2
    assert "GTM_REPORT_SECRET is unset" in run(["report-key", "eu-west"], env).stderr
