"""A self-sizing fleet against fixed fleets, over one demand schedule.

A broker, a trainer whose model step changes (``feedline drain --schedule``: fast, slow,
fast) and producers of a paced pipeline (``fake: {delay}``: each producer delivers
``--per-producer`` batches/s whatever the CPU, so supply grows with the number of producers on
a 2-core machine too), run by ``feedline fleet``:

- ``auto``: ``--min 1 --max M``, sized by the broker's number;
- ``max``: ``--min M --max M``, M producers throughout;
- ``min``: ``--min 1 --max 1``.

Sampled every second from the broker's and the trainer's /metrics: producers connected, the
number wanted, the broker's demand estimate, batches the trainer took and the seconds it
waited. Reported per fleet: producer-seconds (producers connected, integrated over the run),
the trainer's wait share (all of the run, and after the first phase's ramp), batches taken.

    python benchmarks/fleet.py --json benchmarks/results/fleet.json
    python benchmarks/plot_fleet.py benchmarks/results/fleet.json docs/fleet.png
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from feedline.procs import Child, free_port, wait_for  # noqa: E402
from feedline.scrape import scrape  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def run(fleet: str, lo: int, hi: int, schedule: list[tuple[float, float]], per: float,
        window: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="feedline-fleet-bench-") as tmp:
        cfg = Path(tmp) / "paced.yaml"
        batch = 10
        cfg.write_text(yaml.safe_dump({
            "source": {"fake": {"shapes": [[256]], "dtypes": ["float32"], "random": False,
                                "size": 10**9, "delay": 1 / (per * batch)}},
            "steps": [{"batch": {"batch_size": batch}}]}))
        port, bm, tm = free_port(), free_port(), free_port()
        ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{tmp}/egress.sock"
        cmd = [sys.executable, "-m", "feedline.commands"]
        quiet = ["--log-level", "WARNING"]
        procs = [Child([*cmd, "broker", "--ingress", ingress, "--egress", egress,
                        "--metrics-port", str(bm), "--sizing-window", str(window), *quiet],
                       cwd=ROOT)]
        broker, trainer = f"http://127.0.0.1:{bm}/metrics", f"http://127.0.0.1:{tm}/metrics"
        try:
            wait_for(lambda: not scrape(broker).error, 30, what="broker")
            procs.append(Child([*cmd, "fleet", "--config", str(cfg), "--broker", ingress,
                                "--broker-metrics", f"127.0.0.1:{bm}", "--min", str(lo),
                                "--max", str(hi), "--id", fleet, "--interval", "1", *quiet,
                                "--", *quiet], cwd=ROOT))
            # Producers first (as a fleet would be running when training starts).
            wait_for(lambda: (scrape(broker).get("feedline_broker_stream_peers",
                                                 stream="default", role="producer") or 0)
                     >= lo, 60, what="the fleet's first producers")
            sched = ",".join(f"{s:g}:{step:g}" for s, step in schedule)
            procs.append(Child([*cmd, "drain", "--broker", egress, "--window", "8",
                                "--schedule", sched, "--metrics-port", str(tm), *quiet],
                               cwd=ROOT))
            wait_for(lambda: not scrape(trainer).error, 30, what="trainer")
            t0 = time.monotonic()
            total = sum(s for s, _ in schedule)
            samples = []
            while time.monotonic() - t0 < total:
                time.sleep(1.0 - (time.monotonic() - t0) % 1.0)
                b, c = scrape(broker), scrape(trainer)
                samples.append({
                    "t": round(time.monotonic() - t0, 2),
                    "producers": b.get("feedline_broker_stream_peers", stream="default",
                                       role="producer") or 0,
                    "wanted": b.get("feedline_broker_stream_producers_wanted",
                                    stream="default"),
                    "demand_estimate": _finite(b.get(
                        "feedline_broker_stream_demand_batches_per_second", stream="default")),
                    "taken": c.get("feedline_consumer_received_batches_total"),
                    "waited": c.get("feedline_consumer_wait_seconds_sum")})
                print(f"{fleet:>4} t={samples[-1]['t']:6.1f}s producers "
                      f"{samples[-1]['producers']:.0f} wanted {samples[-1]['wanted']}",
                      flush=True)
        finally:
            for p in reversed(procs):
                p.stop(15)
    return {"fleet": fleet, "min": lo, "max": hi, "samples": samples}


def _finite(x: float | None) -> float | None:
    return None if x is None or x != x else x


def summary(r: dict[str, Any], schedule: list[tuple[float, float]]) -> dict[str, float]:
    s = [x for x in r["samples"] if x["taken"] is not None and x["waited"] is not None]
    span = s[-1]["t"] - s[0]["t"]
    prod_s = sum(a["producers"] * (b["t"] - a["t"]) for a, b in zip(s, s[1:], strict=False))
    after = [x for x in s if x["t"] >= schedule[0][0] / 2]
    return {
        "producer_seconds": prod_s,
        "wait_share": (s[-1]["waited"] - s[0]["waited"]) / span,
        "wait_share_after_ramp": (after[-1]["waited"] - after[0]["waited"])
        / (after[-1]["t"] - after[0]["t"]),
        "batches": s[-1]["taken"] - s[0]["taken"],
        "seconds": span,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="45:0.025,45:0.08,45:0.025",
                    help="the trainer's phases, SECONDS:STEP,... (feedline drain --schedule)")
    ap.add_argument("--per-producer", type=float, default=10.0,
                    help="batches/s each producer delivers (the pipeline's pace)")
    ap.add_argument("--max", type=int, default=6, help="the fleets' --max (and the fixed one)")
    ap.add_argument("--sizing-window", type=float, default=5.0, help="the broker's")
    ap.add_argument("--fleets", nargs="+", default=["auto", "max", "min"],
                    choices=["auto", "max", "min"])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    schedule = [(float(s), float(step)) for s, step in
                (p.split(":") for p in a.schedule.split(","))]
    bounds = {"auto": (1, a.max), "max": (a.max, a.max), "min": (1, 1)}
    runs = [run(f, *bounds[f], schedule, a.per_producer, a.sizing_window) for f in a.fleets]
    print(f"\n{'fleet':<6} {'producer-s':>10} {'vs max':>7} {'trainer waited':>15} "
          f"{'after ramp':>11} {'batches':>8}")
    out = {"schedule": schedule, "per_producer": a.per_producer,
           "sizing_window": a.sizing_window, "runs": runs, "summary": {}}
    sums = {r["fleet"]: summary(r, schedule) for r in runs}
    ref = sums.get("max", next(iter(sums.values())))["producer_seconds"]
    for f, m in sums.items():
        print(f"{f:<6} {m['producer_seconds']:>10.0f} {m['producer_seconds'] / ref:>6.2f}x "
              f"{100 * m['wait_share']:>14.1f}% {100 * m['wait_share_after_ramp']:>10.1f}% "
              f"{m['batches']:>8.0f}")
        out["summary"][f] = m
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
