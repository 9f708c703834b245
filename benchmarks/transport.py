"""Transport benchmark: feedline against plain ZeroMQ and tensorpack, same batches, same run.

Ways to move constant 64x224x224x3 uint8 batches with int32 labels from a producer process to
a consumer process (each side its own process, every variant the same):

- ``feedline``:  ``feedline producer`` -> tcp -> ``feedline broker`` -> ipc -> RemoteDataZMQ
- ``direct``:    ``feedline producer`` -> tcp -> ``RemoteDataZMQ(bind=True)``: the trainer
                 serves its producers, one hop (direct mode)
- ``before``, ``direct-before``: ``feedline`` and ``direct`` with another checkout of
                 feedline (``--before DIR``): the code as it was, measured in the same run
                 (a change must not make either slower)
- ``relay``:     PUSH -> tcp -> ``zmq.proxy`` (PULL/PUSH, own process) -> ipc -> PULL
- ``raw``:       PUSH -> tcp -> PULL, one hop, the cheapest framing there is
- ``raw-threads``: the same with feedline's thread layout and nothing else: at each end the
                 socket is owned by an I/O thread, and batches pass through a bounded queue
                 to or from the owner thread (what the protocol adds is absent)
- ``raw-credit``: raw-threads plus a credit loop: the consumer grants batches back over the
                 same connection (ROUTER <- DEALER), one small message per batch, and the
                 sender sends only what was granted; windows as direct mode's (8 in the
                 consumer, 4 per sender). What credit flow control costs by itself
- ``tensorpack``: tensorpack's ``send_dataflow_zmq`` -> tcp -> its ``RemoteDataZMQ`` (msgpack)

The consumers turn every batch into numpy arrays (views where the library gives views) and
touch nothing else. Rounds alternate between the variants; the report gives medians and the
ratios of each to the relay and to raw.

    python benchmarks/transport.py --rounds 3 --seconds 5 [--before ../feedline-old]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from feedline.procs import Child, free_port, wait_for  # noqa: E402

HWM = 4  # plain ZeroMQ queues as deep as feedline's credit windows, so memory is comparable

# Every plain ZeroMQ sender: its arguments and the constant batch (ADDR N SIDE [HWM]).
_BATCH = """
    import queue, sys, threading, numpy as np, zmq
    addr, n, side = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    HWM = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    images = np.zeros((n, side, side, 3), np.uint8)
    labels = np.zeros(n, np.int32)
"""

# With feedline's thread layout: the owner thread hands each batch to an I/O thread that owns
# the socket (``io``, defined before this), through a bounded queue.
_OWNER = """
    q = queue.Queue(maxsize=1)
    threading.Thread(target=io, daemon=True).start()
    while True:
        q.put([b"batch", images, labels])
"""

SENDER = textwrap.dedent(_BATCH + """
    header = b"batch"  # plain ZeroMQ: no real header, the cheapest possible framing
    s = zmq.Context().socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, HWM)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    while True:
        s.send_multipart([header, images, labels], copy=False)
""")

# The same, with feedline's thread layout and nothing else (at both ends).
SENDER_THREADS = textwrap.dedent(_BATCH + """
    def io():
        s = zmq.Context().socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, HWM)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        while True:
            s.send_multipart(q.get(), copy=False)
""" + _OWNER)

# The same with a credit loop: the I/O thread sends only what the consumer granted (a DEALER
# that says hello, then reads grants: ASCII counts), as feedline's producers do.
SENDER_CREDIT = textwrap.dedent(_BATCH + """
    def io():
        s = zmq.Context().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        s.send(b"hello")
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        credit, head = 0, None
        while True:
            while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                credit += int(s.recv())
            while credit > 0:
                if head is None:
                    try:
                        head = q.get_nowait()
                    except queue.Empty:
                        break
                s.send_multipart(head, copy=False)
                head, credit = None, credit - 1
            poller.poll(5)
""" + _OWNER)

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

TP_SENDER = textwrap.dedent("""
    import sys, numpy as np
    from tensorpack.dataflow import DataFlow
    from tensorpack.dataflow.remote import send_dataflow_zmq
    addr, n, side = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    class Const(DataFlow):
        def __iter__(self):
            images = np.zeros((n, side, side, 3), np.uint8)
            labels = np.zeros(n, np.int32)
            while True:
                yield [images, labels]
    send_dataflow_zmq(Const(), addr, hwm=4)
