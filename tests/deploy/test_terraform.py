"""The Terraform code, read as code: formatted, every module documented and typed, everything
that can be encrypted encrypted, no secret ever in Terraform's state, and every checkov
exception justified. (checkov itself runs in `make check-terraform`.)"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hcl2
import pytest

from tests.conftest import ROOT
from tests.deploy.terraform_run import terraform

TERRAFORM = ROOT / "terraform"
MODULES = sorted(p for p in (TERRAFORM / "modules").iterdir() if p.is_dir())
EXAMPLES = sorted(p for p in (TERRAFORM / "examples").iterdir() if p.is_dir())
ROOTS = MODULES + EXAMPLES


def _unquote(value: Any) -> Any:
    """python-hcl2 keeps string literals' quotes; labels and values compare without them."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


@functools.cache
def _parsed(path: Path) -> dict[str, Any]:
    with path.open() as handle:
        parsed: dict[str, Any] = hcl2.load(handle)
    return parsed


def _blocks(module: Path, kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, body) of every ``kind`` block (variable, output) in the module's files."""
    for path in sorted(module.glob("*.tf")):
        for block in _parsed(path).get(kind, []):
            for label, body in block.items():
                yield _unquote(label), body


def _resources(module: Path) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path in sorted(module.glob("*.tf")):
        for block in _parsed(path).get("resource", []):
            for rtype, named in block.items():
                for name, body in named.items():
                    yield _unquote(rtype), _unquote(name), body


def _all_resources() -> list[tuple[Path, str, str, dict[str, Any]]]:
    return [(m, t, n, b) for m in ROOTS for t, n, b in _resources(m)]


