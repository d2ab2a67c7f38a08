"""A region's prefix-cache hit rate and KV headroom, from its capacity report to the operator:
refused when out of range, kept with the region's capacity as the node holds it, served by
``GET /v1/regions``, exported as gauges, and shown in the console's regions table."""

from __future__ import annotations

import json
import re
import time

from prometheus_client import REGISTRY

from gtm.admin.permissions import Role
from gtm.fleet.capacity import CapacityIntake, Rejected
from regional_lb.capacity_report import CapacityReport
from tests.gtm.admin.conftest import AdminFactory, capacity_report
from tests.gtm.admin.console_client import sign_in


def test_intake_refuses_figures_out_of_range_and_takes_reports_without_them() -> None:
    intake = CapacityIntake(None, {"eu-west"}, 30.0, insecure_unsigned=True)
    for bad in (
        {"prefix_cache_hit_rate": 1.5},
        {"kv_free_fraction": -0.1},
        {"kv_free_blocks": -3},
    ):
        got = intake.accept(json.dumps(capacity_report(**bad)).encode(), None, time.time())
        assert isinstance(got, Rejected) and "not a capacity report" in got.reason, bad
    nan = json.dumps(capacity_report(seq=2)).replace(
        '"capacity": 100.0', '"capacity": 100.0, "prefix_cache_hit_rate": NaN'
    )
    assert isinstance(intake.accept(nan.encode(), None, time.time()), Rejected)
    older = intake.accept(json.dumps(capacity_report(seq=3)).encode(), None, time.time())
    assert isinstance(older, CapacityReport) and older.prefix_cache_hit_rate is None


async def test_the_regions_cache_figures_reach_the_api_the_metrics_and_the_console(
    start_admin: AdminFactory,
) -> None:
    async with start_admin() as admin:
        admin.runtime.apply_report(
            CapacityReport.model_validate(
                capacity_report(
                    prefix_cache_hit_rate=0.634, kv_free_fraction=0.41, kv_free_blocks=16400
                )
            )
        )
        viewer = await admin.token("vera", Role.VIEWER)
        async with admin.client(viewer) as api:
            rows = {r["region"]: r for r in (await api.get("/v1/regions")).json()}
        eu, us = rows["eu-west"], rows["us-east"]
        assert (eu["prefix_cache_hit_rate"], eu["kv_free_fraction"], eu["kv_free_blocks"]) == (
            0.634,
            0.41,
            16400,
        )
        assert us["prefix_cache_hit_rate"] is None and us["kv_free_blocks"] is None
        hit = REGISTRY.get_sample_value("gtm_region_prefix_cache_hit_rate", {"region": "eu-west"})
        free = REGISTRY.get_sample_value("gtm_region_kv_free_fraction", {"region": "eu-west"})
        assert (hit, free) == (0.634, 0.41)
        async with sign_in(admin.url, viewer) as client:
            page = (await client.get("/console/")).text
        assert '<th scope="col">Prefix-cache hits</th>' in page
        eu_row = re.search(r'<tr data-region="eu-west">(.*?)</tr>', page, re.S)
        assert eu_row is not None
        assert '<td class="n" data-field="prefix-cache-hits">63%</td>' in eu_row.group(1)
        assert "41%<br><small>16400 blocks</small>" in eu_row.group(1)
        us_row = re.search(r'<tr data-region="us-east">(.*?)</tr>', page, re.S)
        assert us_row is not None
        assert '<td class="n" data-field="prefix-cache-hits">—</td>' in us_row.group(1)
        # A later report without the figures: the gauges do not keep the old ones.
        admin.runtime.apply_report(CapacityReport.model_validate(capacity_report(seq=2)))
        assert (
            REGISTRY.get_sample_value("gtm_region_prefix_cache_hit_rate", {"region": "eu-west"})
            is None
        )