""")

# The measuring consumers: run in their own process, print {"bytes": B, "seconds": S}.
CONSUMER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    kind, addr, n, side, seconds = sys.argv[1:6]
    n, side, seconds = int(n), int(side), float(seconds)
    def arrays(frames):  # plain ZeroMQ's image and label frames as numpy views
        return (np.frombuffer(frames[0].buffer, np.uint8).reshape(n, side, side, 3),
                np.frombuffer(frames[1].buffer, np.int32))
    if kind in ("feedline", "feedline-direct"):
        from feedline.consumer import RemoteDataZMQ
        # Direct mode: its window is every batch in flight (queued here or granted); plain
        # ZeroMQ holds HWM batches at each end: the same depth is 2 x HWM.
        window = 2 * 4 if kind == "feedline-direct" else 4
        # bind= only where it is needed: --before may be a checkout that predates it.
        extra = {"bind": True} if kind == "feedline-direct" else {}
        src = RemoteDataZMQ(addr, timeout=60, window=window, **extra)
        it = iter(src)
        def one():
            images, labels = next(it)
            return images.nbytes + labels.nbytes
    elif kind == "plain-credit":  # an I/O thread grants what the queue has room for
        import queue, threading, zmq
        WINDOW, PER_SENDER = 8, 4  # direct mode's: the trainer's window, a producer's
        q = queue.Queue(maxsize=WINDOW)
        def io():
            sock = zmq.Context().socket(zmq.ROUTER)
            sock.setsockopt(zmq.RCVHWM, WINDOW + 16)
            sock.bind(addr)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            sender, granted = None, 0  # granted: not arrived yet
            while True:
                poller.poll(5)
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    f = sock.recv_multipart(copy=False)
                    sender = f[0].bytes
                    if len(f) == 4:  # [sender, tag, images, labels]
                        granted -= 1
                        q.put_nowait(arrays(f[2:]))
                room = min(WINDOW - q.qsize() - granted, PER_SENDER - granted)
                if sender is not None and room > 0:
                    sock.send_multipart([sender, str(room).encode()])
                    granted += room
        threading.Thread(target=io, daemon=True).start()
        def one():
            images, labels = q.get()
            return images.nbytes + labels.nbytes
    elif kind == "tensorpack":
        from tensorpack.dataflow.remote import RemoteDataZMQ as TPRemote
        src = TPRemote(addr, hwm=4)
        src.reset_state()
        it = iter(src)
        def one():
            images, labels = next(it)
            return images.nbytes + labels.nbytes
    else:
        import queue, threading, zmq
        sock = zmq.Context().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 4)
        (sock.bind if kind.startswith("plain-bind") else sock.connect)(addr)
        def recv():
            a, b = arrays(sock.recv_multipart(copy=False)[1:])
            return a.nbytes + b.nbytes
        if kind == "plain-bind-threads":  # an I/O thread owns the socket, a queue between
            q = queue.Queue(maxsize=8)
            def io():
                while True:
                    q.put(recv())
            threading.Thread(target=io, daemon=True).start()
            one = q.get
        else:
            one = recv
    for _ in range(10):  # warm up: connections made, pipes full
        one()
    count, nbytes, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        nbytes += one()
        count += 1
    print(json.dumps({"bytes": nbytes, "seconds": time.perf_counter() - t0}), flush=True)
    import os
    os._exit(0)
""")


class Run:
    """One variant's processes in a work directory; :meth:`measure` returns GB/s."""

    def __init__(self, work: Path, n: int, side: int, seconds: float) -> None:
        self.work, self.n, self.side, self.seconds = work, n, side, seconds
        self.children: list[Child] = []

    def child(self, argv: list[str], name: str, tree: Path = ROOT) -> Child:
        env = {"PYTHONPATH": str(tree), "TF_CPP_MIN_LOG_LEVEL": "3",
               "TENSORPACK_SERIALIZE": "msgpack"}
        # cwd: ``python -m`` puts the working directory first on the path; the tree measured
        # must be the one on PYTHONPATH, not whatever checkout we were started from.
        c = Child(argv, self.work / f"{name}.log", env=env, cwd=self.work)
        self.children.append(c)
        return c

    def python(self, script: str, args: list[str], name: str, tree: Path = ROOT) -> Child:
        return self.child([sys.executable, "-c", script, *args], name, tree)

    def consume(self, kind: str, addr: str, tree: Path = ROOT) -> float:
        env = {**os.environ, "PYTHONPATH": str(tree), "TF_CPP_MIN_LOG_LEVEL": "3",
               "TENSORPACK_SERIALIZE": "msgpack"}
        out = subprocess.run([sys.executable, "-c", CONSUMER, kind, addr, str(self.n),
                              str(self.side), str(self.seconds)], env=env, cwd=self.work,
                             capture_output=True, text=True, timeout=self.seconds + 120)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"{kind} consumer failed: {out.stderr[-2000:]}")
        r = json.loads(lines[-1])
        return float(r["bytes"] / r["seconds"] / 1e9)

    def close(self) -> None:
        for c in reversed(self.children):
            c.stop(timeout=5)


