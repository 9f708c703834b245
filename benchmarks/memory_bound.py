"""The broker's peak memory under each memory scenario of issue 16, against the formula.

The bound the broker promises (docs/architecture.md): everything a peer can make it hold is
within ``--max-bytes`` (buffered batches + batches in flight to consumers + credit granted),
plus a fixed overhead (interpreter, libzmq, socket buffers: 48 MiB is what the tests allow),
plus, for a message of many frames, what libzmq holds per frame before any can be read (a
``zmq_msg_t``, 64 bytes). Each scenario runs ``python -m feedline.broker`` with a budget, drives it
with real producer processes, a tensorpack sender or a hand-played peer, samples the broker's
resident memory every 20 ms (psutil) and reports the peak growth over the idle broker.

- ``huge``:       --max-bytes 16MiB, 8 producers of 64 MiB batches (each must be refused
                  before it is sent)
- ``many``:       --max-bytes 64MiB, 8 producers of 16 MiB batches, no consumer
- ``hog``:        --max-bytes 32MiB, a producer of 1 MiB batches, a consumer that says HELLO
                  with window 4096, never reads and says HELLO again twice
- ``frames``:     --max-bytes 16MiB, honest traffic, one message of 1,000,000 empty frames
- ``tensorpack``: --max-bytes 8MiB, tensorpack's send_dataflow_zmq pushing 4 MiB arrays as
                  fast as it can, no consumer (needs tensorpack: skipped without it)

    python benchmarks/memory_bound.py --rounds 2 [--only hog,frames] [--json out]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hostile import RawPeer, empty_frames, zmtp_dealer  # noqa: E402 (benchmarks/hostile.py)

from feedline.procs import Child, free_port, wait_for  # noqa: E402
from feedline.scrape import scrape  # noqa: E402

MiB = 1 << 20
# the fixed part of the bound (what tests/flow/test_flow_memory_bound.py allows)
OVERHEAD = 48 * MiB
ZMQ_MSG_T = 64  # bytes libzmq holds per frame of a message before it can be read
FRAMES = 1_000_000


class RssSampler:
    """A process's resident memory every ``interval`` s from a thread; ``peak_growth`` over
    the RSS when sampling started."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.base = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    @property
    def peak_growth(self) -> int:
        return self.peak - self.base

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Run:
    """One scenario's processes in ``work``: a broker with ``budget``, and what it starts."""

    def __init__(self, work: Path, budget: int, tensorpack: bool = False) -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        port, self.metrics_port = free_port(), free_port()
        self.ingress, self.egress = f"tcp://127.0.0.1:{port}", f"ipc://{work}/egress.sock"
        self.children: list[Child] = []
        self.tp = f"tcp://127.0.0.1:{free_port()}" if tensorpack else None
        extra = ["--tensorpack-ingress", self.tp] if self.tp else []
        self.broker = self.python(["-m", "feedline.broker", "--ingress", self.ingress, "--egress",
                                   self.egress, "--max-bytes", str(budget), "--metrics-port",
                                   str(self.metrics_port), "--metrics-addr", "127.0.0.1",
                                   *extra], "broker")
        wait_for(lambda: scrape(self.metrics_port).error is None or not self.broker.alive(),
                 30, what="broker metrics")
        if not self.broker.alive():
            raise RuntimeError(self.broker.log_text())
        time.sleep(0.5)  # let the idle broker's RSS settle before it becomes the base
        self.rss = RssSampler(self.broker.pid)

    def python(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> Child:
        c = Child([sys.executable, *argv], self.work / f"{name}.log",
                  env={"PYTHONPATH": str(ROOT), **(env or {})}, cwd=ROOT)
        self.children.append(c)
        return c

    def producer(self, name: str, shape: int, size: int = 1000,
                 epochs: int | None = None) -> Child:
        cfg = self.work / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({"source": {"fake": {
            "shapes": [[shape]], "dtypes": ["uint8"], "random": False, "size": size}},
            "epochs": epochs}))
        return self.python(["-m", "feedline.producer", "--config", str(cfg), "--broker",
                            self.ingress,
                            "--id", name], name)

    def metric(self, name: str, **labels: str) -> float:
        got = scrape(self.metrics_port, timeout=5)
        return got.total(name, **labels) if got.error is None else 0.0

    def close(self) -> None:
        self.rss.stop()
        for c in reversed(self.children):
            c.stop(timeout=10)


def _observe(seconds: float, until: Callable[[], bool] = lambda: False) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        time.sleep(0.1)


def huge(run: Run) -> str:
    prods = [run.producer(f"huge{i}", 64 * MiB, size=4, epochs=1) for i in range(8)]
    _observe(30, until=lambda: not any(p.alive() for p in prods))
    refused = sum(1 for p in prods if not p.alive() and p.proc.returncode != 0
                  and "--max-bytes" in p.log_text())
    return f"{refused} of 8 producers refused (exit 1 naming --max-bytes)"


def many(run: Run) -> str:
    for i in range(8):
        run.producer(f"big{i}", 16 * MiB)
    _observe(30, until=lambda: run.metric("feedline_broker_peers", role="producer") >= 8)
    _observe(4)  # everyone connected: what they can push, they push now
    held = run.metric("feedline_broker_buffer_bytes")
    return f"{held / MiB:.0f} MiB buffered at the end"


def hog(run: Run) -> str:
    run.producer("mib", MiB)
    ctx = zmq.Context()
    peer = RawPeer(ctx, run.egress, rcvhwm=1)
    try:
        session = 1
        peer.hello_consumer("hog", 4096, session)
        for _ in range(3):
            end = time.monotonic() + 8 / 3
            while time.monotonic() < end:
                peer.heartbeat()
                time.sleep(0.2)
            session += 1
            peer.registration += 1
            peer.hello_consumer("hog", 4096, session)  # a fresh window on the same connection
        inflight = run.metric("feedline_broker_inflight_bytes")
    finally:
        peer.close()
        ctx.destroy(linger=0)
    return f"{inflight / MiB:.0f} MiB in flight to the hog at the end"


