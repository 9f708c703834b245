"""Plot the fleet benchmark (``fleet.py --json``): demand, supply and producers over time.

    python benchmarks/plot_fleet.py benchmarks/results/fleet.json docs/fleet.png

Top: the trainer's demand (its schedule: 1 / step), the broker's estimate of it, and what the
trainer took each second, for each fleet. Middle: producers connected (and, for the
self-sizing fleet, the number the broker wanted), with the supply they can deliver on the
right axis. Bottom: the share of each second the trainer waited for data. Needs matplotlib
(``pip install '.[bench]'``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.plot_pipeline import plot_parser, pyplot  # noqa: E402

COLORS = {"auto": "#2a6fb0", "max": "#c0392b", "min": "#7f8c8d"}


def demand_at(schedule: list[list[float]], t: float) -> float:
    for seconds, step in schedule:
        if t < seconds:
            return 1 / step if step else float("nan")
        t -= seconds
    return 1 / schedule[-1][1]


def per_second(samples: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    ts, vs = [], []
    for a, b in zip(samples, samples[1:], strict=False):
        if a[key] is None or b[key] is None or b["t"] <= a["t"]:
            continue
        ts.append(b["t"])
        vs.append((b[key] - a[key]) / (b["t"] - a["t"]))
    return ts, vs


def main() -> None:
    ap = plot_parser(__doc__)
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    schedule, per = data["schedule"], data["per_producer"]
    plt = pyplot("plot_fleet.py")
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(10, 9), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 3, 2]})
    end = sum(s for s, _ in schedule)
    grid = [i * 0.25 for i in range(int(end * 4) + 1)]
    top.plot(grid, [demand_at(schedule, t) for t in grid], color="black", lw=2,
             label="demand (the trainer's schedule)")
    for run in data["runs"]:
        f, s = run["fleet"], run["samples"]
        c = COLORS.get(f, None)
        ts, taken = per_second(s, "taken")
        top.plot(ts, taken, color=c, lw=1, label=f"{f}: taken")
        if f == "auto":
            top.plot([x["t"] for x in s], [x["demand_estimate"] for x in s], color=c,
                     lw=1, ls=":", label="auto: the broker's demand estimate")
            mid.step([x["t"] for x in s], [x["wanted"] for x in s], where="post", color=c,
                     ls="--", lw=1, label="auto: producers wanted")
        mid.step([x["t"] for x in s], [x["producers"] for x in s], where="post", color=c,
                 lw=1.5, label=f"{f} ({run['min']}-{run['max']}): producers")
        tw, waited = per_second(s, "waited")
        low.plot(tw, [min(1.0, w) for w in waited], color=c, lw=1, label=f)
    top.set_ylabel("batches/s")
    top.legend(fontsize=7, loc="upper right", ncol=2)
    top.set_title("A fleet that sizes itself: demand, supply and producers over time")
    mid.set_ylabel("producers")
    right = mid.twinx()
    lo, hi = mid.get_ylim()
    right.set_ylim(lo * per, hi * per)
    right.set_ylabel(f"supply, batches/s ({per:g} per producer)")
    mid.legend(fontsize=7, loc="upper right", ncol=2)
    low.set_ylabel("trainer waiting")
    low.set_ylim(0, 1)
    low.set_xlabel("seconds")
    low.legend(fontsize=7, loc="upper right", ncol=3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
