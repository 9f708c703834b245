"""A direct-mode trainer process for the hostile-peer tests: the broker's flags, a ledger.

``python -m tests.support.direct_trainer --ingress ADDR --ledger FILE [broker flags]`` iterates
``RemoteDataZMQ(ADDR, bind=True)`` (direct mode: this process serves its producers) and
appends one JSON line per batch it takes: ``{"p": producer, "s": seq, "a": [[shape, dtype,
min, max], ...]}`` (``python bytes`` in a datapoint as ``[len, "bytes"]``), flushed at once, so
that a test can see what the model got. It takes the flags the hostile-peer tests give a
broker, with the same meaning: ``--max-bytes`` and ``--max-batches`` are its budget (the
trainer's ``max_bytes`` and ``window``), ``--tensorpack-ingress`` its
``DirectConfig(tensorpack=)``, and the metrics (``--metrics-port``, on 127.0.0.1) are the
ones a broker serves (``feedline_broker_*``) beside the consumer's.

``--hold``: take the first batch that comes (binding needs one ``next()``), then none (a model
that stopped: what arrives fills the budget, as a broker's buffer fills with no consumer).
SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from feedline.broker.config import BrokerConfig
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.consumer.direct import DirectConfig
from feedline.errors import ReceiveTimeout
from feedline.flags import parse_size
from feedline.logs import setup_logging
from feedline.metrics import serve_metrics
from feedline.protocol.codec import Limits
from feedline.protocol.messages import DEFAULT_STREAM
from feedline.transport.link import LinkConfig


def summary(dp: Any) -> list:
    """[shape, dtype, min, max] of each array of a datapoint, in order (bytes: [len, 'bytes'])."""
    items = dp.values() if isinstance(dp, dict) else dp
    out: list = []
    for a in items:
        if isinstance(a, bytes):
            out.append([len(a), "bytes"])
        else:
            a = np.asarray(a)
            lo, hi = (a.min().item(), a.max().item()) if a.size else (None, None)
            out.append([list(a.shape), a.dtype.str, lo, hi])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ingress", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--tensorpack-ingress", default=None)
    d = BrokerConfig()  # a broker's flags, with a broker's defaults
    ap.add_argument("--max-bytes", type=parse_size, default=d.max_bytes)
    ap.add_argument("--max-batches", type=int, default=d.max_batches)
    ap.add_argument("--max-message-bytes", type=parse_size, default=Limits().max_message_bytes)
    ap.add_argument("--max-peers", type=int, default=d.max_peers)
    ap.add_argument("--producer-window", type=int, default=d.producer_window)
    ap.add_argument("--credit-lease", type=float, default=d.credit_lease)
    ap.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval)
    ap.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout)
    ap.add_argument("--metrics-port", type=int, default=0)
    ap.add_argument("--stream", default=DEFAULT_STREAM)
    ap.add_argument("--hold", action="store_true")
    a = ap.parse_args()
    setup_logging("INFO")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    registry = CollectorRegistry()
    serve_metrics(registry, a.metrics_port or None, "127.0.0.1")
    link = LinkConfig(heartbeat_interval=a.heartbeat_interval,
                      heartbeat_timeout=a.heartbeat_timeout,
                      limits=Limits(max_message_bytes=a.max_message_bytes))
    direct = DirectConfig(producer_window=a.producer_window, credit_lease=a.credit_lease,
                          max_producers=a.max_peers, tensorpack=a.tensorpack_ingress)
    with open(a.ledger, "a", buffering=1) as out, \
            RemoteDataZMQ(a.ingress, bind=True, timeout=0.2, return_meta=True, stream=a.stream,
                          options=ConsumerOptions(window=a.max_batches, max_bytes=a.max_bytes,
                                                  registry=registry, link=link,
                                                  direct=direct)) as src:
        taking = True
        while not stop.is_set():
            if not taking:
                stop.wait(0.2)
                continue
            try:
                for b in src:
                    out.write(json.dumps({"p": b.producer, "s": b.seq,
                                          "a": summary(b.datapoint)}) + "\n")
                    if a.hold or stop.is_set():
                        break
            except ReceiveTimeout:
                pass
            taking = not a.hold
    logging.getLogger(__name__).info("trainer stopped")


if __name__ == "__main__":
    main()
