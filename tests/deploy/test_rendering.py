"""What the Terraform modules render, rendered by terraform itself (the modules without
resources, in a scratch directory, offline) and read by the programs that will read it on a
node: GTM's topology and policy parsers and settings, the balancer's config parser, systemd and
bash. The three-region example's own documents (policies, routing, balancers) go through the
same path."""

from __future__ import annotations

import base64
import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gtm.decision.policy import load_policy
from gtm.decision.topology import parse_topology
from gtm.settings import Settings
from regional_lb.config import parse_config
from tests.conftest import ROOT
from tests.deploy.terraform_run import apply_outputs, plan_errors

MODULES = ROOT / "terraform" / "modules"
EXAMPLE = ROOT / "terraform" / "examples" / "three-regions"
NODES = ["gtm-ap-south-1", "gtm-eu-west-1", "gtm-eu-west-2", "gtm-us-east-1"]
POLICIES = {p.name: p.read_text() for p in sorted((EXAMPLE / "policies").glob("*.yaml"))}
DATABASE = {"host": "gtm-db.abc.eu-west-1.rds.amazonaws.com", "port": 5432, "name": "gtm"}
SECRETS = """{
    report_secret         = "gtm/report-secret"
    document_signing_key  = "gtm/document-signing-key"
    document_public_key   = "gtm/document-public-key"
    admin_bootstrap_token = "gtm/admin-bootstrap-token"
    dns_cookie_secret     = "gtm/dns-cookie-secret"
    db_login              = "gtm/db/NODE"
  }"""


def _hcl(value: Any) -> str:
    """A Python value as an HCL expression (JSON is valid HCL for strings, lists, objects)."""
    return json.dumps(value)


REGIONS = [
    {
        "id": rid,
        "name": rid.upper(),
        "lat": lat,
        "lon": lon,
        "jurisdiction": jurisdiction,
        "ipv4": addresses,
        "base_url": f"https://{rid}.inference.example.com",
        "probe_url": f"https://{rid}.inference.example.com/gtm/capacity",
    }
    for rid, lat, lon, jurisdiction, addresses in (
        ("eu-west", 53.35, -6.26, "EU", ["203.0.113.10", "203.0.113.11"]),
        ("us-east", 39.04, -77.49, "US", ["203.0.113.20"]),
        ("ap-south", 19.08, 72.88, "IN", ["203.0.113.30"]),
    )
]
SERVICES = [
    {
        "id": "chat",
        "dns_names": ["chat.gtm.example.com."],
        "http_hosts": ["chat.gtm.example.com"],
        "regions": ["eu-west", "us-east", "ap-south"],
    },
    {
        "id": "chat-eu",
        "dns_names": ["chat.eu.gtm.example.com."],
        "regions": ["eu-west", "us-east", "ap-south"],
        "residency_class": "eu-personal",
    },
]
ZONE = {"apex": "gtm.example.com.", "hostmaster": "hostmaster.example.com.", "serial": 2026112401}


def _topology_call(nameservers: list[dict[str, Any]]) -> str:
    return f"""
module "topology" {{
  source      = "{MODULES / "gtm-topology"}"
  zone        = {_hcl(ZONE)}
  nameservers = {_hcl(nameservers)}
  regions     = {_hcl(REGIONS)}
  services    = {_hcl(SERVICES)}
  extra_yaml  = file("{EXAMPLE / "routing.yaml"}")
}}
"""


NAMESERVERS = [
    {"name": "ns1.gtm.example.com.", "ipv4": ["198.51.100.1", "198.51.100.2"]},
    {"name": "ns2.gtm.example.com.", "ipv4": ["198.51.100.3", "198.51.100.4"]},
    {"name": "ns.dns-provider.example.net.", "ipv4": []},
]


def _node_call(label: str, node: str, admin: bool, bootstrap: bool) -> str:
    boot = "null"
    if bootstrap:
        logins = {n.replace("-", "_"): {"role": "gtm_node", "secret": f"gtm/db/{n}"} for n in NODES}
        boot = _hcl(
            {
                "master_secret": "arn:aws:secretsmanager:eu-west-1:111122223333:secret:rds-x",
                "logins": logins,
                "report_keys": {r["id"]: f"gtm/report-key/{r['id']}" for r in REGIONS},
            }
        )
    return f"""
module "{label}" {{
  source            = "{MODULES / "gtm-node-config"}"
  node_name         = "{node}"
  aws_region        = "eu-west-1"
  admin             = {str(admin).lower()}
  health_members    = {_hcl(NODES)}
  ops_allow         = ["10.10.0.0/16", "10.20.0.0/16", "198.51.100.77/32"]
  settings          = {{ GTM_FENCE_AFTER_S = "45" }}
  topology_yaml     = module.topology.topology_yaml
  policies          = {_hcl(POLICIES)}
  secrets           = {SECRETS.replace("NODE", node)}
  database          = {_hcl(DATABASE)}
  checkpoint_bucket = {{ name = "gtm-checkpoints-1", region = "eu-west-1" }}
  geoip_s3_uri      = "s3://geo-bucket/GeoIP2-City.mmdb"
  package           = {{ spec = "gtm==0.1.0", index_url = "https://packages.example.com/simple/" }}
  bootstrap         = {boot}
}}
output "{label}" {{ value = module.{label}.user_data }}
output "{label}_gz" {{ value = module.{label}.user_data_base64 }}
"""


