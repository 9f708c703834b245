"""Run the fault scenarios and write their measurements: a table and a throughput plot.

    sudo python benchmarks/reliability.py --rounds 3 --json docs/reliability.json \\
        --plot docs/reliability.png
    sudo python benchmarks/reliability.py --exact --rounds 3 \\
        --json docs/reliability_exact.json --plot docs/reliability_exact.png

Runs ``tests/faults/test_faults_netns.py`` (with ``--exact``:
``tests/faults/test_faults_exact_netns.py``,
exact delivery) (root: network namespaces) ``--rounds`` times with
``FEEDLINE_RELIABILITY_OUT`` set, so every scenario appends its measurements; then prints a
markdown table (median recovery time per scenario, and every round's) and, with ``--plot``,
draws each scenario's throughput over time with the fault shaded (needs matplotlib:
``pip install '.[bench]'``). Progress: pytest's own line per scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


TRAINING, EXACT = "tests/faults/test_faults_netns.py", "tests/faults/test_faults_exact_netns.py"


def run(rounds: int, out: Path, keep: Path, tests: str = TRAINING) -> int:
    """Run the scenario file ``rounds`` times; returns how many rounds had a failure (their
    logs stay under ``keep``)."""
    failed = 0
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", flush=True)
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            f"--basetemp={keep / f'round-{r + 1}'}", tests], cwd=ROOT,
                           env={**os.environ, "FEEDLINE_RELIABILITY_OUT": str(out)})
        failed += p.returncode != 0
    return failed


def table(results: list[dict]) -> str:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by[r["scenario"]].append(r)
    lines = ["| scenario | recovery (median) | each round | during the fault | lost (counted) |",
             "|---|---|---|---|---|"]
    for name, rs in by.items():
        rec = [r["recovery_s"] for r in rs]
        rates = [r["rate_during_fault"] for r in rs if r["rate_during_fault"] is not None]
        who = rs[0]["affected"] or "all"
        during = (f"{statistics.median(rates):.0f} batches/s ({who}; offered "
                  f"{rs[0]['offered_per_s']:.0f})" if rates else "-")
        lost = " / ".join(f"{sum(r['lost'].values())} ({sum(r['counted'].values())})"
                          for r in rs)
        lines.append(f"| {name} | {statistics.median(rec):.2f} s | "
                     f"{' / '.join(f'{x:.2f}' for x in rec)} | "
                     f"{during} | "
                     f"{lost} |")
    return "\n".join(lines)


def _median(xs: list[float | None]) -> str:
    got = [x for x in xs if x is not None]
    return f"{statistics.median(got):.2f} s" if got else "-"


def _each(xs: list[float | None]) -> str:
    return " / ".join("-" if x is None else f"{x:.2f}" for x in xs)


def exact_table(results: list[dict]) -> str:
    """Exact delivery: recovery, how long an interrupted unit waited for another producer,
    the longest the consumers waited for a batch, and the ledger's verdict per round."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by[r["scenario"]].append(r)
    lines = ["| scenario | recovery (median) | each round | unit taken over after (median) "
             "| longest wait for a batch (median) | job | lost / duplicated / foreign / bytes "
             "differ, per round | dropped as duplicate by the broker |",
             "|---|---|---|---|---|---|---|---|"]
    for name, rs in by.items():
        verdict = " ; ".join("{lost}/{duplicated}/{foreign}/{mismatched}".format(**r["ledger"])
                             for r in rs)
        dropped = " / ".join("-" if r.get("broker_dropped_duplicates") is None
                             else f"{r['broker_dropped_duplicates']:.0f}" for r in rs)
        job = statistics.median(r["job_s"] for r in rs)
        lines.append(f"| {name} | {_median([r['recovery_s'] for r in rs])} | "
                     f"{_each([r['recovery_s'] for r in rs])} | "
                     f"{_median([r['takeover_s'] for r in rs])} | "
                     f"{_median([r['longest_wait_s'] for r in rs])} | {job:.1f} s | "
                     f"{verdict} | {dropped} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first: dict[str, dict] = {}
    for r in results:
        first.setdefault(r["scenario"], r)
    n = len(first)
    cols = 2
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(12, 2.4 * ((n + 1) // 2)),
                             squeeze=False)
    for ax, (name, r) in zip(axes.flat, first.items(), strict=False):
        t, total = zip(*r["total"], strict=True) if r["total"] else ((), ())
        ax.plot(t, total, color="black", lw=1.2, label="total")
        for p, series in r["per_producer"].items():
            if series:
                pt, pv = zip(*series, strict=True)
                ax.plot(pt, pv, lw=0.8, label=p, alpha=0.8)
        ax.axvspan(r["fault_at"], r["healed_at"], color="red", alpha=0.12, lw=0)
        rec = r["recovery_s"]
        if rec is not None:
            ax.axvline(r["healed_at"] + rec, color="green", ls="--", lw=0.8)
        ax.set_title(f"{name}: recovery {'-' if rec is None else f'{rec:.1f} s'}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("batches/s", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7, loc="lower left")
    fig.supxlabel("seconds (red: fault; green: full throughput again)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="runs of the whole scenario file")
    ap.add_argument("--exact", action="store_true",
                    help=f"exact delivery's scenarios ({EXACT}) instead of training mode's")
    ap.add_argument("--json", type=Path, help="write all measurements here")
    ap.add_argument("--plot", type=Path, help="write the throughput plot here (PNG)")
    ap.add_argument("--from-json", type=Path,
                    help="do not run: redo the table and plot from an earlier --json")
    a = ap.parse_args()
    if a.from_json:
        results = json.loads(a.from_json.read_text())
    else:
        keep = Path(tempfile.mkdtemp(prefix="feedline-reliability-"))
        out = keep / "results.jsonl"
        failed = run(a.rounds, out, keep, EXACT if a.exact else TRAINING)
        results = [json.loads(line) for line in out.read_text().splitlines()]
        if failed:
            print(f"{failed} round(s) had failures; their logs are under {keep}")
    if a.json:
        a.json.write_text(json.dumps(results))
    exact = a.exact or any(r.get("mode") == "exact" for r in results)
    print(exact_table(results) if exact else table(results))
    if a.plot:
        plot(results, a.plot)


if __name__ == "__main__":
    main()
