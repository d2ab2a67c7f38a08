"""A PostgreSQL database for one test session.

With ``GTM_TEST_POSTGRES_URL`` set (CI sets it), a fresh database is created on that server and
dropped afterwards, so parallel runs do not meet. Without it, a throwaway cluster is started
with ``pg_ctl`` when that exists. Otherwise the tests skip, saying why, unless
``GTM_TEST_REQUIRE_POSTGRES=1`` makes that a failure.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NoReturn

import psycopg
import pytest
from sqlalchemy.engine import make_url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _database_on(server_url: str) -> Iterator[str]:
    name = f"gtm_test_{secrets.token_hex(4)}"
    admin = make_url(server_url).set(drivername="postgresql")
    conninfo = admin.render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def _throwaway_cluster() -> Iterator[str]:
    pg_ctl = shutil.which("pg_ctl")
    initdb = shutil.which("initdb") or (str(Path(pg_ctl).with_name("initdb")) if pg_ctl else None)
    if not pg_ctl or not initdb or not Path(initdb).exists():
        raise FileNotFoundError("pg_ctl/initdb not found")
    # PostgreSQL refuses to run as root; run the cluster as the postgres user then.
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    workdir = tempfile.mkdtemp(prefix="gtm-pg-")
    if prefix:
        shutil.chown(workdir, "postgres")
    data, port = os.path.join(workdir, "data"), _free_port()
    subprocess.run(
        [*prefix, initdb, "-D", data, "-U", "postgres", "--auth=trust"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            *prefix,
            pg_ctl,
            "-D",
            data,
            "-w",
            "-l",
            os.path.join(workdir, "log"),
            "-o",
            f"-p {port} -k {workdir} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*prefix, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(workdir, ignore_errors=True)


def _unavailable(exc: Exception, hint: str) -> NoReturn:
    reason = f"no PostgreSQL for tests ({hint}): {exc}"
    if os.environ.get("GTM_TEST_REQUIRE_POSTGRES") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@contextmanager
def fresh_cluster(databases: int) -> Iterator[list[str]]:
    """URLs of ``databases`` new databases on a throwaway cluster of their own, for what is the
    cluster's rather than a database's (roles): the shared server has them from earlier runs."""
    with ExitStack() as stack:
        try:
            cluster = stack.enter_context(_throwaway_cluster())
            urls = [stack.enter_context(_database_on(cluster)) for _ in range(databases)]
        except (OSError, psycopg.Error, subprocess.CalledProcessError) as exc:
            _unavailable(exc, "this test starts its own cluster: pg_ctl and initdb")
        yield urls


@contextmanager
def postgres_database() -> Iterator[str]:
    server = os.environ.get("GTM_TEST_POSTGRES_URL")
    try:
        if server:
            with _database_on(server) as url:
                yield url
            return
        with _throwaway_cluster() as cluster, _database_on(cluster) as url:
            yield url
    except (OSError, psycopg.Error, subprocess.CalledProcessError) as exc:
        _unavailable(exc, "set GTM_TEST_POSTGRES_URL")
