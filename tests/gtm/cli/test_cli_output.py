"""How the CLI writes times: a date people read, in UTC, with how long ago or until."""

from __future__ import annotations

from gtm.cli.common import human_time

T = 1795790000.0  # 2026-11-27 14:33:20 UTC


def test_human_time_says_when_and_how_long_ago_or_until() -> None:
    assert human_time(T, now=T) == "2026-11-27 14:33:20 UTC (now)"
    assert human_time(T, now=T + 42) == "2026-11-27 14:33:20 UTC (42 s ago)"
    assert human_time(T, now=T + 3 * 60 + 5) == "2026-11-27 14:33:20 UTC (3 min ago)"
    assert human_time(T, now=T + 5 * 3600) == "2026-11-27 14:33:20 UTC (5 h ago)"
    assert human_time(T, now=T + 9 * 86400) == "2026-11-27 14:33:20 UTC (9 d ago)"
    assert human_time(T + 600, now=T) == "2026-11-27 14:43:20 UTC (in 10 min)"
