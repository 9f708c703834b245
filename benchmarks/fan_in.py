"""Fan-in at scale: many producers on one broker, every one served (issue 13, item 5).

A broker process (``python -m feedline.broker``), ``--producers`` producers as ``producer.Sender``s
in
threads of ``--procs`` processes (64 producer processes would not fit a small machine; each
Sender has its own connection, registration, credit and I/O thread, exactly as a producer
process has), each sending constant ``--batch-bytes`` uint8 batches as fast as its credit
allows, and one consumer process (``RemoteDataZMQ(return_meta=True)``) counting batches per
producer id. Once every producer is registered, ``--seconds`` are measured:

- throughput (batches/s and MB/s of array bytes, at the consumer);
- each producer's share (its batches/s): min, median, max, and min / mean (the test's bar:
  >= 1/4);
- the broker's resident memory (peak growth over the idle broker, sampled every 20 ms) and
  CPU (user + system seconds per second of the window);

and, with ``--plot``, the per-producer shares as a bar chart (needs matplotlib:
``pip install '.[bench]'``).

    python benchmarks/fan_in.py --producers 64 --procs 4 --seconds 20 \\
        --json benchmarks/results/fan_in.json --plot docs/fan_in.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from feedline.procs import Child, free_port, wait_for  # noqa: E402
from feedline.scrape import scrape  # noqa: E402

MiB = 1 << 20

# One process of producers: argv = broker, first index, count, batch bytes. Each thread is one
# producer (its own Sender: connection, registration, credit, I/O thread) named fan<index>.
SENDERS = textwrap.dedent("""
    import signal, sys, threading
    import numpy as np
    from feedline.errors import Stopped
    from feedline.producer import Sender
    addr, first, count, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    def run(i):
        batch = [np.zeros(nbytes, np.uint8)]
        with Sender(addr, producer_id=f"fan{i:03d}") as s:
            try:
                while not stop.is_set():
                    s.send(batch, stop=stop)
            except Stopped:
                pass
    threads = [threading.Thread(target=run, args=(i,)) for i in range(first, first + count)]
    for t in threads:
        t.start()
    while not stop.wait(0.5):
        pass
    for t in threads:
        t.join(10)
""")

# The consumer: counts per producer, printed as one JSON line ("C" time counts) every 0.5 s.
CONSUMER = textwrap.dedent("""
    import json, sys, threading, time
    from feedline.consumer import ConsumerOptions, RemoteDataZMQ
    counts = {}
    def report():
        while True:
            print("C", time.monotonic(), json.dumps(counts), flush=True)
            time.sleep(0.5)
    threading.Thread(target=report, daemon=True).start()
    with RemoteDataZMQ(sys.argv[1], timeout=None, return_meta=True,
                       options=ConsumerOptions(window=16)) as src:
        for b in src:
            counts[b.producer] = counts.get(b.producer, 0) + 1
