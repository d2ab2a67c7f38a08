"""The compliance report as one self-contained HTML page: no script, no fetched asset, every
value escaped; charts are inline SVG bars, each with its figures in a table beside it (a chart
is never the only place a number is)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from html import escape
from typing import Any

from gtm.report.compliance import Compliance

_CSS = """
body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#1b1b1b}
h1{font-size:1.6rem}h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5rem 0}td,th{padding:.2rem .6rem;text-align:left;
border-bottom:1px solid #e3e3e3}td.n{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#0a6b2d;font-weight:600}.bad{color:#a30000;font-weight:600}
.verdict{font-size:1.1rem;padding:.6rem .8rem;border:2px solid currentColor;display:inline-block}
svg text{font:12px system-ui,sans-serif;fill:#1b1b1b}
.console-nav{display:flex;gap:1rem;align-items:baseline;flex-wrap:wrap;padding:.5rem 0;
border-bottom:2px solid #1f4e79}.console-nav .brand{font-weight:700}
.console-nav nav a{margin-right:.8rem}.console-nav .me{margin-left:auto;font-size:.9rem}
"""


def _t(us: int | None) -> str:
    if us is None:
        return "-"
    return datetime.fromtimestamp(us / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _bars(title: str, values: Mapping[str, int]) -> str:
    items = sorted(values.items(), key=lambda kv: -kv[1])[:12]
    if not items:
        return "<p>No answers.</p>"
    top = max(v for _, v in items) or 1
    row_h, label_w, bar_w = 22, 170, 380
    height = row_h * len(items) + 4
    parts = [
        f'<svg role="img" aria-label="{escape(title)}" width="{label_w + bar_w + 90}" '
        f'height="{height}" viewBox="0 0 {label_w + bar_w + 90} {height}">'
    ]
    for i, (label, value) in enumerate(items):
        y = i * row_h + 2
        width = max(1, round(bar_w * value / top))
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">{escape(label)}</text>'
            f'<rect x="{label_w}" y="{y + 3}" width="{width}" height="{row_h - 7}" fill="#3b6ea5"/>'
            f'<text x="{label_w + width + 6}" y="{y + 15}">{value:,}</text>'
        )
    parts.append("</svg>")
    table = "".join(f"<tr><td>{escape(k)}</td><td class=n>{v:,}</td></tr>" for k, v in items)
    return (
        "".join(parts) + f"<table><tr><th>{escape(title)}</th><th>answers</th></tr>{table}</table>"
    )


# What each outcome in the audit store means, for a reader who has not read the code.
OUTCOMES = {
    "answer": "answered with one region chosen by the decision",
    "fail_static": "no allowed region was healthy; unrestricted traffic got every allowed region",
    "fail_closed": "no allowed region was healthy; restricted traffic was refused",
    "denied": "the request's residency class is allowed nowhere (HTTP 451)",
    "no_service": "the name is not a configured service",
    "zone": "answered from the DNS zone's own data (SOA, NS, static records, DNSKEY): "
    "no region was chosen",
    "nxdomain": "the name does not exist in the zone",
    "nodata": "the name exists without the type asked, or a restricted name failed closed",
    "refused": "asked outside the zone, or refused by policy (DNS REFUSED)",
    "malformed": "a query that could not be read (FORMERR)",
}


def _table(headers: list[str], rows: list[list[Any]], empty: str) -> str:
    """A table, or ``empty`` (a sentence saying what there is none of) when no row."""
    if not rows:
        return f"<p>{escape(empty)}</p>"
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _class_by_jurisdiction(report: Compliance) -> str:
    """Residency class (rows) x jurisdiction of the region that answered (columns)."""
    table = report.by_class_jurisdiction
    if not table:
        return "<p>No answers in this window.</p>"
    columns = sorted({j for c in table.values() for j in c}, key=lambda j: (j.startswith("("), j))
    head = "".join(f"<th scope=col>{escape(j)}</th>" for j in columns)
    body = "".join(
        f"<tr><th scope=row>{escape(cls)}</th>"
        + "".join(f"<td class=n>{table[cls].get(j, 0):,}</td>" for j in columns)
        + "</tr>"
        for cls in sorted(table)
    )
    return (
        "<table id=class-jurisdiction><caption>Answers by residency class and the jurisdiction "
        "of the region that served them</caption>"
        f"<tr><th scope=col>residency class</th>{head}</tr>{body}</table>"
        "<p>A jurisdiction is a named group of regions in the policy in force. "
        "<em>(not answered)</em>: refused or failed closed, no region served it; "
        "<em>(unclassified)</em>: traffic with no residency class; "
        "<em>(policy not available)</em>: the row's policy version is stored nowhere.</p>"
    )


def _outcome_legend(report: Compliance) -> str:
    rows = [[o, OUTCOMES.get(o, "-")] for o in sorted(report.by_outcome)]
    return _table(["outcome", "meaning"], rows, "No answers in this window.")


def render(report: Compliance, nav: str = "") -> str:
    """The page; ``nav`` is markup put above it (the console's navigation, already escaped)."""
    v = report.verification
    breaks, gaps = v.get("breaks", []), v.get("gaps", [])
    clean = report.outside_allowed == 0 and not report.unverifiable
    verdict = (
        f'<p class="verdict ok">0 answers outside the allowed regions, recomputed from the '
        f"recorded inputs of {report.rows:,} rows ({report.answers:,} answers).</p>"
        if clean
        else f'<p class="verdict bad">{report.outside_allowed:,} answers outside the allowed '
        f"regions; {sum(report.unverifiable.values()):,} answers could not be recomputed "
        "(their policy version is not available).</p>"
    )
    chain_state = (
        '<p class="ok">Every chain verifies against its checkpoints.</p>'
        if not breaks
        else f'<p class="bad">{len(breaks)} break(s) in the audit chains.</p>'
    )
    policies = [
        [
            p.policy_version,
            f"{p.answers:,}",
            _t(p.first_us),
            _t(p.last_us),
            "; ".join(
                f"#{x['proposal']} by {x['author']}, approved by {', '.join(x['approvers']) or '-'}"
                for x in p.proposals
            )
            or "this node's files (not activated through the admin API)",
        ]
        for p in sorted(report.policies.values(), key=lambda p: p.first_us or 0)
    ]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>GTM compliance report</title>
<meta name="viewport" content="width=device-width,initial-scale=1"><style>{_CSS}</style></head>
<body>{nav}<main>
<h1>Compliance report</h1>
<p>{_t(report.from_us)} to {_t(report.to_us)} &middot; audit store {escape(str(report.store))}</p>
{verdict}
{chain_state}
<h2>Residency class by serving jurisdiction</h2>
{_class_by_jurisdiction(report)}
<h2>Answers by jurisdiction of the region answered</h2>
{_bars("jurisdiction", report.by_jurisdiction)}
<h2>Answers by residency class</h2>
{_bars("residency class", report.by_class)}
<h2>Answers by service</h2>
{_bars("service", report.by_service)}
<h2>Outcomes</h2>
{_bars("outcome", report.by_outcome)}
{_outcome_legend(report)}
<h2>Answers outside the allowed regions</h2>
{
        _table(
            ["row", "name", "client network", "country", "classes", "region", "allowed", "answers"],
            [
                [
                    e["row"],
                    e["name"],
                    e["client_network"],
                    e["country"],
                    ",".join(e["classes"]),
                    e["region"],
                    ",".join(e["allowed"] or []),
                    e["answers"],
                ]
                for e in report.outside_examples
            ],
            "No answer went to a region outside the ones its policy allowed.",
        )
    }
<h2>Policy versions in force</h2>
{_table(["policy version", "answers", "first", "last", "approval"], policies, "No answers.")}
<h2>Operator and admin actions</h2>
<p>Region controls (drains, weights, forced states), changes of principals, tokens, proposals
and approvals, and refused attempts to change something (kind <em>denied</em>), with who asked
and why. Region <em>-</em>: an action on the control plane, not on one region.{
        ""
        if not report.refused_reads
        else f" {report.refused_reads:,} refused page views (a role without a read) changed "
        "nothing and are not listed; the event log holds them."
    }</p>
{
        _table(
            ["time", "region", "kind", "state", "who", "why"],
            [
                [
                    _t(a["at_us"]),
                    a["region"],
                    a["kind"],
                    a["state"] or "-",
                    a["actor"],
                    a["reason"] or "-",
                ]
                for a in report.operator_actions
            ],
            "No operator or admin action in this window.",
        )
    }
<h2>Gaps (unclean stops)</h2>
{
        _table(
            ["chain", "at", "detail"],
            [[g["chain"], _t(round(g["at"] * 1e6)), g["detail"]] for g in gaps],
            "No gap: no node stopped uncleanly in this window.",
        )
    }
<h2>Chain verification</h2>
<p>{v.get("checkpoints", 0):,} signed checkpoints read from the sink outside the database.</p>
{
        _table(
            ["chain", "rows", "answers", "anchored through", "last row"],
            [
                [name, f"{c['rows']:,}", f"{c['answers']:,}", c["anchored_through"], c["last_seq"]]
                for name, c in v.get("chains", {}).items()
            ],
            "No chain in the store.",
        )
    }
{
        _table(
            ["chain", "row", "problem"],
            [[b["node"], b["node_seq"], b["problem"]] for b in breaks],
            "No break: every row links to the one before and matches the signed checkpoints.",
        )
    }
</main></body></html>
"""


__all__ = ["render"]
