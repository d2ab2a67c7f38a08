"""Answering-path failures (gtm.failures): every one counted, one log line per path and interval
with the exception's type, where it was raised and a stack, in either log format."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import structlog
from prometheus_client import REGISTRY

from gtm import logs
from gtm.failures import Failures


def _raise(n: int) -> None:
    if n:
        _raise(n - 1)
    raise KeyError("no such shape")


def _caught() -> KeyError:
    try:
        _raise(3)
    except KeyError as exc:
        return exc
    raise AssertionError("unreachable")


def _count(path: str) -> float:
    return (
        REGISTRY.get_sample_value("gtm_answer_failures_total", {"path": path, "error": "KeyError"})
        or 0.0
    )


@pytest.fixture
def configured() -> Iterator[None]:
    yield
    structlog.reset_defaults()  # the tests below configure it as the CLI does


def _flood(failures: Failures, clock: list[float], path: str) -> None:
    """250 failures in the first interval, 50 in the second."""
    for _ in range(250):
        failures.record(path, _caught(), peer="192.0.2.1")
    clock[0] += 10.0
    for _ in range(50):
        failures.record(path, _caught(), peer="192.0.2.1")


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_one_line_per_interval_every_failure_counted(
    fmt: str, capsys: pytest.CaptureFixture[str], configured: None
) -> None:
    logs.configure(fmt)
    clock = [100.0]
    failures = Failures(interval_s=10.0, clock=lambda: clock[0])
    path = f"test.{fmt}"
    before = _count(path)
    _flood(failures, clock, path)
    assert _count(path) - before == 300  # every one counted
    assert failures.logged == 2  # one line per interval
    err = capsys.readouterr().err
    if fmt == "json":
        lines = [json.loads(line) for line in err.splitlines()]
        assert [line["event"] for line in lines] == ["answer.failed"] * 2
        first, second = lines
        assert first["suppressed"] == 0 and second["suppressed"] == 249
        for line in lines:
            assert line["path"] == path and line["error_type"] == "KeyError"
            assert line["location"] == f"{__name__}:20 in _raise"
            assert line["exception"].startswith("Traceback (most recent call last):")
            assert "KeyError: 'no such shape'" in line["exception"]
            assert line["peer"] == "192.0.2.1"
    else:
        assert err.count("answer.failed") == 2
        assert err.count("Traceback (most recent call last):") == 2  # the sampled stacks
        assert "error_type=KeyError" in err and f"location='{__name__}:20 in _raise'" in err
        assert "suppressed=249" in err


def test_json_logs_carry_an_exceptions_type_and_stack(
    capsys: pytest.CaptureFixture[str], configured: None
) -> None:
    """``log.exception`` anywhere, in JSON: before, the line kept only ``"exc_info": true``."""
    logs.configure("json")
    try:
        _raise(1)
    except KeyError:
        structlog.get_logger("test").exception("something.failed")
    (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
    (exc,) = line["exception"]
    assert exc["exc_type"] == "KeyError" and exc["exc_value"] == "'no such shape'"
    assert [f["name"] for f in exc["frames"]][-2:] == ["_raise", "_raise"]
    assert all("locals" not in f for f in exc["frames"])  # never the frames' locals
