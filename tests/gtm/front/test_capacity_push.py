"""Regional balancers push signed capacity reports to the front's /v1/capacity."""

from __future__ import annotations

import time

import httpx

from gtm.decision.snapshot import HealthState
from regional_lb.capacity_report import SIGNATURE_HEADER, CapacityReport, region_secret, sign

from .conftest import FrontFactory

SECRET = b"push-secret"
KEY = region_secret(SECRET, "eu-central")


def report(
    seq: int, utilisation: float, *, ts: float | None = None, can_take_work: bool = True
) -> bytes:
    return (
        CapacityReport(
            region="eu-central",
            seq=seq,
            ts=time.time() if ts is None else ts,
            instances_healthy=2,
            instances_total=2,
            capacity=10.0,
            outstanding=10 * utilisation,
            utilisation=utilisation,
            can_take_work=can_take_work,
        )
        .model_dump_json()
        .encode()
    )


async def test_pushed_reports_are_verified_and_applied(start_front: FrontFactory) -> None:
    async with start_front() as front, httpx.AsyncClient(base_url=front.url) as client:
        front.runtime.intake.secret = SECRET
        url = "/v1/capacity"

        async def push(body: bytes, key: bytes = KEY) -> int:
            response = await client.post(
                url, content=body, headers={SIGNATURE_HEADER: sign(body, key), "Host": "127.0.0.1"}
            )
            return response.status_code

        first = report(1, 0.97)
        assert await push(first) == 204
        cap = front.runtime.store.current.capacity["eu-central"]
        assert cap.utilisation == 0.97 and cap.spilling
        assert await push(first) == 409  # the same report again: a replay
        assert await push(report(2, 0.1), key=b"forged") == 401
        assert await push(report(3, 0.1, ts=time.time() - 60)) == 409  # stale
        assert await push(b"{not json") == 400
        assert front.runtime.store.current.capacity["eu-central"].utilisation == 0.97

        # The balancer says it cannot take work: answers move at once, before any probe.
        assert await push(report(4, 0.5, can_take_work=False)) == 204
        snapshot = front.runtime.store.current
        assert not snapshot.capacity["eu-central"].can_take_work
        assert (
            snapshot.health.get("eu-central") is None
            or snapshot.health["eu-central"].state is not HealthState.DOWN
        )
        redirect = await client.post(
            "/v1/chat/completions",
            content=b"{}",
            headers={"Host": "chat.gtm.example", "X-Forwarded-For": "198.51.100.7"},
        )
        assert redirect.status_code == 307 and redirect.headers["x-gtm-region"] == "eu-west"

        huge = await client.post(url, content=b"x" * 70_000, headers={"Host": "127.0.0.1"})
        assert huge.status_code == 413
        on_service = await client.post(
            url, content=report(5, 0.2), headers={"Host": "chat.gtm.example"}
        )
        # On a service host the path belongs to the service: redirected like any request.
        assert on_service.status_code == 307


async def test_reports_and_metrics_can_be_kept_to_allow_listed_networks(
    start_front: FrontFactory,
) -> None:
    """Before: /v1/capacity and /metrics answered any peer on a non-service Host."""
    async with start_front(ops_allow=("10.0.0.0/8",)) as front:
        front.runtime.intake.secret = SECRET
        async with httpx.AsyncClient(base_url=front.url) as client:
            host = {"Host": "127.0.0.1"}
            body = report(1, 0.99)
            pushed = await client.post(
                "/v1/capacity", content=body, headers={**host, SIGNATURE_HEADER: sign(body, KEY)}
            )
            assert pushed.status_code == 403
            assert "eu-central" not in front.runtime.store.current.capacity
            assert (await client.get("/metrics", headers=host)).status_code == 403
            # A forwarded header naming an allowed address changes nothing.
            spoofed = await client.get("/metrics", headers={**host, "X-Forwarded-For": "10.1.2.3"})
            assert spoofed.status_code == 403
            assert (await client.get("/livez", headers=host)).status_code == 200
    async with (
        start_front(ops_allow=("127.0.0.0/8",)) as front,
        httpx.AsyncClient(base_url=front.url) as client,
    ):
        assert (await client.get("/metrics", headers={"Host": "127.0.0.1"})).status_code == 200
