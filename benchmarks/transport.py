"""Transport benchmark: feedline against plain ZeroMQ and tensorpack, every batch size.

Ways to move constant batches from a producer process to a consumer process (each side its
own process, every variant the same), at each batch size of ``--sizes``:

- ``feedline``:  ``feedline producer`` -> tcp -> ``feedline broker`` -> ipc -> RemoteDataZMQ
- ``direct``:    ``feedline producer`` -> tcp -> ``RemoteDataZMQ(bind=True)``: the trainer
                 serves its producers, one hop (direct mode)
- ``before``, ``direct-before``: ``feedline`` and ``direct`` run from another checkout
                 (``--before DIR``): the code as it was, measured in the same run (a change
                 must not make either slower); ``--tree NAME=DIR`` adds more (``NAME``,
                 ``direct-NAME``): each step of a change, side by side
- ``feedline-deep``, ``direct-deep``: the same with the windows a user of small batches
                 sets: 64 batches for the consumer and per producer (the broker's budget
                 ``--max-batches`` 128); memory stays bounded by the bytes limits as ever
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

A batch is ``[data, labels]``: ``data`` uint8 224x224x3 images where the size allows (150K is
one image, 1M seven, 9.6M 64, 64M 425), a byte array of the size otherwise (16K), and one
int32 label per image. The consumers turn every batch into numpy arrays (views where the
library gives views) and touch nothing else; each reports its bytes, batches and its own
CPU-seconds (user + system, all its threads: for direct mode that is the training process
serving its producers). Rounds alternate between the variants, size by size, in reverse
order every other round: a variant's place in a round moved its figure (direct mode at
150 KB measured 5% faster run second than first, whichever code it was); the report
gives, per size, medians of GB/s, batches/s and consumer CPU-seconds per GB, and the ratios
to the relay, to raw and to tensorpack.

    python benchmarks/transport.py --rounds 5 --seconds 3 --json benchmarks/results/transport.json
    python benchmarks/plot_transport.py benchmarks/results/transport.json docs/transport.png
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.transport_children import (  # noqa: E402
    CONSUMER,
    RELAY,
    SENDER,
    SENDER_CREDIT,
    SENDER_THREADS,
    TP_SENDER,
)
from feedline.procs import Child, free_port, wait_for  # noqa: E402

HWM = 4  # plain ZeroMQ queues as deep as feedline's credit windows, so memory is comparable
IMAGE = 224 * 224 * 3
DEFAULT_SIZES = ["16K", "150K", "1M", "9.6M", "64M"]
Result = dict[str, float]  # gbps, batches_per_s, cpu_s_per_gb (and ratios in summaries)


@dataclass(frozen=True)
class Size:
    """One batch size: ``shape`` of the uint8 data array and ``labels`` int32 labels."""

    name: str
    shape: tuple[int, ...]
    labels: int

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n + 4 * self.labels

    @staticmethod
    def parse(text: str, side: int = 224) -> Size:
        """``16K``, ``150K``, ``1M``, ``9.6M``, ``64M`` or bytes: images of ``side`` where
        a whole number of them is within 10% of the size, a byte array otherwise."""
        m = re.fullmatch(r"([0-9.]+)([KMG]?)B?", text.strip().upper())
        if m is None:
            raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 16K, 1M, 9.6M)")
        nbytes = int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])
        image = side * side * 3
        images = round(nbytes / image)
        if images >= 1 and abs(images * image - nbytes) <= 0.1 * nbytes:
            return Size(text, (images, side, side, 3), images)
        return Size(text, (max(1, nbytes),), 1)

    @staticmethod
    def images(n: int, side: int) -> Size:
        return Size(f"{n}x{side}", (n, side, side, 3), n)

    def args(self) -> list[str]:
        return [",".join(map(str, self.shape)), str(self.labels)]


def result(r: dict[str, float]) -> Result:
    """GB/s, batches/s and CPU-seconds per GB of a consumer's report."""
    return {"gbps": r["bytes"] / r["seconds"] / 1e9, "batches_per_s": r["batches"] / r["seconds"],
            "cpu_s_per_gb": r["cpu"] / (r["bytes"] / 1e9),
            # where the CPU goes: the kernel's share, page faults and switches a batch
            "sys_share": r["sys"] / max(r["cpu"], 1e-9),
            "faults_per_batch": r["faults"] / max(r["batches"], 1),
            "switches_per_batch": r["switches"] / max(r["batches"], 1)}


