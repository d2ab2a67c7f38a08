"""The OCI image (Dockerfile) without a container engine: its structure is checked here, and its
build stage's steps (a wheel of the project, installed into a fresh virtualenv) are run for
real. No Docker daemon is needed or used."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = pending + line
        pending = ""
        keyword, _, args = whole.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def stages(items: list[Instruction]) -> list[list[Instruction]]:
    out: list[list[Instruction]] = []
    for item in items:
        if item.keyword == "FROM":
            out.append([])
        if out:
            out[-1].append(item)
    return out


def test_the_image_is_multi_stage_and_runs_as_a_numeric_non_root_user() -> None:
    built = stages(instructions(DOCKERFILE.read_text()))
    assert len(built) >= 2, "a build stage and a runtime stage"
    names = [s[0].args.split()[-1] for s in built if " AS " in s[0].args.upper()]
    assert names[:2] == ["build", "runtime"]
    final = built[-1]
    users = [i.args for i in final if i.keyword == "USER"]
    assert users, "the runtime stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, f"USER {users[-1]} is not a numeric non-root uid"
    # Nothing built (compilers, wheels, sources) reaches the runtime stage except the venv.
    copies = [i.args for i in final if i.keyword == "COPY"]
    assert copies == ["--from=build /opt/gtm /opt/gtm"]


def test_the_runtime_writes_only_to_its_volume_and_takes_secrets_from_outside() -> None:
    final = stages(instructions(DOCKERFILE.read_text()))[-1]
    env = " ".join(i.args for i in final if i.keyword == "ENV")
    volumes = " ".join(i.args for i in final if i.keyword == "VOLUME")
    assert '"/var/lib/gtm"' in volumes
    # Everything GTM writes (spool, chain keys, checkpoint sink, the SQLite default) is under
    # the volume, so the root filesystem can be mounted read-only.
    for setting in ("GTM_SPOOL_DIR", "GTM_AUDIT_CHECKPOINT_DIR", "GTM_DATABASE_URL"):
        value = re.search(rf"{setting}=(\S+)", env)
        assert value is not None and "/var/lib/gtm/" in value.group(1), setting
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    # GeoIP and keys are mounted files, never baked in.
    assert re.search(r"GTM_GEOIP_PATH=/usr/share/GeoIP/\S+\.mmdb", env)
    for item in instructions(DOCKERFILE.read_text()):
        if item.keyword in ("ENV", "ARG", "LABEL"):
            assert not re.search(r"(SECRET|TOKEN|PASSWORD)\w*=", item.args, re.I), item
    entry = [i.args for i in final if i.keyword == "ENTRYPOINT"]
    assert entry == ['["gtm"]'], "exec form, so signals reach gtm (graceful audit flush)"


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def included(path: str) -> bool:
        keep = True
        for pattern in ignore:
            negate = pattern.startswith("!")
            bare = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, bare) or path.startswith(bare + "/"):
                keep = negate
        return keep

    copied = 0
    for item in instructions(DOCKERFILE.read_text()):
        if item.keyword != "COPY" or item.args.startswith("--from"):
            continue
        *sources, _destination = item.args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"line {item.line}: {source} does not exist"
            assert included(source), f"line {item.line}: .dockerignore leaves {source} out"
            copied += 1
    assert copied >= 5


def test_the_build_steps_make_a_wheel_that_installs_and_runs(tmp_path: Path) -> None:
    """The image's build stage in a fresh virtualenv: `pip wheel --no-deps .`, then the wheel
    (with its dependencies from the package index) into the venv, then both commands."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", wheels, ROOT],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("gtm-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        scripts = archive.read(entry_points).decode()
    assert "gtm = gtm.cli.main:app" in scripts and "regional-lb = regional_lb.cli:app" in scripts
    # The files gtm finds beside its code at run time travel in the wheel.
    for data in ("gtm/migrations/env.py", "gtm/policies/schema.json", "gtm/examples/demo.yaml"):
        assert data in names, f"{data} is not in the wheel"

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    subprocess.run(
        [bin_dir / "python", "-m", "pip", "install", "--quiet", wheel], check=True, cwd=tmp_path
    )
    for command in ("gtm", "regional-lb"):
        shown = subprocess.run(
            [bin_dir / command, "--help"], check=True, capture_output=True, text=True, cwd=tmp_path
        )
        assert "Usage" in shown.stdout
    # The installed package, not the checkout, answers (cwd is outside the repository).
    where = subprocess.run(
        [bin_dir / "python", "-c", "import gtm; print(gtm.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert where.stdout.startswith(str(env_dir))


def test_the_base_image_is_one_argument() -> None:
    """Both stages use the same base (ARG PYTHON_IMAGE), so pinning it by digest pins both."""
    froms = [i.args.split()[0] for i in instructions(DOCKERFILE.read_text()) if i.keyword == "FROM"]
    assert froms and set(froms) == {"${PYTHON_IMAGE}"}