def via_broker(run: Run, tree: Path) -> float:
    ingress = f"tcp://127.0.0.1:{free_port()}"
    egress = f"ipc://{run.work}/feedline.sock"
    cfg = run.work / "fake.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [[run.n, run.side, run.side, 3], [run.n]], "dtypes": ["uint8", "int32"],
        "random": False, "size": 100000}}}))
    run.child([sys.executable, "-m", "feedline.broker", "--ingress", ingress, "--egress", egress,
               "--metrics-port", "0", "--log-level", "WARNING"], "broker", tree)
    run.child([sys.executable, "-m", "feedline.producer", "--config", str(cfg), "--broker", ingress,
               "--log-level", "WARNING"], "producer", tree)
    wait_for(lambda: Path(egress[6:]).exists(), 30, what="broker")
    return run.consume("feedline", egress, tree)


def direct(run: Run, tree: Path = ROOT) -> float:
    addr = f"tcp://127.0.0.1:{free_port()}"
    cfg = run.work / "fake.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [[run.n, run.side, run.side, 3], [run.n]], "dtypes": ["uint8", "int32"],
        "random": False, "size": 100000}}}))
    run.child([sys.executable, "-m", "feedline.producer", "--config", str(cfg), "--broker", addr,
               "--log-level", "WARNING"], "producer", tree)
    return run.consume("feedline-direct", addr, tree)


def relay(run: Run) -> float:
    front = f"tcp://127.0.0.1:{free_port()}"
    back = f"ipc://{run.work}/relay.sock"
    run.python(RELAY, [front, back, str(HWM)], "relay")
    run.python(SENDER, [front, str(run.n), str(run.side), str(HWM)], "sender")
    return run.consume("plain", back)


def raw(run: Run) -> float:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.python(SENDER, [addr, str(run.n), str(run.side), str(HWM)], "sender")
    return run.consume("plain-bind", addr)


def raw_threads(run: Run) -> float:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.python(SENDER_THREADS, [addr, str(run.n), str(run.side), str(HWM)], "sender")
    return run.consume("plain-bind-threads", addr)


def raw_credit(run: Run) -> float:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.python(SENDER_CREDIT, [addr, str(run.n), str(run.side)], "sender")
    return run.consume("plain-credit", addr)


def tensorpack(run: Run) -> float:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.python(TP_SENDER, [addr, str(run.n), str(run.side)], "tp-sender")
    return run.consume("tensorpack", addr)


def variants(before: Path | None) -> dict[str, Callable[[Run], float]]:
    out: dict[str, Callable[[Run], float]] = {"feedline": lambda r: via_broker(r, ROOT)}
    if before is not None:
        out["before"] = lambda r: via_broker(r, before)
    out["direct"] = direct
    if before is not None:
        out["direct-before"] = lambda r: direct(r, before)
    out["relay"] = relay
    out["raw"] = raw
    out["raw-threads"] = raw_threads
    out["raw-credit"] = raw_credit
    if importlib.util.find_spec("tensorpack") is not None:
        out["tensorpack"] = tensorpack
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run")
    ap.add_argument("--batch", type=int, default=64, help="images per batch")
    ap.add_argument("--side", type=int, default=224, help="image side")
    ap.add_argument("--before", type=Path, default=None,
                    help="another feedline checkout to measure beside this one")
    ap.add_argument("--only", nargs="*", default=None, help="variants to run (default all)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    runs = variants(args.before)
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only}
    results: dict[str, list[float]] = {k: [] for k in runs}
    mb = (args.batch * args.side * args.side * 3 + 4 * args.batch) / 1e6
    print(f"batches of {mb:.1f} MB, {args.rounds} rounds x {args.seconds:.0f}s per variant")
    with tempfile.TemporaryDirectory(prefix="feedline-bench-") as tmp:
        for r in range(args.rounds):
            for name, fn in runs.items():
                work = Path(tmp) / f"{name}-{r}"
                work.mkdir()
                run = Run(work, args.batch, args.side, args.seconds)
                try:
                    gbps = fn(run)
                finally:
                    run.close()
                results[name].append(gbps)
                print(f"  round {r + 1} {name:<11} {gbps:6.2f} GB/s  "
                      f"{gbps * 1e3 / mb:7.1f} batches/s", flush=True)
                time.sleep(0.5)  # let the previous round's sockets go
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{'variant':<11} {'median GB/s':>12} {'batches/s':>10} {'vs relay':>9} "
          f"{'vs raw':>7} {'vs tensorpack':>14}")
    for k, v in med.items():
        ratios = [f"{v / med[ref]:.2f}x" if med.get(ref) else "-"
                  for ref in ("relay", "raw", "tensorpack")]
        print(f"{k:<11} {v:>12.2f} {v * 1e3 / mb:>10.1f} {ratios[0]:>9} {ratios[1]:>7} "
              f"{ratios[2]:>14}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "median": med}, indent=2))


if __name__ == "__main__":
    main()
