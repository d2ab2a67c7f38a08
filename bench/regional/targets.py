"""The issue's targets, checked against the measured table and printed as met / missed."""

from __future__ import annotations

Table = dict[tuple[str, float, str], dict[str, float]]


def _line(ok: bool, text: str) -> None:
    print(f"  [{'met' if ok else 'MISSED'}] {text}")


def check_targets(t: Table) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    loads = sorted({load for (_, load, _) in t})
    print("\n## Targets")
    for doc in ("documents_1pct", "documents", "documents_5pct"):
        for load in loads:
            ours, rr = t.get((doc, load, "ours")), t.get((doc, load, "round_robin"))
            orc = t.get((doc, load, "oracle"))
            if ours and rr and orc:
                ok = ours["cv"] <= 0.08
                _line(
                    ok,
                    f"{doc} {load:.0%}: utilisation CV {ours['cv']:.3f} <= 0.08 "
                    f"(round-robin {rr['cv']:.3f})",
                )
                out.append((f"{doc}_cv_{load}", ok))
                cut = 1 - ours["p99"] / rr["p99"]
                # The oracle's cut is the most any dispatch policy reaches on this mix.
                bound = 1 - orc["p99"] / rr["p99"]
                _line(
                    cut >= 0.71,
                    f"{doc} {load:.0%}: P99 {ours['p99']:.1f} s vs round-robin "
                    f"{rr['p99']:.1f} s: {cut:.0%} lower (target >= 71%; oracle {bound:.0%})",
                )
                out.append((f"{doc}_p99_{load}", cut >= 0.71))
        ours, rr = t.get((doc, loads[0], "ours")), t.get((doc, loads[0], "round_robin"))
        if ours and rr:
            thr_rr = rr["throughput_at_slo"]
            gain = ours["throughput_at_slo"] / thr_rr - 1 if thr_rr > 0 else float("inf")
            _line(
                gain >= 0.43,
                f"{doc}: throughput at SLO {ours['throughput_at_slo']:.2f} vs "
                f"round-robin {thr_rr:.2f} req/s: {gain:+.0%} (target >= +43%)",
            )
            out.append((f"{doc}_thr", gain >= 0.43))
    for load in loads:
        ours = t.get(("mixed_fleet", load, "ours"))
        orc = t.get(("mixed_fleet", load, "oracle"))
        lc = t.get(("mixed_fleet", load, "least_connections"))
        if ours and orc and lc:
            r = ours["p99"] / orc["p99"]
            _line(
                r <= 1.2,
                f"mixed fleet {load:.0%}: P99 {ours['p99']:.1f} s = {r:.2f} x oracle "
                f"(target <= 1.2)",
            )
            cut = 1 - ours["p99"] / lc["p99"]
            _line(
                cut >= 0.30,
                f"mixed fleet {load:.0%}: {cut:.0%} below least-connections "
                f"{lc['p99']:.1f} s (target >= 30%)",
            )
            out += [(f"mixed_oracle_{load}", r <= 1.2), (f"mixed_lc_{load}", cut >= 0.30)]
    for load in loads:
        ours, sw = (
            t.get(("sigma_0.6", load, "ours")),
            t.get(("sigma_0.6", load, "speed_weighted_lc")),
        )
        if ours and sw:
            ok = ours["p99"] <= sw["p99"]
            _line(
                ok,
                f"sigma 0.6, {load:.0%}: P99 {ours['p99']:.1f} s vs speed-weighted LC "
                f"{sw['p99']:.1f} s (target: not worse)",
            )
            out.append((f"sigma06_{load}", ok))
    return out