def _balancer_call(region: str) -> str:
    return f"""
module "balancer_{region.replace("-", "_")}" {{
  source            = "{MODULES / "balancer-node-config"}"
  region_id         = "{region}"
  aws_region        = "eu-west-1"
  config_yaml       = file("{EXAMPLE / "balancers" / f"{region}.yaml"}")
  gtm_urls          = ["http://198.51.100.1", "http://198.51.100.3"]
  report_key_secret = "gtm/report-key/{region}"
  package           = {{ spec = "gtm==0.1.0" }}
}}
output "balancer_{region}" {{ value = module.balancer_{region.replace("-", "_")}.user_data }}
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    main = _topology_call(NAMESERVERS)
    main += 'output "topology" { value = module.topology.topology_yaml }\n'
    main += 'output "delegation" { value = module.topology.delegation }\n'
    main += _node_call("admin_node", "gtm-eu-west-1", admin=True, bootstrap=True)
    main += _node_call("plain_node", "gtm-us-east-1", admin=False, bootstrap=False)
    for region in ("eu-west", "us-east", "ap-south"):
        main += _balancer_call(region)
    return apply_outputs(tmp_path_factory.mktemp("render"), main)


def _cloud_config(text: str) -> dict[str, Any]:
    assert text.startswith("#cloud-config\n")
    document = yaml.safe_load(text)
    assert isinstance(document, dict)
    return document


def _files(text: str) -> dict[str, dict[str, Any]]:
    return {f["path"]: f for f in _cloud_config(text)["write_files"]}


def _env_file(content: str) -> dict[str, str]:
    """systemd EnvironmentFile lines KEY='value' as a dict (every line must be one)."""
    out = {}
    for line in content.splitlines():
        key, sep, value = line.partition("=")
        assert sep and value.startswith("'") and value.endswith("'"), line
        out[key] = value[1:-1]
    return out


def test_the_topology_loads_in_gtm_with_the_example_policies(
    rendered: dict[str, Any], tmp_path: Path
) -> None:
    topology = parse_topology(yaml.safe_load(rendered["topology"]), "rendered")
    assert [r.id for r in topology.regions] == ["eu-west", "us-east", "ap-south"]
    assert topology.routing.spillover.high_watermark == 0.85
    policy = load_policy([EXAMPLE / "policies"], topology)
    assert policy is not None


def test_the_parent_delegates_to_exactly_the_name_servers_gtm_serves(
    rendered: dict[str, Any],
) -> None:
    topology = parse_topology(yaml.safe_load(rendered["topology"]), "rendered")
    delegation = rendered["delegation"]
    served = [ns.name for ns in topology.zone.nameservers]
    assert delegation["zone"] == topology.zone.apex
    assert delegation["nameservers"] == served
    assert topology.zone.soa.mname == served[0]
    assert delegation["ttl"] == topology.zone.ttl
    # Glue: every in-zone name server, with the addresses GTM serves for it, and nothing else.
    glue = {(g["name"], g["type"]): g["records"] for g in delegation["glue"]}
    expected = {
        (ns.name, "A"): [str(a) for a in ns.ipv4]
        for ns in topology.zone.nameservers
        if ns.name.endswith("." + topology.zone.apex)
    }
    assert glue == expected and len(glue) == 2


def test_an_in_zone_name_server_without_glue_is_refused_at_plan(tmp_path: Path) -> None:
    broken = [{"name": "ns1.gtm.example.com.", "ipv4": []}, NAMESERVERS[1]]
    errors = plan_errors(tmp_path, _topology_call(broken))
    assert "needs addresses (the glue in the parent zone)" in errors


def test_a_single_name_server_is_refused_at_plan(tmp_path: Path) -> None:
    errors = plan_errors(tmp_path, _topology_call(NAMESERVERS[:1]))
    assert "at least two" in errors


def test_node_settings_are_valid_gtm_settings(
    rendered: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for label in ("admin_node", "plain_node"):
        env = _env_file(_files(rendered[label])["/etc/gtm/gtm.env"]["content"])
        for key in [k for k in os.environ if k.startswith("GTM_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        settings = Settings()
        # Split brain designed out: every node votes with its own name among all the nodes.
        assert settings.health_members == tuple(NODES)
        own = "gtm-eu-west-1" if label == "admin_node" else "gtm-us-east-1"
        assert settings.observer_id == own
        assert settings.migrate_on_start is False and settings.fence_after_s == 45
        assert settings.dns_listen == ("0.0.0.0:5353",) and settings.http_listen == "0.0.0.0:8080"
        assert (settings.admin_listen is not None) is (label == "admin_node")
        assert (settings.document_signing_key is not None) is (label == "admin_node")
        assert settings.report_secret is None  # secrets are never in the user data
        # The fleet's cookie secret is named in /run/gtm/node.env once fetched (gtm-fetch-secrets):
        # never in the user data, and never a file that may not be there yet.
        assert settings.dns_cookie_secret is None and settings.dns_cookie_secret_file is None
        assert "GTM_DATABASE_URL" not in env and "GTM_REPORT_SECRET" not in env


def test_only_the_bootstrap_node_bootstraps(rendered: dict[str, Any]) -> None:
    admin = _cloud_config(rendered["admin_node"])
    plain = _cloud_config(rendered["plain_node"])
    assert ["/usr/local/libexec/gtm/gtm-bootstrap"] in admin["runcmd"]
    assert ["/usr/local/libexec/gtm/gtm-bootstrap"] not in plain["runcmd"]
    logins = _files(rendered["admin_node"])["/etc/gtm/bootstrap/logins"]["content"].splitlines()
    assert sorted(line.split()[0] for line in logins) == sorted(n.replace("-", "_") for n in NODES)
    assert "/etc/gtm/bootstrap/logins" not in _files(rendered["plain_node"])
    # The gzipped copy EC2 gets is the same document, and fits EC2's 16 KiB.
    packed = base64.b64decode(rendered["admin_node_gz"])
    assert len(packed) < 16 * 1024
    assert gzip.decompress(packed).decode() == rendered["admin_node"]


def _install_units(files: dict[str, dict[str, Any]], root: Path) -> list[Path]:
    """The rendered units and scripts in a scratch unit directory, their executables pointed
    at this checkout (verify checks that they exist)."""
    units = root / "units"
    scripts = root / "libexec"
    bin_dir = ROOT / ".venv" / "bin"
    written = []
    for path, entry in files.items():
        content = entry["content"]
        if path.startswith("/usr/local/libexec/"):
            target = scripts / Path(path).name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            target.chmod(0o755)
        elif path.startswith("/etc/systemd/system/"):
            target = units / path.removeprefix("/etc/systemd/system/")
            target.parent.mkdir(parents=True, exist_ok=True)
            for prefix in ("/usr/local/libexec/gtm/", "/usr/local/libexec/regional-lb/"):
                content = content.replace(prefix, f"{scripts}/")
            target.write_text(content.replace("/opt/gtm/bin/", f"{bin_dir}/"))
            if target.parent == units:
                written.append(target)
    return written


@pytest.mark.parametrize("label", ["admin_node", "plain_node", "balancer_eu-west"])
def test_the_rendered_units_verify_with_their_drop_ins(
    rendered: dict[str, Any], label: str, tmp_path: Path
) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    units = _install_units(_files(rendered[label]), tmp_path)
    assert len(units) >= 2
    env = {"SYSTEMD_UNIT_PATH": f"{tmp_path / 'units'}:", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [analyze, "verify", *map(str, units)], capture_output=True, text=True, env=env, check=False
    )
    ours = [line for line in result.stderr.splitlines() if str(tmp_path) in line]
    assert result.returncode == 0 and not ours, result.stderr


@pytest.mark.parametrize("label", ["admin_node", "balancer_eu-west"])
def test_the_rendered_scripts_parse_and_pass_shellcheck(
    rendered: dict[str, Any], label: str, tmp_path: Path
) -> None:
    scripts = [f for p, f in _files(rendered[label]).items() if p.startswith("/usr/local/libexec/")]
    assert scripts
    for entry in scripts:
        path = tmp_path / Path(entry["path"]).name
        path.write_text(entry["content"])
        assert entry["permissions"] == "0755"
        subprocess.run(["bash", "-n", str(path)], check=True)
        checker = shutil.which("shellcheck")
        if checker is not None:
            checked = subprocess.run([checker, str(path)], capture_output=True, text=True)
            assert checked.returncode == 0, checked.stdout


@pytest.mark.parametrize("region", ["eu-west", "us-east", "ap-south"])
def test_the_example_balancers_load_in_regional_lb(rendered: dict[str, Any], region: str) -> None:
    files = _files(rendered[f"balancer_{region}"])
    config = parse_config(yaml.safe_load(files["/etc/regional-lb/config.yaml"]["content"]))
    assert config.region == region and config.listen == "0.0.0.0:8600"
    assert config.gtm_urls == ["http://198.51.100.1", "http://198.51.100.3"]
    aws_env = files["/etc/regional-lb/aws.env"]["content"]
    assert f"secret_report_key='gtm/report-key/{region}'" in aws_env
    assert "REGIONAL_LB_REPORT_SECRET=" not in rendered[f"balancer_{region}"].replace(
        "REGIONAL_LB_REPORT_SECRET='%s'", ""
    )


def test_the_example_membership_is_every_node_of_every_region() -> None:
    """The example's locals, read as text: one membership from all regions' nodes."""
    main = (EXAMPLE / "main.tf").read_text()
    assert "health_members = flatten([for r in sort(keys(local.nodes)) : local.nodes[r]])" in main
    assert main.count("health_members      = local.health_members") == 3
