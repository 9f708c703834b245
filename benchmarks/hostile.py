"""Honest throughput while hostile peers are refused, side by side in one run (issue 16).

For each attacker a real broker process (``python -m feedline.broker``,
                                         default budget and liveness),
an honest producer process (``python -m feedline.producer``: constant 1 MiB uint8 batches offered at
``--rate`` per second, or as fast as credit allows with ``--rate 0``) and an honest consumer
process (``RemoteDataZMQ``, counting the honest producer's batches it takes) run together.
Rounds alternate: ``--seconds`` of honest traffic alone, then as long with the attacker
running (its own process, started when the window opens), then the broker is given time to
forget the attacker (its peers back to one producer and one consumer). The report gives each
phase's batches/s per round, the medians, with / without (target: >= 0.9x), and what the
broker refused meanwhile (rejected messages, connections cut off, peers dropped).

Why an offered rate by default: on a machine without spare cores, an attacker process and the
honest pipeline share the CPU, so a saturated honest pipeline slows down whatever the broker
does. At a rate the machine can serve, with / without says whether the broker still serves
the honest peers; ``--rate 0`` measures the other question (what the attack costs in all).

Attackers (hand-played sockets, as a peer that does not run feedline's code would be):

- ``garbage``:   malformed messages on the ingress at a steady rate (random bytes, wrong
                 versions, unknown kinds, batches from nobody), 2000/s
- ``refused``:   8 registered producers spending all the credit they get on batches the
                 broker refuses (a datapoint list over max_container_len)
- ``no-credit``: a producer that sends 2x its window without waiting for credit: cut off,
                 it connects again and does it again, 10 times a second
- ``idle``:      8 registered producers that hold their credit and never send (they answer
                 the broker's REVOKE, as the protocol asks)
- ``idle-rehello``: the same, registering again every credit lease + 0.5 s (to get fresh
                 credit each time)
- ``hog``:       a consumer on the egress that says HELLO with window 4096, heartbeats, never
                 reads (RCVHWM 1), and says HELLO again every 2.7 s
- ``hello-flood``: 50 connections sending producer HELLOs with new ids, 2000/s in all
- ``frames``:    one message of 1,000,000 empty frames (ZMTP written by hand) every 3 s

    python benchmarks/hostile.py --rounds 3 --seconds 4 [--only garbage,hog] [--json out]

Needs nothing outside the repository (no root, no tensorpack). About 50 s per attacker with
the defaults (7 minutes for all eight).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import yaml
import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from feedline.procs import Child, free_port, wait_for  # noqa: E402
from feedline.protocol import messages as m  # noqa: E402
from feedline.scrape import Scrape, scrape  # noqa: E402
from tests.support.hand_protocol import (  # noqa: E402
    ARRAY,
    RAW_BATCH_BYTES,
    K,
    batch_header,
    empty_frames,
    pack,
    unpack,
    zmtp_dealer,
)

MiB = 1 << 20
LEASE = 2.0  # the broker's default credit lease (BrokerConfig.credit_lease)

# ------------------------------------------------------------------- hand-spoken protocol
# The frame builders are the tests' (tests/support/hand_protocol.py); the attackers' peer
# below differs from the tests' RawPeer: it re-registers on one connection and never blocks.










class RawPeer:
    """A DEALER that speaks the protocol by hand. Use it from one thread."""

    def __init__(self, ctx: zmq.Context, addr: str, rcvhwm: int = 1000) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.rcvhwm = rcvhwm
        self.sock.connect(addr)
        self.granted = 0  # the largest credit granted (absolute)
        self.sent = self.sent_bytes = 0
        self.registration = 1

    def hello_producer(self, pid: str, session: int, declared: int = RAW_BATCH_BYTES) -> None:
        """Register, and ask for credit for a batch of ``declared`` bytes at once (a new
        registration gets none until it asks): an attacker that holds credit asks for it."""
        self.granted = self.sent = self.sent_bytes = 0
        self.sock.send(m.encode(m.ProducerHello(producer=pid, session=session, next_seq=0,
                                                max_batch_bytes=declared,
                                                registration=self.registration)))
        self.sock.send(m.encode(m.Want(sent=0, sent_bytes=0, size=declared,
                                       registration=self.registration)))

    def hello_consumer(self, cid: str, window: int, session: int = 1) -> None:
        self.sock.send(m.encode(m.ConsumerHello(consumer=cid, session=session, window=window,
                                                max_bytes=1 << 40,
                                                registration=self.registration)))

    def heartbeat(self) -> None:
        try:
            self.sock.send(m.encode(m.Heartbeat()), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def send(self, frames: list[Any]) -> None:
        self.sent += 1
        self.sent_bytes += sum(len(f) for f in frames)
        self.sock.send_multipart(frames)

    def read(self, timeout_ms: int = 0) -> None:
        """Take what arrived; track credit and answer REVOKE as the protocol asks."""
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            h = unpack(self.sock.recv_multipart()[0])
            if h.get("k") == K.GRANT and isinstance(h.get("t"), int):
                self.granted = max(self.granted, h["t"])
            elif h.get("k") == K.REVOKE:
                self.granted = self.sent
                self.sock.send(m.encode(m.Returned(sent=self.sent, sent_bytes=self.sent_bytes,
                                                   registration=h.get("r", 1))))

    def close(self) -> None:
        self.sock.close(linger=0)








# ------------------------------------------------------------------------------ attackers
# Each runs in its own (spawned) process until ``stop`` is set, counting what it sent.


@dataclass
class Target:
    ingress: str
    egress: str


Attack = Callable[[Target, Any, Any, Any], None]


def _paced(rate: float) -> Callable[[], None]:
    """Call it once per message: sleeps so that messages go out at ``rate`` per second."""
    due = [time.monotonic()]

    def wait() -> None:
        due[0] += 1 / rate
        delay = due[0] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -1:
            due[0] = time.monotonic()  # fell behind: no catch-up burst
    return wait


def attack_garbage(t: Target, stop: Any, ready: Any, sent: Any) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.sndhwm = 1000
    s.connect(t.ingress)
    rng = random.Random(1)
    kinds = [
        lambda: [rng.randbytes(rng.randint(1, 200))],
        lambda: [msgpack.packb({"v": 99, "k": 1})],
        lambda: [pack(250, x=1)],
        lambda: [pack(K.GRANT, t="x")],
        lambda: [batch_header("nobody", 1, 0, [ARRAY(0)], [("<f4", [4])]), b"\0" * 16],
        lambda: [rng.randbytes(8), rng.randbytes(64), rng.randbytes(3)],
    ]
    pace = _paced(2000)
    ready.set()
    while not stop.is_set():
        try:
            s.send_multipart(rng.choice(kinds)(), zmq.NOBLOCK)
            sent.value += 1
        except zmq.Again:
            pass
        pace()
    s.close(0)
    ctx.term()


OVER_LIMIT = [0] * 3000  # a list longer than Limits.max_container_len (2048)


def attack_refused(t: Target, stop: Any, ready: Any, sent: Any) -> None:
    ctx = zmq.Context()
    peers = [RawPeer(ctx, t.ingress) for _ in range(8)]
    for i, p in enumerate(peers):
        p.hello_producer(f"refused{i}", 1000 + i)
    payload = b"\0" * 16
    ready.set()
    last_hb = 0.0
    while not stop.is_set():
        busy = False
        for i, p in enumerate(peers):
            p.read()
            while p.sent < p.granted:
                p.send([batch_header(f"refused{i}", 1000 + i, p.sent,
                                     [ARRAY(0), *OVER_LIMIT], [("<f4", [4])]), payload])
                sent.value += 1
                busy = True
        if time.monotonic() - last_hb > 0.3:
            for p in peers:
                p.heartbeat()
            last_hb = time.monotonic()
        if not busy:
            time.sleep(0.002)
    for p in peers:
        p.close()
    ctx.term()


def attack_no_credit(t: Target, stop: Any, ready: Any, sent: Any) -> None:
    ctx = zmq.Context()
    body = b"\0" * (64 * 1024)
    pace = _paced(10)
    ready.set()
    n = 0
    while not stop.is_set():
        n += 1
        p = RawPeer(ctx, t.ingress)
        p.hello_producer(f"greedy{n}", 5000 + n, declared=len(body) + 1024)
        for seq in range(8):  # the window is 4: the 5th has no credit
            p.send([batch_header(f"greedy{n}", 5000 + n, seq, [ARRAY(0)],
                                 [("|u1", [len(body)])]), body])
            sent.value += 1
        pace()
        p.close()
    ctx.term()


def _idle(t: Target, stop: Any, ready: Any, sent: Any, rehello: float | None) -> None:
    ctx = zmq.Context()
    peers = [RawPeer(ctx, t.ingress) for _ in range(8)]
    session = 2000

    def hello_all() -> None:
        nonlocal session
        for i, p in enumerate(peers):
            session += 1
            p.registration += 1
            p.hello_producer(f"idle{i}", session)
            sent.value += 1

    hello_all()
    ready.set()
    last = time.monotonic()
    while not stop.is_set():
        for p in peers:
            p.read()
            p.heartbeat()
        if rehello is not None and time.monotonic() - last > rehello:
            hello_all()
            last = time.monotonic()
        time.sleep(0.1)
    for p in peers:
        p.close()
    ctx.term()


def attack_idle(t: Target, stop: Any, ready: Any, sent: Any) -> None:
    _idle(t, stop, ready, sent, None)


def attack_idle_rehello(t: Target, stop: Any, ready: Any, sent: Any) -> None:
    _idle(t, stop, ready, sent, LEASE + 0.5)


def attack_hog(t: Target, stop: Any, ready: Any, sent: Any) -> None:
    ctx = zmq.Context()
    hog = RawPeer(ctx, t.egress, rcvhwm=1)
    session = 1
    hog.hello_consumer("hog", 4096, session)
    ready.set()
    last = time.monotonic()
    while not stop.is_set():
        hog.heartbeat()
        if time.monotonic() - last > 2.7:
            session += 1
            hog.registration += 1
            hog.hello_consumer("hog", 4096, session)  # a fresh window on the same connection
            sent.value += 1
            last = time.monotonic()
        time.sleep(0.2)
    hog.close()
    ctx.term()


def attack_hello_flood(t: Target, stop: Any, ready: Any, sent: Any) -> None:
    ctx = zmq.Context()
    peers = [RawPeer(ctx, t.ingress) for _ in range(50)]
    pace = _paced(2000)
    ready.set()
    n = 0
    while not stop.is_set():
        p = peers[n % len(peers)]
        p.hello_producer(f"flood{n}", 1 << 40 | n)
        n += 1
        sent.value += 1
        pace()
    for p in peers:
        p.close()
    ctx.term()


def attack_frames(t: Target, stop: Any, ready: Any, sent: Any) -> None:
    data = empty_frames(1_000_000)
    ready.set()
    while not stop.is_set():
        s = zmtp_dealer(t.ingress)
        try:
            s.sendall(data)
            sent.value += 1
        finally:
            s.close()
        stop.wait(3.0)


ATTACKS: dict[str, Attack] = {
    "garbage": attack_garbage,
    "refused": attack_refused,
    "no-credit": attack_no_credit,
    "idle": attack_idle,
    "idle-rehello": attack_idle_rehello,
    "hog": attack_hog,
    "hello-flood": attack_hello_flood,
    "frames": attack_frames,
}


class Attacker:
    """One attack in its own process; :meth:`stop` ends it (and kills it if it must)."""

    def __init__(self, name: str, target: Target) -> None:
        ctx = mp.get_context("spawn")
        self.stop_event, self.ready = ctx.Event(), ctx.Event()
        self.sent = ctx.Value("q", 0)
        self.proc = ctx.Process(target=ATTACKS[name], name=f"attack-{name}", daemon=True,
                                args=(target, self.stop_event, self.ready, self.sent))
        self.proc.start()
        if not self.ready.wait(60):
            self.stop()
            raise RuntimeError(f"attacker {name} did not start")

    def stop(self) -> int:
        self.stop_event.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        return int(self.sent.value)


# ------------------------------------------------------------------------- honest side

CONSUMER = textwrap.dedent("""
    import sys, threading, time
    from feedline.consumer import RemoteDataZMQ
    n = 0
    def ticker():
        while True:
            print(f"S {time.monotonic():.4f} {n}", flush=True)
            time.sleep(0.05)
    threading.Thread(target=ticker, daemon=True).start()
    with RemoteDataZMQ(sys.argv[1], timeout=None, return_meta=True) as src:
        for b in src:
            if b.producer == "honest":  # an attacker's valid batches are not counted
                n += 1
