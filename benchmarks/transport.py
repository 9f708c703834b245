"""Transport benchmark: feedline's broker against plain ZeroMQ, same transports, same run.

Three ways to move constant 64x224x224x3 uint8 batches with int32 labels from a producer
process to a consumer (this process), each with its sender in its own process:

- ``feedline``: ``feedline producer`` -> tcp -> ``feedline broker`` -> ipc -> RemoteDataZMQ
- ``relay``:    PUSH -> tcp -> ``zmq.proxy`` (PULL/PUSH, own process) -> ipc -> PULL
- ``direct``:   PUSH -> tcp -> PULL

The consumer turns every batch into numpy views (np.frombuffer) and touches nothing else.
Rounds alternate between the three; the report gives medians and ratios to the relay.

    python benchmarks/transport.py --rounds 3 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import yaml
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from consumer import RemoteDataZMQ  # noqa: E402
from feedline.procs import Child, Daemon, free_port, wait_for  # noqa: E402

HWM = 4  # plain ZeroMQ queues as deep as feedline's credit window, so memory is comparable

SENDER = textwrap.dedent("""
    import sys, numpy as np, zmq
    addr, n, side, HWM = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    images = np.zeros((n, side, side, 3), np.uint8)
    labels = np.zeros(n, np.int32)
    header = b"batch"  # plain ZeroMQ: no real header, the cheapest possible framing
    s = zmq.Context().socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, HWM)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    while True:
        s.send_multipart([header, images, labels], copy=False)
""")

RELAY = textwrap.dedent("""
    import sys, zmq
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    hwm = int(sys.argv[3])
    for s in (front, back):
        s.setsockopt(zmq.RCVHWM, hwm); s.setsockopt(zmq.SNDHWM, hwm); s.setsockopt(zmq.LINGER, 0)
    front.bind(sys.argv[1]); back.bind(sys.argv[2])
    zmq.proxy(front, back)
""")


def _consume_plain(sock: zmq.Socket, n: int, side: int, seconds: float) -> tuple[int, float]:
    def one() -> int:
        frames = sock.recv_multipart(copy=False)
        images = np.frombuffer(frames[1].buffer, np.uint8).reshape(n, side, side, 3)
        labels = np.frombuffer(frames[2].buffer, np.int32)
        return images.nbytes + labels.nbytes

    for _ in range(10):  # warm up: connections made, pipes full
        one()
    count, nbytes, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        nbytes += one()
        count += 1
    return nbytes, time.perf_counter() - t0


def run_direct(work: Path, n: int, side: int, seconds: float) -> float:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, HWM)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    argv = [f"tcp://127.0.0.1:{port}", str(n), str(side), str(HWM)]
    sender = python_child(SENDER, argv, work / "s.log")
    try:
        nbytes, dt = _consume_plain(pull, n, side, seconds)
    finally:
        sender.stop()
        pull.close(0)
        ctx.term()
    return nbytes / dt / 1e9


def run_relay(work: Path, n: int, side: int, seconds: float) -> float:
    front = f"tcp://127.0.0.1:{free_port()}"
    back = f"ipc://{work}/relay.sock"
    relay = python_child(RELAY, [front, back, str(HWM)], work / "relay.log")
    sender = python_child(SENDER, [front, str(n), str(side), str(HWM)], work / "s.log")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, HWM)
    pull.connect(back)
    try:
        nbytes, dt = _consume_plain(pull, n, side, seconds)
    finally:
        sender.stop()
        relay.stop()
        pull.close(0)
        ctx.term()
    return nbytes / dt / 1e9


def run_feedline(work: Path, n: int, side: int, seconds: float) -> float:
    ingress = f"tcp://127.0.0.1:{free_port()}"
    egress = f"ipc://{work}/feedline.sock"
    cfg = work / "fake.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [[n, side, side, 3], [n]], "dtypes": ["uint8", "int32"], "random": False,
        "size": 100000}}}))
    broker = Daemon("broker", ["--ingress", ingress, "--egress", egress, "--metrics-port", "0",
                               "--log-level", "WARNING"], work / "broker.log")
    prod = Daemon("producer", ["--config", str(cfg), "--broker", ingress, "--log-level",
                               "WARNING"], work / "producer.log")
    try:
        wait_for(lambda: Path(egress[6:]).exists(), 30, what="broker")
        with RemoteDataZMQ(egress, timeout=60) as src:
            it = iter(src)
            for _ in range(10):
                next(it)
            count, nbytes, t0 = 0, 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                images, labels = next(it)
                nbytes += images.nbytes + labels.nbytes
                count += 1
            dt = time.perf_counter() - t0
    finally:
        prod.stop()
        broker.stop()
    return nbytes / dt / 1e9


def python_child(script: str, args: list[str], log_path: Path) -> Child:  # noqa: N802
    """A child ``python -c SCRIPT ARGS`` (the plain-ZeroMQ peers)."""
    return Child([sys.executable, "-c", script, *args], log_path)


RUNS = {"feedline": run_feedline, "relay": run_relay, "direct": run_direct}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run")
    ap.add_argument("--batch", type=int, default=64, help="images per batch")
    ap.add_argument("--side", type=int, default=224, help="image side")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    results: dict[str, list[float]] = {k: [] for k in RUNS}
    mb = (args.batch * args.side * args.side * 3 + 4 * args.batch) / 1e6
    print(f"batches of {mb:.1f} MB, {args.rounds} rounds x {args.seconds:.0f}s per variant")
    with tempfile.TemporaryDirectory(prefix="feedline-bench-") as tmp:
        for r in range(args.rounds):
            for name, fn in RUNS.items():
                gbps = fn(Path(tmp), args.batch, args.side, args.seconds)
                results[name].append(gbps)
                print(f"  round {r + 1} {name:<9} {gbps:6.2f} GB/s  "
                      f"{gbps * 1e3 / mb:7.1f} batches/s", flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{'variant':<10} {'median GB/s':>12} {'batches/s':>10} {'vs relay':>9}")
    for k, v in med.items():
        print(f"{k:<10} {v:>12.2f} {v * 1e3 / mb:>10.1f} {v / med['relay']:>8.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": med}, indent=2))


if __name__ == "__main__":
    main()
