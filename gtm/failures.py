"""Exceptions on an answering path: counted by type and path, logged at most once per interval.

Input is checked before it is answered, so an exception while answering is a bug; but a bug a
packet can reach is one an attacker can send ten thousand times a second. Logged per packet
with the console renderer's rich traceback (frames and their locals), each cost about 0.3 s of
the event loop and 130-180 KB of log: ten 80-byte packets a second took a node's answers from
417,534 to 9 per 10 s (DESIGN.md rule 9). So each one here is a counted outcome
(``gtm_answer_failures_total{path, error}``, every one of them) and the log says so at most
once per interval and path: the exception's type, where it was raised, its stack as plain text
(no locals; the first of the interval, a sample), and how many more there were since the last
line. The same fields in every log format: JSON lines carry them as keys.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gtm.metrics import ANSWER_FAILURES

log = structlog.get_logger(__name__)

DEFAULT_INTERVAL_S = 10.0
_MAX_STACK = 16_384  # characters: a sample, never a flood of its own (deep recursion, say)


def location(exc: BaseException) -> str:
    """Where ``exc`` was raised: module, line and function of the innermost frame."""
    tb = exc.__traceback__
    if tb is None:
        return "unknown"
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    module = frame.f_globals.get("__name__", frame.f_code.co_filename)
    return f"{module}:{tb.tb_lineno} in {frame.f_code.co_name}"


def stack_text(exc: BaseException) -> str:
    """The exception's traceback as plain text (no locals), cut to a bounded length."""
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= _MAX_STACK else text[: _MAX_STACK - 20] + "\n... (cut)\n"


@dataclass(slots=True)
class _Window:
    next_at: float  # the next line may be logged from here on
    suppressed: int = 0  # failures since the last line, not logged


class Failures:
    """One process's answering-path failures: :meth:`record` each one.

    ``interval_s``: at most one log line per path per interval. ``clock``: monotonic seconds
    (replaceable in tests)."""

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._windows: dict[str, _Window] = {}  # by path: a handful, named in the code
        self.logged = 0  # lines written, for tests and the curious

    def record(self, path: str, exc: BaseException, **context: object) -> None:
        """Count ``exc`` raised on ``path`` (``"dns.udp"``, ``"front.decide"``), and log it
        unless a line for this path was written less than an interval ago. ``context``:
        fields for the line (the peer, say): the first failure's of the interval."""
        error = type(exc).__name__
        ANSWER_FAILURES.labels(path, error).inc()
        now = self.clock()
        window = self._windows.get(path)
        if window is not None and now < window.next_at:
            window.suppressed += 1
            return
        suppressed = window.suppressed if window is not None else 0
        self._windows[path] = _Window(now + self.interval_s)
        self.logged += 1
        log.error(
            "answer.failed",
            path=path,
            error_type=error,
            error=str(exc)[:200],
            location=location(exc),
            suppressed=suppressed,
            interval_s=self.interval_s,
            exception=stack_text(exc),
            **context,
        )
