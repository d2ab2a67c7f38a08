"""Matplotlib figures: latency CDFs per policy and utilisation per instance."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt


def plot_cdfs(path: Path, title: str, latencies: dict[str, list[float]]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, lat in latencies.items():
        if not lat:
            continue
        n = len(lat)
        ax.plot(lat, [(k + 1) / n for k in range(n)], label=name, linewidth=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("latency (s, log)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"{title}\nlatency CDF at 90% load", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_utilisation(path: Path, title: str, util: dict[str, list[float]]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(util)
    width = 0.8 / max(1, max(len(v) for v in util.values()))
    for k in range(max(len(v) for v in util.values())):
        ax.bar(
            [i + k * width for i in range(len(names))],
            [util[n][k] if k < len(util[n]) else 0 for n in names],
            width,
            label=f"instance {k}",
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=30, fontsize=8)
    ax.set_ylabel("utilisation (work done / capacity)")
    ax.set_title(f"{title}\nutilisation per instance at 90% load (seed 1)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