_CONSUMER = textwrap.dedent("""
    import sys
    from feedline.consumer import RemoteDataZMQ
    with RemoteDataZMQ(sys.argv[1], timeout=None) as src:
        for _ in src:
            pass
""")


def frames(run: Run) -> str:
    run.producer("steady", 1024)
    run.python(["-c", _CONSUMER, run.egress], "consumer")
    wait_for(lambda: run.metric("feedline_broker_forwarded_batches_total") >= 20, 30,
             what="honest traffic")
    t0 = time.monotonic()
    s = zmtp_dealer(run.ingress)
    try:
        s.sendall(empty_frames(FRAMES))
        wait_for(lambda: run.metric("feedline_broker_rejected_messages_total") >= 1, 120,
                 what="the message refused")
    finally:
        s.close()
    seconds = time.monotonic() - t0
    before = run.metric("feedline_broker_forwarded_batches_total")
    wait_for(lambda: run.metric("feedline_broker_forwarded_batches_total") >= before + 20, 30,
             what="honest traffic after")
    dropped = run.metric("feedline_broker_dropped_peers_total", reason="timeout")
    return f"refused after {seconds:.1f} s; {dropped:.0f} honest peers dropped"


_TP_SENDER = textwrap.dedent("""
    import sys
    import numpy as np
    from tensorpack.dataflow import DataFromList
    from tensorpack.dataflow.remote import send_dataflow_zmq
    a = np.ones(int(sys.argv[2]), np.uint8)
    send_dataflow_zmq(DataFromList([[a]] * 8, shuffle=False), sys.argv[1], hwm=4)
""")
TP_ENV = {"TENSORPACK_SERIALIZE": "msgpack", "TF_CPP_MIN_LOG_LEVEL": "3"}


def tensorpack(run: Run) -> str:
    assert run.tp is not None
    run.python(["-c", _TP_SENDER, run.tp, str(4 * MiB)], "tensorpack", env=TP_ENV)
    wait_for(lambda: run.metric("feedline_broker_received_batches_total",
                                producer="tensorpack") >= 1, 60, what="the first batch")
    _observe(5)
    held = run.metric("feedline_broker_buffer_bytes")
    return f"{held / MiB:.0f} MiB buffered at the end"


@dataclass(frozen=True)
class Scenario:
    run: Callable[[Run], str]
    budget: int
    frames: int = 0  # messages of many frames: 64 bytes each counted in the bound
    before: str = ""  # the figure before the fix


SCENARIOS = {
    "huge": Scenario(huge, 16 * MiB, before="RSS 62 -> 2111 MiB; 384-448 MiB buffered"),
    "many": Scenario(many, 64 * MiB, before="+417 MiB (384 MiB buffered)"),
    "hog": Scenario(hog, 32 * MiB, before="67 -> 628 -> 1189 -> 1436 MiB across re-HELLOs"),
    "frames": Scenario(frames, 16 * MiB, frames=FRAMES,
                       before="+255-260 MiB (1M frames); +1041 MiB (4M)"),
    "tensorpack": Scenario(tensorpack, 8 * MiB, before="+132 MiB"),
}


def measure(name: str, work: Path) -> dict[str, Any]:
    sc = SCENARIOS[name]
    run = Run(work, sc.budget, tensorpack=name == "tensorpack")
    try:
        what = sc.run(run)
    finally:
        run.close()
    bound = sc.budget + OVERHEAD + ZMQ_MSG_T * sc.frames
    return {"scenario": name, "budget": sc.budget, "bound": bound,
            "base_rss": run.rss.base, "peak_growth": run.rss.peak_growth,
            "within": run.rss.peak_growth <= bound, "what": what, "before": sc.before}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| scenario | --max-bytes | bound (budget + 48 MiB [+ 64 B/frame]) | peak growth "
             "(each round) | within | what the broker did | before (issue 16) |",
             "|---|---|---|---|---|---|---|"]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by.setdefault(r["scenario"], []).append(r)
    for name, rs in by.items():
        peaks = [r["peak_growth"] / MiB for r in rs]
        lines.append(
            f"| {name} | {rs[0]['budget'] / MiB:.0f} MiB | {rs[0]['bound'] / MiB:.0f} MiB | "
            f"**{max(peaks):.0f} MiB** ({' / '.join(f'{p:.0f}' for p in peaks)}) | "
            f"{'yes' if all(r['within'] for r in rs) else 'NO'} | {rs[-1]['what']} | "
            f"{rs[0]['before']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each scenario")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated scenarios (default: all of {', '.join(SCENARIOS)})")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = ap.parse_args()
    names = list(SCENARIOS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    if "tensorpack" in names and importlib.util.find_spec("tensorpack") is None:
        print("tensorpack: skipped (pip install tensorpack==0.11)", flush=True)
        names.remove("tensorpack")
    results = []
    with tempfile.TemporaryDirectory(prefix="feedline-memory-") as tmp:
        for r in range(args.rounds):
            for name in names:
                res = measure(name, Path(tmp) / f"{name}-{r}")
                results.append(res)
                print(f"  {name} round {r + 1}/{args.rounds}: peak growth "
                      f"{res['peak_growth'] / MiB:.1f} MiB (bound {res['bound'] / MiB:.0f} MiB, "
                      f"idle broker {res['base_rss'] / MiB:.0f} MiB); {res['what']}", flush=True)
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "cpus": os.cpu_count(),
                                         "results": results}, indent=1))
    return 0 if all(r["within"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