class Run:
    """One variant's processes in a work directory; :meth:`consume` measures."""

    def __init__(self, work: Path, size: Size, seconds: float) -> None:
        self.work, self.size, self.seconds = work, size, seconds
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

    def sender(self, script: str, addr: str, name: str, hwm: bool = True) -> Child:
        return self.python(script, [addr, *self.size.args(), *([str(HWM)] if hwm else [])],
                           name)

    def consumer_argv(self, kind: str, addr: str) -> list[str]:
        warmup = min(1.0, max(0.3, self.seconds / 5))
        return [sys.executable, "-c", CONSUMER, kind, addr, *self.size.args(),
                str(self.seconds), str(warmup)]

    @staticmethod
    def consumer_env(tree: Path) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(tree), "TF_CPP_MIN_LOG_LEVEL": "3",
                "TENSORPACK_SERIALIZE": "msgpack"}

    def consume(self, kind: str, addr: str, tree: Path = ROOT) -> Result:
        out = subprocess.run(self.consumer_argv(kind, addr), env=self.consumer_env(tree),
                             cwd=self.work, capture_output=True, text=True,
                             timeout=self.seconds + 120)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"{kind} consumer failed: {out.stderr[-2000:]}")
        return result(json.loads(lines[-1]))

    def fake_config(self) -> Path:
        cfg = self.work / "fake.yaml"
        cfg.write_text(yaml.safe_dump({"source": {"fake": {
            "shapes": [list(self.size.shape), [self.size.labels]], "dtypes": ["uint8", "int32"],
            "random": False, "size": 10**9}}}))
        return cfg

    def close(self) -> None:
        for c in reversed(self.children):
            c.stop(timeout=5)


# What a variant's consumer is: its kind (benchmarks/transport_children.py), address, tree.
Target = tuple[str, str, Path]


DEEP = 64  # the "-deep" variants' windows (benchmarks/transport_children.py says the same)


def via_broker(run: Run, tree: Path, deep: bool = False) -> Target:
    ingress = f"tcp://127.0.0.1:{free_port()}"
    egress = f"ipc://{run.work}/feedline.sock"
    cfg = run.fake_config()
    windows = ["--producer-window", str(DEEP), "--max-batches", str(2 * DEEP)] if deep else []
    run.child([sys.executable, "-m", "feedline.broker", "--ingress", ingress, "--egress", egress,
               "--metrics-port", "0", "--log-level", "WARNING", *windows], "broker", tree)
    run.child([sys.executable, "-m", "feedline.producer", "--config", str(cfg), "--broker",
               ingress, "--log-level", "WARNING"], "producer", tree)
    wait_for(lambda: Path(egress[6:]).exists(), 30, what="broker")
    return ("feedline-deep" if deep else "feedline"), egress, tree


def direct(run: Run, tree: Path = ROOT, deep: bool = False) -> Target:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.child([sys.executable, "-m", "feedline.producer", "--config", str(run.fake_config()),
               "--broker", addr, "--log-level", "WARNING"], "producer", tree)
    return ("feedline-direct-deep" if deep else "feedline-direct"), addr, tree


def relay(run: Run) -> Target:
    front = f"tcp://127.0.0.1:{free_port()}"
    back = f"ipc://{run.work}/relay.sock"
    run.python(RELAY, [front, back, str(HWM)], "relay")
    run.sender(SENDER, front, "sender")
    return "plain", back, ROOT


def raw(run: Run) -> Target:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.sender(SENDER, addr, "sender")
    return "plain-bind", addr, ROOT


def raw_threads(run: Run) -> Target:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.sender(SENDER_THREADS, addr, "sender")
    return "plain-bind-threads", addr, ROOT


def raw_credit(run: Run) -> Target:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.sender(SENDER_CREDIT, addr, "sender", hwm=False)
    return "plain-credit", addr, ROOT


def tensorpack(run: Run) -> Target:
    addr = f"tcp://127.0.0.1:{free_port()}"
    run.sender(TP_SENDER, addr, "tp-sender", hwm=False)
    return "tensorpack", addr, ROOT


def variants(before: Path | None,
             trees: dict[str, Path] | None = None) -> dict[str, Callable[[Run], Target]]:
    """Each variant starts its sending side and says where its consumer receives.
    ``before`` and each of ``trees`` add a broker and a direct variant run from that tree."""
    other = {**({"before": before} if before is not None else {}), **(trees or {})}
    out: dict[str, Callable[[Run], Target]] = {"feedline": lambda r: via_broker(r, ROOT)}
    for name, tree in other.items():
        out[name] = functools.partial(via_broker, tree=tree)
    out["direct"] = direct
    for name, tree in other.items():
        out[f"direct-{name}"] = functools.partial(direct, tree=tree)
    out["feedline-deep"] = functools.partial(via_broker, tree=ROOT, deep=True)
    out["direct-deep"] = functools.partial(direct, deep=True)
    out["relay"] = relay
    out["raw"] = raw
    out["raw-threads"] = raw_threads
    out["raw-credit"] = raw_credit
    if importlib.util.find_spec("tensorpack") is not None:
        out["tensorpack"] = tensorpack
    return out