""")


class Paced:
    """The honest pipeline with ``--rate``: constant ``nbytes`` uint8 batches, ``rate`` per
    second against a schedule (time blocked on credit is not made up in a burst). Named in
    the producer's pipeline file as ``factory: hostile:Paced``."""

    def __init__(self, nbytes: int, rate: float) -> None:
        self.batch = np.zeros(nbytes, np.uint8)
        self.rate = rate

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        due = time.monotonic()
        while True:
            due = max(due + 1 / self.rate, time.monotonic() - 1 / self.rate)
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            yield [self.batch]


class Cluster:
    """A broker, the honest producer and the honest consumer, in ``work``."""

    def __init__(self, work: Path, batch_bytes: int, rate: float) -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        port, self.metrics_port = free_port(), free_port()
        self.target = Target(f"tcp://127.0.0.1:{port}", f"ipc://{work}/egress.sock")
        # benchmarks/ on the path: the producer's pipeline may be this module's Paced
        env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"}
        self.children: list[Child] = []

        def child(argv: list[str], name: str) -> Child:
            c = Child(argv, work / f"{name}.log", env=env, cwd=ROOT)
            self.children.append(c)
            return c

        self.broker = child([sys.executable, "-m", "feedline.broker", "--ingress",
                             self.target.ingress,
                             "--egress", self.target.egress, "--metrics-port",
                             str(self.metrics_port), "--metrics-addr", "127.0.0.1"], "broker")
        wait_for(lambda: self.scrape().error is None or not self.broker.alive(), 30,
                 what="broker metrics")
        cfg = work / "honest.yaml"
        if rate > 0:
            pipeline: dict[str, Any] = {"factory": "hostile:Paced",
                                        "args": {"nbytes": batch_bytes, "rate": rate}}
        else:  # as fast as the broker takes them
            pipeline = {"source": {"fake": {"shapes": [[batch_bytes]], "dtypes": ["uint8"],
                                            "random": False, "size": 1000}}}
        cfg.write_text(yaml.safe_dump({**pipeline, "epochs": None}))
        self.producer = child([sys.executable, "-m", "feedline.producer", "--config", str(cfg),
                               "--broker", self.target.ingress, "--id", "honest"], "producer")
        self.consumer = child([sys.executable, "-c", CONSUMER, self.target.egress], "consumer")
        wait_for(lambda: self.count_at(time.monotonic()) >= 50, 60, what="honest traffic")

    def scrape(self) -> Scrape:
        return scrape(self.metrics_port, timeout=5)

    def samples(self) -> list[tuple[float, int]]:
        out = []
        for line in (self.work / "consumer.log").read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "S":
                out.append((float(parts[1]), int(parts[2])))
        return out

    def count_at(self, t: float) -> int:
        """Batches the consumer had taken at time ``t`` (its last sample before it)."""
        n = 0
        for ts, c in self.samples():
            if ts > t:
                break
            n = c
        return n

    def rate(self, t0: float, t1: float) -> float:
        return (self.count_at(t1) - self.count_at(t0)) / (t1 - t0)

    def settle(self, timeout: float = 30.0) -> bool:
        """Wait until the broker counts only the honest peers again (the attacker's
        registrations dropped) and honest batches flow."""
        def calm() -> bool:
            s = self.scrape()
            return (s.error is None and s.total("feedline_broker_peers", role="producer") == 1
                    and s.total("feedline_broker_peers", role="consumer") == 1)
        try:
            wait_for(calm, timeout, interval=0.2, what="the broker to forget the attacker")
        except TimeoutError:
            return False
        n = self.count_at(time.monotonic())
        try:
            wait_for(lambda: self.count_at(time.monotonic()) > n + 20, timeout,
                     what="honest traffic")
        except TimeoutError:
            return False
        return True

    def alive(self) -> bool:
        return all(c.alive() for c in self.children)

    def close(self) -> None:
        for c in reversed(self.children):
            c.stop(timeout=10)


