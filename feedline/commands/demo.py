"""``feedline demo``: the whole system on this host, for a bounded time.

Starts a broker and N producer processes, consumes in this process with
:class:`consumer.RemoteDataZMQ`, prints a rate line every few seconds and a per-producer
throughput table at the end, then stops everything.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

from feedline.flags import HelpFormatter
from feedline.procs import Daemon, free_port, wait_for


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run broker, producers and a consumer on this host and print throughput",
        description="Everything on this host: a broker, --producers producer processes and "
        "a consumer\n(this process), for --duration seconds; prints batches/s and MB/s.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--duration", type=float, default=15.0, help="seconds to consume")
    p.add_argument("--producers", type=int, default=2, help="producer processes")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch")
    p.add_argument("--image-size", type=int, default=224, help="image side (pixels)")
    p.add_argument("--no-train", action="store_true",
                   help="only receive batches (no TensorFlow); the default trains a small "
                   "classifier when TensorFlow is installed")
    p.add_argument("--workdir", default=None,
                   help="where logs and the socket go (default: a temporary directory)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; Ctrl-C stops it (and everything it started) with one line, status 130."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("\nfeedline demo: interrupted; the broker and the producers are stopped",
              file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from feedline.consumer import RemoteDataZMQ

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="feedline-demo-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ingress = f"tcp://127.0.0.1:{free_port()}"
        egress = f"ipc://{work}/egress.sock"
        n, s = args.batch_size, args.image_size
        # Real JPEGs (cut from the photos inside scikit-image, made once and cached), run
        # through the ImageNet-style train pipeline; each producer reads its own shard.
        from feedline.producer.demo_data import build, default_dir

        data = build(default_dir(os.environ.get("XDG_CACHE_HOME"), count=512), count=512)
        cfg_paths = []
        for i in range(args.producers):
            pipeline = {"seed": i, "source": {"image_folder": {"root": str(data)}},
                        "shard": {"index": i, "count": args.producers}, "on_error": "skip",
                        "steps": [{"imagenet_train": {"size": s}},
                                  {"batch": {"batch_size": n}}]}
            cfg_paths.append(work / f"pipeline-{i}.yaml")
            cfg_paths[-1].write_text(yaml.safe_dump(pipeline))
        daemons = [Daemon("feedline.broker", ["--ingress", ingress, "--egress", egress,
                                     "--metrics-port", "0"], work / "broker.log")]
        for i in range(args.producers):
            daemons.append(Daemon("feedline.producer", ["--config", str(cfg_paths[i]), "--broker",
                                                        ingress,
                                               "--id", f"demo-{i}"], work / f"producer-{i}.log"))
        print(f"feedline demo: broker {ingress} -> {egress}, {args.producers} producers, "
              f"batches of {n}x{s}x{s}x3 uint8, {args.duration:.0f}s")
        try:
            wait_for(lambda: Path(egress[len("ipc://"):]).exists(), 30, what="broker socket")
            if args.no_train or not _has_tensorflow():
                _consume(RemoteDataZMQ(egress, timeout=60), args.duration)
            else:
                _train(egress, args.duration, n)
        finally:
            # A second Ctrl-C must not cut the clean-up short (each stop is bounded).
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            for d in reversed(daemons):
                d.stop()
            signal.signal(signal.SIGINT, previous)
    return 0


def _has_tensorflow() -> bool:
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        print("TensorFlow is not installed (pip install '.[tf]'): receiving only, no training")
        return False
    return True


def _train(egress: str, duration: float, batch_size: int) -> None:
    from feedline.commands.demo_train import train

    print("training a small classifier: RemoteDataZMQ -> QueueInput -> StagingInput -> step")
    r = train(egress, duration)
    print(f"\n{r['steps']} steps in {r['seconds']:.1f}s: {r['steps'] / r['seconds']:.1f} steps/s,"
          f" {r['steps'] * batch_size / r['seconds']:.0f} images/s, final loss {r['loss']:.3f}")
    print(r["verdict"])
    _table(r["start"], r["end"], r["seconds"])
    print(steps_vs_batches(r["steps"], r["held_start"], r["held_end"]))


def steps_vs_batches(steps: int, held_start: int, held_end: int) -> str:
    """Why the steps and the batches received in the same time differ: the queues between
    the socket and the model (RemoteDataZMQ's window, QueueInput, StagingInput) held
    ``held_start`` batches when the clock started and ``held_end`` when it stopped."""
    received = steps - held_start + held_end
    change = held_start - held_end
    how = (f"{change} more were taken from the queues than arrived in them" if change > 0
           else f"{-change} more arrived than were taken, and wait in the queues" if change < 0
           else "the queues held as many at the end as at the start")
    return (f"{steps} steps = {received} batches received + {held_start} held in the queues "
            f"at the start - {held_end} held at the end ({how})")


def _consume(source, duration: float) -> None:
    with source:
        it = iter(source)
        next(it)  # the first batch: everything is connected
        t0 = last = time.monotonic()
        start = source.stats()
        count = last_count = 0
        nbytes = 0
        for dp in it:
            count += 1
            nbytes += sum(getattr(a, "nbytes", 0) for a in dp)
            now = time.monotonic()
            if now - last >= 3.0:
                print(f"  {now - t0:5.1f}s  {(count - last_count) / (now - last):7.1f} batches/s"
                      f"  {nbytes / (now - t0) / 1e6:8.1f} MB/s (mean)")
                last, last_count = now, count
            if now - t0 >= duration:
                break
        elapsed = time.monotonic() - t0
        end = source.stats()
    _table(start, end, elapsed)


def _table(start: dict, end: dict, elapsed: float) -> None:
    """Per-producer and total throughput between two RemoteDataZMQ.stats() snapshots."""
    print(f"\n{'producer':<12} {'batches':>8} {'batches/s':>10} {'MB/s':>9} {'lost':>5}")
    tot_b = tot_bytes = 0
    for pid in sorted(end):
        b = end[pid].received - (start[pid].received if pid in start else 0)
        by = end[pid].bytes - (start[pid].bytes if pid in start else 0)
        tot_b, tot_bytes = tot_b + b, tot_bytes + by
        print(f"{pid:<12} {b:>8} {b / elapsed:>10.1f} {by / elapsed / 1e6:>9.1f}"
              f" {end[pid].lost:>5}")
    print(f"{'total':<12} {tot_b:>8} {tot_b / elapsed:>10.1f} {tot_bytes / elapsed / 1e6:>9.1f}")