def _nested(body: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = body.get(key, [])
    return value if isinstance(value, list) else [value]


def test_terraform_is_formatted() -> None:
    result = terraform(TERRAFORM, "fmt", "-check", "-recursive", "-diff", "-no-color", check=False)
    assert result.returncode == 0, f"terraform fmt -recursive would change:\n{result.stdout}"


@pytest.mark.parametrize("module", ROOTS, ids=lambda p: p.relative_to(TERRAFORM).as_posix())
def test_every_module_has_its_files(module: Path) -> None:
    for name in ("variables.tf", "outputs.tf", "README.md", "versions.tf", "main.tf"):
        assert (module / name).is_file(), f"{module.relative_to(ROOT)} has no {name}"
    versions = (module / "versions.tf").read_text()
    assert re.search(r'required_version\s*=\s*">= 1\.\d+"', versions)


@pytest.mark.parametrize("module", ROOTS, ids=lambda p: p.relative_to(TERRAFORM).as_posix())
def test_every_variable_is_typed_and_described_and_every_output_described(module: Path) -> None:
    variables = list(_blocks(module, "variable"))
    outputs = list(_blocks(module, "output"))
    assert variables and outputs
    for name, body in variables:
        assert "type" in body, f"{module.name}: variable {name} has no type"
        assert len(_unquote(body.get("description", ""))) > 10, f"variable {name}: no description"
    for name, body in outputs:
        assert len(_unquote(body.get("description", ""))) > 10, f"output {name}: no description"
    # The README names every input and output (the module's interface, in words).
    readme = (module / "README.md").read_text()
    missing = [n for n, _ in variables + outputs if f"`{n}`" not in readme]
    assert not missing, f"{module.name}/README.md does not describe {missing}"


def test_everything_that_can_be_encrypted_is_encrypted_with_a_customer_key() -> None:
    resources = _all_resources()
    seen: set[str] = set()
    buckets: dict[Path, list[str]] = {}
    bucket_encryption: dict[Path, list[dict[str, Any]]] = {}
    for module, rtype, name, body in resources:
        where = f"{module.name}: {rtype}.{name}"
        seen.add(rtype)
        if rtype == "aws_db_instance":
            assert body["storage_encrypted"] is True, where
            assert "kms_key_id" in body and "performance_insights_kms_key_id" in body, where
        elif rtype == "aws_instance":
            (root_volume,) = _nested(body, "root_block_device")
            assert root_volume["encrypted"] is True and "kms_key_id" in root_volume, where
            assert not _nested(body, "ebs_block_device"), f"{where}: volumes only as root"
        elif rtype == "aws_launch_template":
            for mapping in _nested(body, "block_device_mappings"):
                for ebs in _nested(mapping, "ebs"):
                    assert ebs["encrypted"] is True and "kms_key_id" in ebs, where
        elif rtype == "aws_ebs_volume":
            assert body["encrypted"] is True and "kms_key_id" in body, where
        elif rtype == "aws_secretsmanager_secret":
            assert "kms_key_id" in body, where
            replicas = [d['"replica"'] for d in _nested(body, "dynamic") if '"replica"' in d]
            for replica in replicas:
                for content in _nested(replica, "content"):
                    assert "kms_key_id" in content, f"{where}: a replica without its KMS key"
        elif rtype == "aws_cloudwatch_log_group":
            assert "kms_key_id" in body, where
        elif rtype == "aws_kms_key":
            assert body["enable_key_rotation"] is True, where
        elif rtype == "aws_s3_bucket":
            buckets.setdefault(module, []).append(name)
        elif rtype == "aws_s3_bucket_server_side_encryption_configuration":
            bucket_encryption.setdefault(module, []).append(body)
    for module, names in buckets.items():
        configs = bucket_encryption.get(module, [])
        assert len(configs) == len(names), f"{module.name}: a bucket without encryption"
        for config in configs:
            (rule,) = _nested(config, "rule")
            (default,) = _nested(rule, "apply_server_side_encryption_by_default")
            assert _unquote(default["sse_algorithm"]) == "aws:kms"
            assert "kms_master_key_id" in default
    # The checks above looked at something: the fleet has each kind of resource.
    assert {"aws_db_instance", "aws_instance", "aws_launch_template", "aws_s3_bucket"} <= seen
    assert {"aws_secretsmanager_secret", "aws_cloudwatch_log_group", "aws_kms_key"} <= seen


def test_no_secret_value_ever_passes_through_terraform() -> None:
    """Secrets are made on the bootstrap node and in RDS; Terraform makes only their
    containers, so its state never holds a value."""
    for module, rtype, name, body in _all_resources():
        where = f"{module.name}: {rtype}.{name}"
        assert rtype not in (
            "aws_secretsmanager_secret_version",
            "random_password",
            "random_string",
            "tls_private_key",
            "aws_iam_access_key",
        ), f"{where}: a secret value in Terraform's state"
        if rtype == "aws_db_instance":
            assert "password" not in body and body["manage_master_user_password"] is True, where
    for tfvars in TERRAFORM.rglob("*.tfvars*"):
        text = tfvars.read_text()
        assert not re.search(r"(password|secret|token)\w*\s*=", text, re.I), tfvars


def test_the_database_is_multi_az_private_and_refuses_plain_connections() -> None:
    (database,) = [b for _, t, _, b in _all_resources() if t == "aws_db_instance"]
    assert database["multi_az"] is True and database["publicly_accessible"] is False
    assert database["deletion_protection"] == "${var.deletion_protection}"
    (group,) = [b for _, t, _, b in _all_resources() if t == "aws_db_parameter_group"]
    parameters = {_unquote(p["name"]): _unquote(p["value"]) for p in _nested(group, "parameter")}
    assert parameters["rds.force_ssl"] == "1"
    assert parameters["ssl_min_protocol_version"] == "TLSv1.2"


def test_the_logins_are_the_roles_of_migration_0007() -> None:
    migration = (ROOT / "migrations/versions/0007_least_privilege.py").read_text()
    roles = re.search(r"ROLES = \(([^)]*)\)", migration)
    assert roles is not None
    declared = set(re.findall(r'"(\w+)"', roles.group(1)))
    variables = (TERRAFORM / "modules/gtm-database/variables.tf").read_text()
    allowed = re.search(r'contains\(\[("gtm_\w+", "gtm_\w+", "gtm_\w+")\], l\.role\)', variables)
    assert allowed is not None
    assert (
        set(re.findall(r'"(\w+)"', allowed.group(1)))
        == declared
        == {
            "gtm_node",
            "gtm_admin",
            "gtm_reader",
        }
    )


def test_every_checkov_exception_says_why() -> None:
    skips = 0
    for path in sorted(TERRAFORM.rglob("*.tf")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "checkov:skip" not in line:
                continue
            skips += 1
            reason = re.search(r"#checkov:skip=CKV2?_AWS_\d+:(.{20,})$", line.strip())
            assert reason, f"{path.relative_to(ROOT)}:{number}: a skip without a reason"
    assert skips > 0


def test_every_node_may_read_each_secret_its_scripts_fetch() -> None:
    """The secrets a node's scripts read (gtm-node-config's ``secrets``) are each in its
    ReadOwnSecrets statement, but for the first admin token, which only the bootstrap node
    reads (its own policy covers every fleet secret). A secret missing there was a node that
    waited for it, then never started."""
    region = (TERRAFORM / "modules" / "gtm-region" / "main.tf").read_text()
    given = re.search(r"\n  secrets = \{\n(.*?)\n  \}", region, re.S)
    assert given is not None
    fleet = re.findall(r'var\.fleet_secrets\.names\["([^"]+)"\]', given.group(1))
    assert "dns-cookie-secret" in fleet and "report-secret" in fleet
    statement = re.search(r'sid\s+= "ReadOwnSecrets"(.*?)\n  \}', region, re.S)
    assert statement is not None
    readable = set(re.findall(r'local\.here\["([^"]+)"\]', statement.group(1)))
    assert "local.here[each.value.login]" in statement.group(1)  # its own database login
    assert set(fleet) - {"admin-bootstrap-token"} <= readable, set(fleet) - readable