REFUSALS = ("feedline_broker_rejected_messages_total", "feedline_broker_cut_off_connections_total",
            "feedline_broker_dropped_peers_total", "feedline_broker_refused_batches_total")


def refusals(s: Scrape) -> dict[str, float]:
    return {name.removeprefix("feedline_broker_").removesuffix("_total"): s.total(name)
            for name in REFUSALS}


def measure(name: str, rounds: int, seconds: float, batch_bytes: int, rate: float,
            work: Path) -> dict:
    """Rounds of (without, with) for one attack on a fresh cluster."""
    cluster = Cluster(work / name, batch_bytes, rate)
    result: dict[str, Any] = {"scenario": name, "without": [], "with": [], "sent": [],
                              "refused": [], "settled": []}
    try:
        for r in range(rounds):
            t0 = time.monotonic()
            time.sleep(seconds)
            without = cluster.rate(t0, time.monotonic())
            before = refusals(cluster.scrape())
            attacker = Attacker(name, cluster.target)
            t0 = time.monotonic()
            time.sleep(seconds)
            t1 = time.monotonic()
            sent = attacker.stop()
            with_ = cluster.rate(t0, t1)
            settled = cluster.settle()
            # Counted once the broker has got through what the attacker sent (a message of a
            # million frames takes longer to read than a window) and has dropped it.
            after = refusals(cluster.scrape())
            delta = {k: after[k] - before[k] for k in after if after[k] - before[k]}
            result["without"].append(without)
            result["with"].append(with_)
            result["sent"].append(sent)
            result["refused"].append(delta)
            result["settled"].append(settled)
            print(f"  {name} round {r + 1}/{rounds}: without {without:7.1f} batches/s, with "
                  f"{with_:7.1f} ({with_ / without if without else 0:.2f}x); attacker sent "
                  f"{sent}; broker {delta}{'' if settled else '; DID NOT SETTLE'}",
                  flush=True)
            if not cluster.alive():
                roles = {"broker": cluster.broker, "producer": cluster.producer,
                         "consumer": cluster.consumer}
                dead = [role for role, c in roles.items() if not c.alive()]
                last = cluster.broker.log_text().strip().splitlines()[-1:]
                result["died"] = {"processes": dead, "broker_exit": cluster.broker.proc.poll(),
                                  "broker_last_line": last[0] if last else ""}
                print(f"  {name}: {', '.join(dead)} died (broker: {result['died']}); logs in "
                      f"{work / name}", flush=True)
                break
    finally:
        result["alive"] = cluster.alive()
        cluster.close()
    w, a = result["without"], result["with"]
    result["median_without"] = statistics.median(w) if w else 0.0
    result["median_with"] = statistics.median(a) if a else 0.0
    result["ratio"] = (result["median_with"] / result["median_without"]
                       if result["median_without"] else 0.0)
    return result


