"""Exact delivery on several training hosts (one job) against one host: batches per second per
host, and the job coordinator's CPU per unit, in the same run.

    python benchmarks/job_hosts.py --rounds 3
    python benchmarks/job_hosts.py --hosts 3 --rate 100 --epochs 2 --rounds 1

Each host is a broker process with one paced producer (each sample takes ``1 / (rate x
batch)`` seconds: the producers, not this machine's CPU, set the pace) and one consumer in
this process (a thread). ``one``: one broker, no coordinator, the stream exact as on one host.
``job``: ``--hosts`` brokers started with ``--coordinator`` and a ``feedline coordinator``. The
dataset is the same size per host in both (``--units`` units per host), so a host makes the
same batches either way; a host's rate is its batches over the time from the first batch
anywhere to its last epoch's end. Rounds alternate the order of the two; the report gives
medians, the ratio job / one per host, and the coordinator's CPU seconds per unit handed
out (psutil: user + system of its process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from feedline.consumer import ConsumerOptions, RemoteDataZMQ  # noqa: E402
from feedline.procs import Daemon, free_port, stop_all, wait_for  # noqa: E402
from feedline.transport.link import LinkConfig  # noqa: E402
from tests.support import tcp_ready  # noqa: E402
from tests.support.exact_run import pipeline  # noqa: E402

LIVE = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")
UNIT, BATCH = 16, 4


def _daemon(work: Path, procs: list[Daemon], name: str, module: str, *args: Any) -> Daemon:
    d = Daemon(module, [str(a) for a in args], work / f"{name}.log",
               env={"PYTHONPATH": str(ROOT)})
    procs.append(d)
    return d


def run(work: Path, mode: str, a: argparse.Namespace) -> dict[str, float]:
    hosts = a.hosts if mode == "job" else 1
    work.mkdir(parents=True)
    cfg = pipeline(work, epochs=a.epochs, n=UNIT * a.units * hosts,
                   delay=1.0 / (a.rate * BATCH))
    procs: list[Daemon] = []
    coord = None
    try:
        extra: list[str] = []
        if mode == "job":
            port = free_port()
            coord = _daemon(work, procs, "coordinator", "feedline", "coordinator", "--bind",
                            f"tcp://127.0.0.1:{port}", "--state-dir", work / "job",
                            "--metrics-port", "0")
            wait_for(lambda: tcp_ready(port), 30, what="coordinator")
            extra = ["--coordinator", f"tcp://127.0.0.1:{port}"]
        egresses = []
        for i in range(hosts):
            port = free_port()
            egress = f"ipc://{work}/egress-{i}.sock"
            _daemon(work, procs, f"broker-{i}", "feedline.broker", "--ingress",
                    f"tcp://127.0.0.1:{port}", "--egress", egress, "--metrics-port", "0",
                    "--state-dir", work / f"state-{i}", *LIVE, *extra, "--host-name",
                    f"host-{i}")
            wait_for(lambda p=port: tcp_ready(p), 30, what="broker")
            _daemon(work, procs, f"producer-{i}", "feedline.producer", "--config", cfg,
                    "--broker", f"tcp://127.0.0.1:{port}", "--id", f"p{i}", *LIVE)
            egresses.append(egress)
        counts = [0] * hosts
        first: list[float] = []
        ends = [0.0] * hosts

        def consume(i: int) -> None:
            opts = ConsumerOptions(link=LinkConfig(heartbeat_interval=0.2,
                                                   heartbeat_timeout=1.5))
            with RemoteDataZMQ(egresses[i], stream="val", timeout=120,
                               options=opts) as src:
                for _ in range(a.epochs):
                    for _b in src.epoch():
                        if not first:
                            first.append(time.monotonic())
                        counts[i] += 1
                ends[i] = time.monotonic()

        cpu0 = 0.0
        if coord is not None:  # what it spent starting up is not per unit
            ct = psutil.Process(coord.pid).cpu_times()
            cpu0 = ct.user + ct.system
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(hosts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        cpu = 0.0
        if coord is not None:
            ct = psutil.Process(coord.pid).cpu_times()
            cpu = ct.user + ct.system - cpu0
        t0 = first[0]
        rates = [counts[i] / (ends[i] - t0) for i in range(hosts)]
        total = sum(counts)
        units = a.units * hosts * a.epochs
        return {"per_host": total / (max(ends) - t0) / hosts,
                "slowest_host": min(rates),
                "batches": total, "coordinator_cpu_per_unit_ms": 1000 * cpu / units}
    finally:
        stop_all(procs[::-1], timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rate", type=float, default=100.0,
                    help="batches per second each producer makes, at most (paced)")
    ap.add_argument("--units", type=int, default=40, help="units of 16 samples per host")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="write the medians here")
    a = ap.parse_args()
    got: dict[str, list[dict[str, float]]] = {"one": [], "job": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for mode in (("one", "job") if r % 2 == 0 else ("job", "one")):
                res = run(Path(tmp) / f"{r}-{mode}", mode, a)
                got[mode].append(res)
                print(f"round {r + 1}/{a.rounds} {mode}: {res['per_host']:.1f} batches/s "
                      f"per host ({res['batches']} batches)", flush=True)
    med = {m: statistics.median(x["per_host"] for x in v) for m, v in got.items()}
    cpu = statistics.median(x["coordinator_cpu_per_unit_ms"] for x in got["job"])
    print(f"one host: {med['one']:.1f} batches/s; {a.hosts} hosts of one job: "
          f"{med['job']:.1f} batches/s per host; ratio {med['job'] / med['one']:.3f}; "
          f"coordinator CPU {cpu:.3f} ms per unit")
    if a.json:
        a.json.write_text(json.dumps({"median": med, "ratio": med["job"] / med["one"],
                                      "coordinator_cpu_ms_per_unit": cpu, "rounds": got},
                                     indent=1))


if __name__ == "__main__":
    main()
