"""axe-core, the accessibility checker the console's walkthrough runs in each page: installed
from the npm registry into pytest's cache the first time (``npm install axe-core@4``), then
reused. Without npm or the network the tests that need it skip, saying why, or fail when CI
requires the tools (``GTM_TEST_REQUIRE_TOOLS=1``)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path
from tempfile import gettempdir

import pytest

# Major version 4: the rules and impact levels the walkthrough's threshold is written against.
PACKAGE = "axe-core@4"
IMPACTS = ("serious", "critical")

# In the page: the violations of serious or critical impact, each with a few of its elements.
RUN = """async (impacts) => {
  const result = await axe.run(document, {resultTypes: ["violations"]});
  return result.violations.filter(v => impacts.includes(v.impact)).map(v => ({
    id: v.id, impact: v.impact, help: v.help,
    nodes: v.nodes.slice(0, 4).map(n => n.target.join(" ") + ": " + n.failureSummary),
  }));
}"""


def _unavailable(reason: str) -> None:
    if os.environ.get("GTM_TEST_REQUIRE_TOOLS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def axe_script(pytestconfig: pytest.Config) -> Path:
    """The path of ``axe.min.js``."""
    cache = pytestconfig.cache
    # pytest's cache (.pytest_cache/d/axe-core); with the cache plugin off, the temp directory.
    prefix = cache.mkdir("axe-core") if cache is not None else Path(gettempdir()) / "gtm-axe-core"
    script = prefix / "node_modules" / "axe-core" / "axe.min.js"
    prefix.mkdir(parents=True, exist_ok=True)
    # pytest-xdist's workers share the cache: one installs while the others wait on the lock,
    # then find the script (two npm installs into one prefix would trip over each other).
    with (prefix / "install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _installed(prefix, script)


def _installed(prefix: Path, script: Path) -> Path:
    if script.exists():
        return script
    npm = shutil.which("npm")
    if npm is None:
        _unavailable("npm is not installed (Debian: npm): axe-core comes from the npm registry")
    try:
        done = subprocess.run(
            [npm or "npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
             "--no-save", PACKAGE],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        _unavailable(f"npm install {PACKAGE} did not finish in 300 s (no network?)")
    if done.returncode != 0 or not script.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        _unavailable(f"npm install {PACKAGE} failed (no network?): {' / '.join(tail)}")
    return script


__all__ = ["IMPACTS", "PACKAGE", "RUN", "axe_script"]
