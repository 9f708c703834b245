"""An idle broker's CPU after a flood of exact HELLOs on new stream names (issue 22, finding 14).

    python benchmarks/exact_streams.py
    python benchmarks/exact_streams.py --root /path/to/another/checkout   # its broker instead

Starts a broker (``python -m feedline.broker`` from ``--root``, with ``--state-dir`` in a
temporary directory and the default heartbeats), measures its CPU over ``--seconds`` while
nothing happens, then ``--connections`` connections each send ten exact HELLOs a second, each
naming a stream of its own, for ``--flood`` seconds, and leave. The broker's CPU is measured
again just after they left and once more after the reclaim time (4 heartbeat timeouts), with
the number of journal files in the state directory. Prints one table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from feedline.procs import Child, free_port, wait_for  # noqa: E402
from feedline.protocol import messages as m  # noqa: E402


def cpu(proc: psutil.Process, seconds: float) -> float:
    """Percent of one core the process used over ``seconds``."""
    t0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
    time.sleep(seconds)
    return 100 * (sum(proc.cpu_times()[:2]) - c0) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose broker runs")
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--flood", type=float, default=5.0, help="seconds of HELLOs")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per CPU measurement")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="feedline-streams-") as tmp:
        state = Path(tmp) / "state"
        port = free_port()
        ingress = f"tcp://127.0.0.1:{port}"
        # cwd: python -m puts the working directory first on the path; --root is the tree.
        broker = Child([sys.executable, "-m", "feedline.broker", "--ingress", ingress,
                        "--egress", f"ipc://{tmp}/egress.sock", "--metrics-port", "0",
                        "--state-dir", str(state), "--log-level", "ERROR"],
                       Path(tmp) / "broker.log", env={"PYTHONPATH": str(a.root)},
                       cwd=Path(tmp))
        try:
            wait_for(lambda: Path(f"{tmp}/egress.sock").exists() or not broker.alive(), 30,
                     what="broker")
            proc = psutil.Process(broker.pid)
            rows = [("idle, before", cpu(proc, a.seconds), 0)]
            sent = 0
            with zmq.Context() as ctx:
                socks = [ctx.socket(zmq.DEALER) for _ in range(a.connections)]
                for s in socks:
                    s.linger = 0
                    s.connect(ingress)
                end = time.monotonic() + a.flood
                while time.monotonic() < end:
                    t0 = time.monotonic()
                    for s in socks:
                        for _ in range(10):
                            s.send(m.encode(m.ProducerHello(
                                producer=f"x{sent}", session=sent + 1, stream=f"s{sent}",
                                registration=sent + 1, delivery=m.EXACT, dataset_size=100,
                                unit_size=10)))
                            sent += 1
                    time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
                for s in socks:
                    s.close(linger=0)
            journals = len(list(state.glob("*.exact.jsonl")))
            rows.append((f"idle, just after {sent} HELLOs", cpu(proc, a.seconds), journals))
            time.sleep(4 * 5.0)  # the reclaim time: 4 heartbeat timeouts (default 5 s)
            rows.append(("idle, 20 s later", cpu(proc, a.seconds),
                         len(list(state.glob("*.exact.jsonl")))))
        finally:
            broker.stop(timeout=10)
    print(f"broker of {a.root}, {a.connections} connections x 10 HELLOs/s for {a.flood:.0f} s")
    print("| moment | broker CPU (% of a core) | journal files |")
    print("|---|---|---|")
    for name, pct, files in rows:
        print(f"| {name} | {pct:.1f} | {files} |")


if __name__ == "__main__":
    main()
