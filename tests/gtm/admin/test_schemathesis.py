"""Schemathesis against the admin API's own OpenAPI, with a token that holds every role: no
5xx for any input it generates, and every response matches the schema the API publishes."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gtm.admin.permissions import Role
from tests.gtm.admin.conftest import AdminFactory


async def test_no_server_errors_and_responses_match_the_schema(
    start_admin: AdminFactory,
) -> None:
    st = shutil.which("st") or str(Path(sys.executable).with_name("st"))
    if not await asyncio.to_thread(Path(st).exists):
        pytest.fail("schemathesis is a dev dependency: pip install -e '.[dev]'")
    async with start_admin() as admin:
        everyone = await admin.token("fuzzer", *Role)
        args = [
            st, "run", f"{admin.url}/openapi.json",
            "--header", f"Authorization: Bearer {everyone}",
            "--checks", "not_a_server_error,response_schema_conformance",
            "--max-examples", "25",
            "--seed", "1",
            "--workers", "1",
            "--phases", "examples,coverage,fuzzing",
        ]  # fmt: skip
        out = await asyncio.to_thread(
            subprocess.run, args, capture_output=True, text=True, timeout=600
        )
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