def table(results: list[dict]) -> str:
    lines = ["| attacker | without (batches/s) | with (batches/s) | with / without | each round "
             "(with / without) | refused, cut off or dropped by the broker (middle round) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        rounds = " / ".join(f"{a / w:.2f}" if w else "-" for w, a in zip(r["without"], r["with"],
                                                                         strict=True))
        ref = r["refused"][len(r["refused"]) // 2] if r["refused"] else {}
        what = ", ".join(f"{k} {v:.0f}" for k, v in ref.items()) or "-"
        if "died" in r:
            what = (f"**{', '.join(r['died']['processes'])} died** (exit "
                    f"{r['died']['broker_exit']}: {r['died']['broker_last_line'][:80]})")
        lines.append(f"| {r['scenario']} | {r['median_without']:.0f} | {r['median_with']:.0f} | "
                     f"**{r['ratio']:.2f}x** | {rounds} | {what} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="(without, with) pairs per attacker")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    ap.add_argument("--batch-bytes", type=int, default=MiB, help="the honest producer's batch")
    ap.add_argument("--rate", type=float, default=100.0,
                    help="batches/s the honest producer offers (0: as fast as it can; on a "
                    "machine without spare cores that measures CPU sharing as much as the "
                    "broker)")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated attackers (default: all of {', '.join(ATTACKS)})")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the daemons' logs in this directory (default: a temporary one)")
    args = ap.parse_args()
    names = list(ATTACKS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attacker(s) {unknown}; choose from {list(ATTACKS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="feedline-hostile-") as tmp:
        work = args.keep or Path(tmp)
        for name in names:
            print(f"{name}: starting a broker, an honest producer and consumer (logs: "
                  f"{work / name})", flush=True)
            results.append(measure(name, args.rounds, args.seconds, args.batch_bytes,
                                   args.rate, work))
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "seconds": args.seconds,
                                         "batch_bytes": args.batch_bytes, "rate": args.rate,
                                         "cpus": os.cpu_count(),
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
