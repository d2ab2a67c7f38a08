"""Signed capacity reports pushed to GTM during a benchmark, as the regional balancers push them.

Each accepted report is a new snapshot. Reports name the demo topology's regions in turn, with
a utilisation that wanders below the high watermark as a healthy fleet's does, so the value
changes with every report (a benchmark that sent the same figure each time would flatter any
cache keyed on it).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

REPORT_SECRET = b"bench-report-secret"
DEMO_REGIONS = ("us-east", "us-west", "eu-west", "eu-central", "ap-south", "ap-northeast")


class ReportPusher(threading.Thread):
    """``rate`` reports a second to each of ``ports`` (``POST /v1/capacity`` on GTM's HTTP
    front), regions round robin, utilisation uniform in [0.2, 0.6)."""

    def __init__(self, ports: list[int], rate: float, seed: int = 5) -> None:
        super().__init__(daemon=True)
        self.ports = ports
        self.rate = rate
        self.stopping = threading.Event()
        self.accepted = 0
        self._rng = random.Random(seed)

    def run(self) -> None:
        import httpx

        from regional_lb.capacity_report import (
            SIGNATURE_HEADER,
            CapacityReport,
            region_secret,
            sign,
        )

        seq = 0
        with httpx.Client(trust_env=False, timeout=5) as client:
            while not self.stopping.wait(1 / self.rate):
                seq += 1
                body = CapacityReport(
                    region=DEMO_REGIONS[seq % len(DEMO_REGIONS)],
                    seq=seq,
                    ts=time.time(),
                    instances_healthy=2,
                    instances_total=2,
                    capacity=10.0,
                    outstanding=3.0,
                    utilisation=round(self._rng.uniform(0.2, 0.6), 3),
                    can_take_work=True,
                ).model_dump_json()
                region = DEMO_REGIONS[seq % len(DEMO_REGIONS)]
                key = region_secret(REPORT_SECRET, region)
                headers = {SIGNATURE_HEADER: sign(body.encode(), key)}
                for port in self.ports:
                    with contextlib.suppress(httpx.HTTPError):
                        r = client.post(
                            f"http://127.0.0.1:{port}/v1/capacity", content=body, headers=headers
                        )
                        self.accepted += r.status_code == 204

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)