def summary(runs: dict[str, list[Result]]) -> dict[str, Result]:
    """Per variant: medians of each measure, and the GB/s ratios to relay, raw, tensorpack."""
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]}
           for k, v in runs.items() if v}
    for v in med.values():
        for ref in ("relay", "raw", "tensorpack"):
            if ref in med:
                v[f"vs_{ref}"] = v["gbps"] / med[ref]["gbps"]
        if "raw" in med:
            v["cpu_vs_raw"] = v["cpu_s_per_gb"] / med["raw"]["cpu_s_per_gb"]
    return med


def report(size: Size, runs: dict[str, list[Result]], med: dict[str, Result]) -> None:
    print(f"\nbatches of {size.nbytes / 1e6:.3f} MB ({size.name}: uint8 "
          f"{'x'.join(map(str, size.shape))} + {size.labels} int32)")
    print(f"{'variant':<13} {'GB/s per round':<32} {'median':>7} {'batches/s':>10} "
          f"{'CPU-s/GB':>9} {'vs relay':>9} {'vs raw':>7} {'vs tp':>6} {'CPU vs raw':>10}")
    for k, v in med.items():
        rounds = " / ".join(f"{r['gbps']:.2f}" for r in runs[k])
        ratios = [f"{v[f'vs_{ref}']:.2f}x" if f"vs_{ref}" in v else "-"
                  for ref in ("relay", "raw", "tensorpack")]
        cpu_ratio = f"{v['cpu_vs_raw']:.2f}x" if "cpu_vs_raw" in v else "-"
        print(f"{k:<13} {rounds:<32} {v['gbps']:>7.2f} {v['batches_per_s']:>10.0f} "
              f"{v['cpu_s_per_gb']:>9.3f} {ratios[0]:>9} {ratios[1]:>7} {ratios[2]:>6} "
              f"{cpu_ratio:>10}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    ap.add_argument("--sizes", nargs="+", default=None,
                    help=f"batch sizes (default {' '.join(DEFAULT_SIZES)}): images of --side "
                         "where a whole number fits, a byte array otherwise")
    ap.add_argument("--batch", type=int, default=None,
                    help="one size instead: this many images per batch")
    ap.add_argument("--side", type=int, default=224, help="image side")
    ap.add_argument("--before", type=Path, default=None,
                    help="another feedline checkout to measure beside this one")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="another checkout measured as variants NAME (broker) and "
                         "direct-NAME (repeatable: each step of a change, side by side)")
    ap.add_argument("--only", nargs="*", default=None, help="variants to run (default all)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.batch is not None:
        sizes = [Size.images(args.batch, args.side)]
    else:
        sizes = [Size.parse(s, args.side) for s in (args.sizes or DEFAULT_SIZES)]
    trees = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path, "feedline").is_dir():
            raise SystemExit(f"--tree {spec}: give NAME=DIR, DIR a feedline checkout")
        trees[name] = Path(path).resolve()
    runs = variants(args.before, trees)
    if args.only:
        runs = {k: v for k, v in runs.items() if k in args.only}
    results: dict[str, dict[str, list[Result]]] = {s.name: {k: [] for k in runs} for s in sizes}
    total = args.rounds * len(sizes) * len(runs)
    print(f"{len(sizes)} sizes x {len(runs)} variants x {args.rounds} rounds x "
          f"{args.seconds:.0f}s ({total} runs)")
    done = 0
    with tempfile.TemporaryDirectory(prefix="feedline-bench-") as tmp:
        for r in range(args.rounds):
            for size in sizes:
                order = list(runs.items())
                for name, fn in (order[::-1] if r % 2 else order):
                    work = Path(tmp) / f"{name}-{size.name}-{r}"
                    work.mkdir()
                    run = Run(work, size, args.seconds)
                    try:
                        res = run.consume(*fn(run))
                    finally:
                        run.close()
                    results[size.name][name].append(res)
                    done += 1
                    print(f"  [{done}/{total}] round {r + 1} {size.name:>5} {name:<13} "
                          f"{res['gbps']:6.2f} GB/s {res['batches_per_s']:8.0f} batches/s "
                          f"{res['cpu_s_per_gb']:6.3f} CPU-s/GB "
                          f"({res['sys_share']:.0%} kernel, "
                          f"{res['faults_per_batch']:.0f} faults and "
                          f"{res['switches_per_batch']:.1f} switches a batch)",
                          flush=True)
                    time.sleep(0.3)  # let the previous run's sockets go
    out: dict[str, dict[str, object]] = {"sizes": {}}
    for size in sizes:
        med = summary(results[size.name])
        report(size, results[size.name], med)
        out["sizes"][size.name] = {"bytes": size.nbytes, "shape": list(size.shape),
                                   "runs": results[size.name], "median": med}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
