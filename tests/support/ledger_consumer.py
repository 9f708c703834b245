"""A training process that keeps a ledger: one line per batch it took, flushed at once.

``python -m tests.support.ledger_consumer --broker ADDR --ledger FILE`` iterates ``RemoteDataZMQ``
over batches made by :mod:`tests.support.ledger_data` and appends, for each, the line
``time producer session seq index ok`` (``ok`` is 1 when the payload matched its checksum).
Every second, and at exit, it also writes ``#stats {json}``: the consumer's per-producer
received and lost counts (gaps reported by the broker). SIGUSR1 pauses reading (the I/O
thread goes on: heartbeats, window-bounded buffering), SIGUSR2 resumes; SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import threading
import time

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ReceiveTimeout
from feedline.transport.link import LinkConfig
from tests.support.ledger_data import check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--broker", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--stream", default="default")
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    a = ap.parse_args()
    stop, running = threading.Event(), threading.Event()
    running.set()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: running.clear())
    signal.signal(signal.SIGUSR2, lambda *_: running.set())
    link = LinkConfig(heartbeat_interval=a.heartbeat_interval,
                      heartbeat_timeout=a.heartbeat_timeout)
    with open(a.ledger, "a", buffering=1) as out, \
            RemoteDataZMQ(a.broker, timeout=0.2, return_meta=True, stream=a.stream,
                          options=ConsumerOptions(window=a.window, link=link)) as src:

        def stats() -> None:
            st = {k: dataclasses.asdict(v) for k, v in src.stats().items()}
            out.write(f"#stats {json.dumps(st)}\n")

        it = iter(src)
        next_stats = time.monotonic() + 1
        while not stop.is_set():
            if time.monotonic() >= next_stats:
                stats()
                next_stats = time.monotonic() + 1
            if not running.is_set():
                running.wait(0.1)
                continue
            try:
                b = next(it)
            except ReceiveTimeout:
                it = iter(src)  # a generator that raised is finished; the stream is not
                continue
            try:
                index, ok = check(b.datapoint), 1
            except AssertionError:
                index, ok = int(b.datapoint[1][0]), 0
            out.write(f"{time.time():.6f} {b.producer} {b.session} {b.seq} {index} {ok}\n")
        stats()


if __name__ == "__main__":
    main()
