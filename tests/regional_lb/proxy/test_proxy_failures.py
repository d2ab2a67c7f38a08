"""The balancer on loopback when things go wrong: disconnects, instance death, stalls,
ejection, drain (API and SIGTERM), and a mix of all of them. Work must always be released."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from tests.regional_lb.conftest import (
    SimProcess,
    balancer,
    balancer_config,
    chat,
    eventually,
    idle,
    sim,
)

CHAT = "/v1/chat/completions"


async def test_client_disconnect_mid_stream_releases_and_cancels_upstream() -> None:
    async with (
        sim(speedup=5.0) as (u1, engine),
        balancer(balancer_config([u1])) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        async with c.stream("POST", CHAT, json=chat(max_tokens=2000, stream=True)) as s:
            seen = 0
            async for line in s.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break
            assert pool.instances[0].in_flight == 1
            assert pool.instances[0].outstanding > 0
        # Leaving the block closed the connection: the work and the upstream sequence go.
        await eventually(lambda: idle(pool))
        await eventually(lambda: not engine.running and not engine.waiting)
        assert engine.generation_total < 2000


async def test_client_disconnect_during_unary_request_cancels_upstream() -> None:
    async with (
        sim(speedup=5.0) as (u1, engine),
        balancer(balancer_config([u1])) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=10) as c,
    ):
        task = asyncio.create_task(c.post(CHAT, json=chat(max_tokens=2000)))
        await eventually(lambda: bool(engine.running))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await eventually(lambda: idle(pool))
        await eventually(lambda: not engine.running)
        assert engine.generation_total < 2000


async def test_instance_death_mid_stream_gives_clean_error_and_releases(
    sim_process: SimProcess,
) -> None:
    dead_url, proc = sim_process("--gpu", "A100", "--models", "m1", "--speedup", "5")
    async with sim() as (alive_url, _):
        cfg = balancer_config(
            [dead_url, alive_url], health={"probe_interval_s": 30.0, "consecutive_failures": 1}
        )
        # Route the stream to the instance that will die: the other one is draining.
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=10) as c:
            await c.post("/admin/drain/i1")
            lines: list[str] = []
            async with c.stream("POST", CHAT, json=chat(max_tokens=5000, stream=True)) as s:
                assert s.headers["x-regional-instance"] == "i0"
                async for line in s.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        if len(lines) == 5:
                            proc.kill()
            last = json.loads(lines[-1][len("data: ") :])
            assert "error" in last and last["error"]["code"] == "upstream_error"
            assert "data: [DONE]" not in lines
            await eventually(lambda: idle(pool))
            dead = pool.by_id("i0")
            assert dead.ejected(pool.clock())  # one failure is the threshold here
            await c.delete("/admin/drain/i1")
            r = await c.post(CHAT, json=chat())
            assert r.status_code == 200 and r.headers["x-regional-instance"] == "i1"


async def test_drain_lets_streams_finish_and_stops_new_work() -> None:
    async with (
        sim(speedup=10.0) as (u1, _),
        sim(speedup=10.0) as (u2, _),
        balancer(balancer_config([u1, u2])) as (url, pool),
        httpx.AsyncClient(base_url=url, timeout=20) as c,
    ):
        lines: list[str] = []
        async with c.stream("POST", CHAT, json=chat(max_tokens=300, stream=True)) as s:
            inst = s.headers["x-regional-instance"]
            other = "i1" if inst == "i0" else "i0"
            async for line in s.aiter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    if len(lines) == 3:
                        r = await c.post(f"/admin/drain/{inst}")
                        assert r.json()["in_flight"] == 1
                        # New work goes elsewhere while the stream keeps flowing.
                        r = await c.post(CHAT, json=chat(max_tokens=3))
                        assert r.headers["x-regional-instance"] == other
        assert lines[-1] == "data: [DONE]" and len(lines) == 302
        await c.post("/admin/drain")  # the whole region
        r = await c.post(CHAT, json=chat())
        assert r.status_code == 503 and r.headers["retry-after"]
        r = await c.get("/gtm/capacity")
        assert r.status_code == 503 and r.json()["draining"] is True
        await eventually(lambda: idle(pool))


async def test_outlier_ejection_after_consecutive_5xx() -> None:
    async with sim() as (u1, bad), sim() as (u2, _):
        # No model probe: it would consume the injected failures.
        cfg = balancer_config(
            [u1, u2],
            health={"consecutive_failures": 3, "probe_interval_s": 30.0, "probe_model": False},
        )
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url) as c:
            bad.fail_next = 100
            await c.post("/admin/drain/i1")  # force traffic to i0 until it is ejected
            answers = [await c.post(CHAT, json=chat(max_tokens=2)) for _ in range(3)]
            # The instance's own status and words reach the client, the instance named aside.
            assert [r.status_code for r in answers] == [500, 500, 500]
            assert answers[0].json()["error"]["message"] == "simulated failure"
            assert answers[0].headers["x-regional-instance"] == "i0"
            assert pool.by_id("i0").ejected(pool.clock())
            await c.delete("/admin/drain/i1")
            r = await c.post(CHAT, json=chat(max_tokens=2))
            assert r.status_code == 200 and r.headers["x-regional-instance"] == "i1"
            metrics = (await c.get("/metrics")).text
            assert 'regional_lb_ejections_total{instance="i0"} 1.0' in metrics
            await eventually(lambda: idle(pool))


async def test_stalled_stream_is_cut_and_counted() -> None:
    async with sim() as (u1, engine):
        cfg = balancer_config([u1], health={"stall_timeout_s": 0.3, "probe_interval_s": 30.0})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=10) as c:
            lines: list[str] = []
            async with c.stream("POST", CHAT, json=chat(max_tokens=500, stream=True)) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        if len(lines) == 2:
                            engine.stalled_until = time.monotonic() + 2.0
            assert "stalled" in json.loads(lines[-1][6:])["error"]["message"]
            await eventually(lambda: idle(pool))
            assert pool.instances[0].consecutive_failures == 1


async def test_mixed_outcomes_leave_accounting_at_zero() -> None:
    """Completions, upstream errors, disconnects and cancellations in one burst."""
    import random

    rng = random.Random(7)
    async with sim(speedup=10.0) as (u1, e1), sim(speedup=10.0) as (u2, e2):
        cfg = balancer_config([u1, u2], health={"consecutive_failures": 1000})
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=30) as c:
            e1.fail_next = 5

            async def one(k: int) -> None:
                stream = rng.random() < 0.5
                body = chat(max_tokens=rng.randint(5, 200), stream=stream)
                if stream:
                    async with c.stream("POST", CHAT, json=body) as s:
                        async for _ in s.aiter_lines():
                            if rng.random() < 0.02:
                                return  # client walks away mid-stream
                else:
                    await c.post(CHAT, json=body)

            tasks = [asyncio.create_task(one(k)) for k in range(40)]
            await asyncio.sleep(0.15)
            for t in rng.sample(tasks, 8):
                t.cancel()  # cancellations at arbitrary points
            await asyncio.gather(*tasks, return_exceptions=True)
            await eventually(lambda: idle(pool), within=10)
            await eventually(lambda: not e1.running and not e2.running, within=10)


async def test_sigterm_drains_the_region_lets_streams_finish_then_exits(
    sim_process: SimProcess, tmp_path: Path
) -> None:
    import signal
    import subprocess
    import sys

    import yaml

    from tests.regional_lb.conftest import free_port

    sim_url, _ = sim_process("--models", "m1", "--speedup", "10")
    port = free_port()
    cfg = tmp_path / "lb.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "region": "sig",
                "listen": f"127.0.0.1:{port}",
                "instances": [{"id": "i0", "url": sim_url, "models": ["m1"]}],
                "health": {"slow_start_s": 0},
            }
        )
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from regional_lb.cli import app; app()",
        "serve",
        "--config",
        str(cfg),
        "--grace",
        "20",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=20) as c:
            await _until_ready(c)
            lines: list[str] = []
            async with c.stream("POST", CHAT, json=chat(max_tokens=300, stream=True)) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line)
                        if len(lines) == 3:
                            proc.send_signal(signal.SIGTERM)
                            await asyncio.sleep(0.2)
                            async with httpx.AsyncClient(base_url=url) as other:
                                r = await other.post(CHAT, json=chat(max_tokens=2))
                            assert r.status_code == 503  # draining: no new work
            assert lines[-1] == "data: [DONE]" and len(lines) == 302
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _until_ready(c: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if (await c.get("/readyz")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("balancer did not become ready")


async def test_a_saturated_instance_is_busy_not_down() -> None:
    # A KV cache that holds two sequences: the rest, and the model probe, queue at the instance
    # for longer than the probe timeout. Requests keep completing, so it stays in service.
    # The model probe is opt-in since issue 19 (readiness costs no inference): on here.
    probing = {"probe_model": True, "model_probe_interval_s": 0.05}
    async with sim(gpu="T4", kv_tokens=400) as (u1, engine):
        cfg = balancer_config(
            [u1], health={"probe_interval_s": 0.05, "probe_timeout_s": 0.1, **probing}
        )
        async with balancer(cfg) as (url, pool), httpx.AsyncClient(base_url=url, timeout=30) as c:
            inst = pool.by_id("i0")
            # In service after a probe that succeeded: on a loaded machine the first 0.1 s probe
            # can time out before anything is queued, and that is not what this test is about.
            await eventually(lambda: inst.healthy and inst.probe_ok_at is not None, within=10.0)
            states: list[bool] = []
            queued: list[int] = []

            async def watch() -> None:
                while True:
                    states.append(inst.healthy)
                    queued.append(len(engine.waiting))
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            replies = await asyncio.gather(
                *(c.post(CHAT, json=chat(max_tokens=60)) for _ in range(8))
            )
            watcher.cancel()
            assert [r.status_code for r in replies] == [200] * 8
            assert max(queued) >= 2  # requests (and so probes) did queue at the instance
            assert all(states), "a busy instance was taken out of service"
        # The same instance silent (nothing completes, no tokens): the probe timing out is a
        # failure, and the instance leaves service.
        engine.stalled_until = float("inf")
        cfg = balancer_config(
            [u1], health={"probe_interval_s": 0.05, "probe_timeout_s": 0.1, **probing}
        )
        async with balancer(cfg) as (url, pool):
            await eventually(lambda: not pool.by_id("i0").healthy, within=3.0)