""")


class RssSampler:
    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.proc = psutil.Process(pid)
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def snapshots(log: Path) -> list[tuple[float, dict[str, int]]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("C "):
            _, t, counts = line.split(" ", 2)
            out.append((float(t), json.loads(counts)))
    return out


def latest(log: Path) -> tuple[float, dict[str, int]]:
    snaps = snapshots(log)
    return snaps[-1] if snaps else (time.monotonic(), {})


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    port, metrics_port = free_port(), free_port()
    ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{work}/egress.sock"
    env = {"PYTHONPATH": str(ROOT)}
    children: list[Child] = []

    def child(argv: list[str], name: str) -> Child:
        c = Child([sys.executable, *argv], work / f"{name}.log", env=env, cwd=ROOT)
        children.append(c)
        return c

    try:
        broker = child(["-m", "feedline.broker", "--ingress", ingress, "--egress", egress,
                        "--max-bytes", str(args.max_bytes), "--max-batches",
                        str(args.max_batches), "--metrics-port", str(metrics_port),
                        "--metrics-addr", "127.0.0.1"], "broker")

        def peers(role: str) -> float:
            s = scrape(metrics_port, timeout=5)
            return s.total("feedline_broker_peers", role=role) if s.error is None else -1

        wait_for(lambda: peers("producer") == 0 or not broker.alive(), 30, what="broker")
        time.sleep(0.5)  # the idle broker's RSS settles before it becomes the base
        rss = RssSampler(broker.pid)
        consumer = child(["-c", CONSUMER, egress], "consumer")
        per = -(-args.producers // args.procs)
        for k in range(args.procs):
            first = k * per
            count = min(per, args.producers - first)
            if count > 0:
                child(["-c", SENDERS, ingress, str(first), str(count), str(args.batch_bytes)],
                      f"senders{k}")
        print(f"{args.producers} producers in {args.procs} processes starting", flush=True)
        wait_for(lambda: peers("producer") >= args.producers, 120, interval=0.5,
                 what=f"{args.producers} producers registered")
        wait_for(lambda: len(latest(work / "consumer.log")[1]) >= args.producers, 60,
                 interval=0.5, what="a batch from every producer")
        print("all registered and served; measuring", flush=True)
        cpu0 = psutil.Process(broker.pid).cpu_times()
        t0, c0 = latest(work / "consumer.log")
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            time.sleep(min(5.0, max(0.0, end - time.monotonic())))
            t, c = latest(work / "consumer.log")
            print(f"  {t - t0:5.1f} s: {(sum(c.values()) - sum(c0.values())) / (t - t0):.0f} "
                  f"batches/s, broker RSS +{(rss.peak - rss.base) / MiB:.1f} MiB", flush=True)
        t1, c1 = latest(work / "consumer.log")
        broker_cpu = psutil.Process(broker.pid).cpu_times()
        rss.stop()
        alive = consumer.alive() and broker.alive()
    finally:
        for proc in reversed(children):
            proc.stop(timeout=15)
    seconds = t1 - t0
    rates = {p: (c1.get(p, 0) - c0.get(p, 0)) / seconds for p in
             sorted(set(c1) | {f"fan{i:03d}" for i in range(args.producers)})}
    values = list(rates.values())
    total = sum(values)
    mean = total / len(values)
    cpu = ((broker_cpu.user + broker_cpu.system) - (cpu0.user + cpu0.system)) / seconds
    return {
        "producers": args.producers, "procs": args.procs, "batch_bytes": args.batch_bytes,
        "max_bytes": args.max_bytes, "max_batches": args.max_batches, "seconds": seconds,
        "cpus": os.cpu_count(),
        "batches_per_s": total, "mb_per_s": total * args.batch_bytes / 1e6,
        "share_min": min(values), "share_median": statistics.median(values),
        "share_max": max(values), "share_mean": mean,
        "min_over_mean": min(values) / mean if mean else 0.0,
        "served": sum(1 for v in values if v > 0),
        "broker_rss_base_mib": rss.base / MiB, "broker_rss_growth_mib": (rss.peak - rss.base) / MiB,
        "broker_cpu": cpu, "alive": alive, "rates": rates,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(result["rates"].values(), reverse=True)
    mean = result["share_mean"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.bar(range(len(rates)), rates, color="#4878a8", width=0.85)
    ax.axhline(mean, color="black", lw=1, label=f"mean {mean:.1f} batches/s")
    ax.axhline(mean / 4, color="#c0392b", lw=1, ls="--", label="mean / 4 (the test's floor)")
    ax.set_xlabel(f"producer (sorted by share; {result['producers']} in "
                  f"{result['procs']} processes)")
    ax.set_ylabel("batches/s delivered")
    ax.set_title(f"Fan-in: {result['producers']} producers, one broker "
                 f"({result['batches_per_s']:.0f} batches/s of {result['batch_bytes']} B, "
                 f"min/mean {result['min_over_mean']:.2f})", fontsize=10)
    ax.set_xlim(-1, len(rates))
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--producers", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4, help="processes the producers run in")
    ap.add_argument("--batch-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=64 * MiB, help="the broker's budget")
    ap.add_argument("--max-batches", type=int, default=32,
                    help="the broker's --max-batches (its default: 32, fewer than producers)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured, once all are served")
    ap.add_argument("--json", type=Path, default=None, help="write the measurements here")
    ap.add_argument("--plot", type=Path, default=None, help="draw the per-producer shares here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="feedline-fan-in-") as tmp:
        r = run(args, Path(tmp))
    print()
    print("| producers | batches/s | MB/s | per producer min / median / max (batches/s) | "
          "min / mean | broker RSS growth | broker CPU |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {r['producers']} ({r['served']} served) | {r['batches_per_s']:.0f} | "
          f"{r['mb_per_s']:.1f} | {r['share_min']:.1f} / {r['share_median']:.1f} / "
          f"{r['share_max']:.1f} | **{r['min_over_mean']:.2f}** | "
          f"{r['broker_rss_growth_mib']:.1f} MiB (idle {r['broker_rss_base_mib']:.0f} MiB) | "
          f"{r['broker_cpu']:.2f} cores |")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    if args.plot:
        plot(r, args.plot)
        print(f"plot: {args.plot}")
    return 0 if r["alive"] and r["served"] == r["producers"] else 1


if __name__ == "__main__":
    sys.exit(main())
