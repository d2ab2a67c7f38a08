"""What session affinity adds to a proxied request (gtm.front.affinity), beside the decision.

    .venv/bin/python bench/http/affinity_cost.py

Per request: the decision alone, then the decision with the cookie read, the session judged and
a cookie issued, for a request whose session is kept in another region and for one without a
cookie. In-process, no sockets: the forwarding itself costs far more and is not measured here.
"""

from __future__ import annotations

import tempfile
import time
from ipaddress import ip_address
from pathlib import Path

from gtm.decision.geoip import GeoDatabase
from gtm.decision.policy import load_policy
from gtm.decision.routing import Channel, DecisionRequest, decide
from gtm.decision.snapshot import RegionCapacity, Snapshot
from gtm.decision.topology import load_topology
from gtm.front.affinity import Affinity, AffinitySettings, Session, Verdict
from tests.support.geoip import build_city_db

ROOT = Path(__file__).resolve().parents[2]
N = 50_000


def main() -> None:
    geo = build_city_db(Path(tempfile.mkdtemp()) / "city.mmdb")
    topology = load_topology(ROOT / "examples" / "demo.yaml")
    now = time.time()
    snapshot = Snapshot(
        1, topology, load_policy([ROOT / "policies"], topology), GeoDatabase(geo), built_at=now
    ).evolve(now, capacity={"eu-west": RegionCapacity(0.3, now, False)})
    request = DecisionRequest(
        Channel.HTTP,
        ip_address("198.51.100.7"),  # Frankfurt: eu-central is the fresh choice
        "chat-eu",
        "chat.eu.gtm.example",
        None,
        frozenset({"eu-personal"}),
    )
    affinity = Affinity(AffinitySettings(b"k" * 32))
    decision = decide(request, snapshot, now)
    session = Session(Verdict.NEW, None, affinity.tag(decision, None), False)
    cookie = affinity.issue("eu-west", session, now).split(b";")[0]
    with_cookie = [(b"host", b"chat.eu.gtm.example"), (b"cookie", b"theme=dark; " + cookie)]
    for label, headers in (("session kept in eu-west", with_cookie), ("no cookie", [])):
        start = time.perf_counter()
        for _ in range(N):
            decision = decide(request, snapshot, now)
            read = affinity.read(headers, decision, None, now, False)
            kept, read = affinity.keep(decision, read, snapshot, now)
            assert kept.region is not None
            affinity.issue(kept.region, read, now)
        both = (time.perf_counter() - start) / N
        start = time.perf_counter()
        for _ in range(N):
            decide(request, snapshot, now)
        alone = (time.perf_counter() - start) / N
        print(
            f"{label:<24} decide {alone * 1e6:6.1f} us   with affinity {both * 1e6:6.1f} us   "
            f"affinity {(both - alone) * 1e6:6.1f} us   ({read.verdict.value})"
        )


if __name__ == "__main__":
    main()
