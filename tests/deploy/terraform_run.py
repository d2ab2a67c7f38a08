"""Running the terraform binary from tests: offline, in a scratch directory, on modules with no
provider (the pure modules render topology and user data), so nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest


def terraform_binary() -> str:
    found = shutil.which("terraform")
    if found is None:
        pytest.skip("terraform is not installed (not in Debian; see docs/runbook.md)")
    return found


def _environment(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TF_IN_AUTOMATION="1",
        TF_INPUT="0",
        CHECKPOINT_DISABLE="1",  # no version check against the vendor's service
        TF_DATA_DIR=str(workdir / ".terraform"),
    )
    return env


def terraform(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [terraform_binary(), *args],
        cwd=workdir,
        env=_environment(workdir),
        capture_output=True,
        text=True,
        check=check,
    )


def apply_outputs(workdir: Path, main_tf: str) -> dict[str, Any]:
    """Write ``main.tf`` into ``workdir``, init (local modules only), apply, return the
    outputs' values. The root must call only modules without resources."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "main.tf").write_text(main_tf)
    terraform(workdir, "init", "-input=false", "-no-color", "-backend=false")
    applied = terraform(workdir, "apply", "-auto-approve", "-input=false", "-no-color", check=False)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    shown = terraform(workdir, "output", "-json", "-no-color")
    return {name: value["value"] for name, value in json.loads(shown.stdout).items()}


def plan_errors(workdir: Path, main_tf: str) -> str:
    """The errors terraform reports when planning ``main_tf`` (empty when it plans), with its
    line wrapping undone."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "main.tf").write_text(main_tf)
    terraform(workdir, "init", "-input=false", "-no-color", "-backend=false")
    planned = terraform(workdir, "plan", "-input=false", "-no-color", check=False)
    return "" if planned.returncode == 0 else " ".join((planned.stdout + planned.stderr).split())
