"""``--max-bytes`` is a bound on a host's memory, whatever its peers do (issue 16).

Each test runs a host of the serving core with a byte budget (the ``host`` fixture: a
``python -m feedline.broker`` process, and a direct-mode trainer process whose ``max_bytes``
is the budget), drives it with real producer processes, a tensorpack sender or a hand-played
consumer, and samples the host's resident memory (psutil) all along: the peak growth over
the idle host must stay within the budget plus OVERHEAD (48 MiB: interpreter, libzmq, socket
buffers). Where no consumer reads the broker, the direct-mode trainer takes nothing either
(``reading=False``: its model took one batch and stopped). A run that breaks the bound is
stopped as soon as it does (the producers are killed), so a failure costs seconds and at most a
few hundred MiB, not the machine.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable

import zmq

from feedline.procs import free_port, wait_for
from tests.support.flow_support import (
    OVERHEAD,
    TP_ENV,
    MiB,
    RssSampler,
    fake_yaml,
    run_script,
    start_producer,
)
from tests.support.hand_protocol import RawPeer
from tests.support.hosts import Trainer


def observe(rss: RssSampler, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
    """Let the scenario run ``seconds`` (or until ``until()``), ending early if the bound broke."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until() and not rss.exceeded.wait(0.1):
        pass


def test_a_batch_larger_than_the_budget_is_refused_never_buffered(host, daemons, tmp_path):
    """Claim: with --max-bytes 16MiB, eight producers of 64 MiB batches cannot make the broker
    hold more than 16 MiB (+ overhead): such a batch is refused before it is sent, and each
    producer exits non-zero with an error naming --max-bytes.

    Before: a producer's first grants ignore the budget (its batch size is unknown until it
    sends one): the broker buffered 384-448 MiB (feedline_broker_buffer_bytes) and grew by
    444-508 MiB; two producers sent all 4 batches and exited 0, the others waited for credit
    (the test stops the run at the bound: it then reports ~70-80 MiB)."""
    budget = 16 * MiB
    broker = host("--max-bytes", str(budget), reading=False)
    cfg = fake_yaml(tmp_path, "huge", [[64 * MiB]], ["uint8"], size=4, epochs=1)
    with RssSampler(broker.pid, limit=budget + OVERHEAD) as rss:
        prods = [start_producer(daemons, broker.ingress, cfg, f"huge{i}") for i in range(8)]
        observe(rss, 20, until=lambda: not any(p.alive() for p in prods))
        for p in prods:
            if rss.exceeded.is_set():
                p.kill9()
    assert rss.peak_growth <= budget + OVERHEAD, f"broker grew {rss.mib()} MiB"
    for p in prods:
        assert not p.alive() and p.proc.returncode != 0, p.log_text()[-2000:]
        assert "--max-bytes" in p.log_text(), p.log_text()[-2000:]


def test_many_producers_cannot_overrun_the_byte_budget(host, daemons, tmp_path):
    """Claim: --max-bytes 64MiB, eight producers of 16 MiB batches and no consumer: the
    broker's RSS grows by at most 64 MiB + overhead.

    Before: credit of unknown size goes to every producer at once; left alone the broker
    buffered 384 MiB (24 batches) and grew by 417 MiB."""
    budget = 64 * MiB
    broker = host("--max-bytes", str(budget), reading=False)
    cfg = fake_yaml(tmp_path, "big", [[16 * MiB]], ["uint8"])
    with RssSampler(broker.pid, limit=budget + OVERHEAD) as rss:
        prods = [start_producer(daemons, broker.ingress, cfg, f"big{i}") for i in range(8)]
        observe(rss, 20, until=lambda: broker.metrics.value("feedline_broker_peers",
                                                            role="producer") >= 8)
        observe(rss, 4)  # everyone connected: what they can push, they push now
        for p in prods:
            if rss.exceeded.is_set():
                p.kill9()
    assert rss.peak_growth <= budget + OVERHEAD, f"broker grew {rss.mib()} MiB"


def test_a_consumer_that_never_reads_cannot_grow_the_broker(host, daemons, endpoints,
                                                             tmp_path):
    """Claim: --max-bytes 32MiB, a producer of 1 MiB batches, a hand-played consumer that says
    HELLO with window 4096, heartbeats but never reads (RCVHWM 1), then says HELLO twice more
    on the same connection: over ~8 s the broker's RSS grows by at most 32 MiB + overhead.
    What is in flight to a consumer counts against the budget.

    Before: a dispatched batch leaves the buffer (and the budget) while it waits in the broker's
    libzmq send queue: the broker grew by 1.3 GiB in 2.8 s and 3 GiB in 7 s."""
    host.broker_only("the egress is the broker's consumer side")
    budget = 32 * MiB
    broker = host("--max-bytes", str(budget))
    cfg = fake_yaml(tmp_path, "mib", [[MiB]], ["uint8"])
    ctx = zmq.Context()
    hog = RawPeer(ctx, endpoints.egress, rcvhwm=1)
    try:
        with RssSampler(broker.pid, limit=budget + OVERHEAD) as rss:
            prod = start_producer(daemons, endpoints.ingress, cfg, "mib")
            hog.hello_consumer("hog", 4096)
            for _ in range(3):
                end = time.monotonic() + 8 / 3
                while time.monotonic() < end and not rss.exceeded.wait(0.2):
                    hog.heartbeat()
                hog.hello_consumer("hog", 4096)  # a fresh window on the same connection
            if rss.exceeded.is_set():
                prod.kill9()
    finally:
        hog.close()
        ctx.destroy(linger=0)
    assert rss.peak_growth <= budget + OVERHEAD, f"broker grew {rss.mib()} MiB"


_TP_SENDER = """
import numpy as np
from tensorpack.dataflow import DataFromList
from tensorpack.dataflow.remote import send_dataflow_zmq
a = np.ones({nbytes}, np.uint8)
send_dataflow_zmq(DataFromList([[a]] * 8, shuffle=False), {addr!r}, hwm=4)  # loops forever
"""


def test_tensorpack_ingress_stays_within_the_budget(host, tmp_path):
    """Claim: --max-bytes 8MiB and a tensorpack ``send_dataflow_zmq`` pushing 4 MiB arrays as
    fast as it can, no consumer: the broker's RSS grows by at most 8 MiB + overhead.

    Before: the broker stops reading once two batches are buffered, but its PULL socket
    (RCVHWM = max_batches) keeps taking messages: it grew by 132 MiB."""
    tp = f"tcp://127.0.0.1:{free_port()}"
    budget = 8 * MiB
    broker = host("--max-bytes", str(budget), "--tensorpack-ingress", tp, reading=False)
    metrics = broker.metrics
    with RssSampler(broker.pid, limit=budget + OVERHEAD) as rss:
        sender = run_script(textwrap.dedent(_TP_SENDER.format(nbytes=4 * MiB, addr=tp)),
                            tmp_path / "tensorpack.log", env=TP_ENV)
        try:
            wait_for(lambda: rss.exceeded.is_set() or metrics.value(
                "feedline_broker_received_batches_total", producer="tensorpack") >= 1, 60,
                what="the first tensorpack batch")
            observe(rss, 5)
        finally:
            sender.kill()
            sender.wait(10)
    assert rss.peak_growth <= budget + OVERHEAD, f"broker grew {rss.mib()} MiB"


_TP_PHASED = """
import os, time
import numpy as np
from tensorpack.dataflow import DataFlow
from tensorpack.dataflow.remote import send_dataflow_zmq
class Phased(DataFlow):
    def __iter__(self):
        for _ in range({big_count}):
            yield [b"x" * {big}]  # a python bytes: travels inline, in the re-encoded header
        while not os.path.exists({go!r}):
            time.sleep(0.05)
        for i in range({ordinary}):
            yield [np.array([i], np.int64)]
        while True:
            time.sleep(1)
send_dataflow_zmq(Phased(), {addr!r}, hwm=4)
"""


def test_tensorpack_bytes_count_and_an_oversized_header_does_not_stall(host, tmp_path):
    """Claim: tensorpack datapoints carrying a 1.8 MiB python ``bytes`` (which travels inline,
    in the header the broker re-encodes) are either refused and counted, or counted at full
    size in feedline_broker_buffer_bytes; and after 5 such datapoints (re-encoded header over
    Limits.max_header_bytes, 64 KiB) a consumer still gets the next 20 ordinary batches.

    Before: 5 buffered, feedline_broker_buffer_bytes 0; they are forwarded to the consumer,
    whose decoder refuses headers over 64 KiB without returning the credit they took: with
    its window of 4 it got 0 of the 20 ordinary batches in 10 s. (A direct-mode trainer has no
    buffer: there the claim is that each datapoint is refused or taken, and the 20 ordinary
    batches are taken.)"""
    tp = f"tcp://127.0.0.1:{free_port()}"
    broker = host("--tensorpack-ingress", tp, reading=host.kind != "broker")
    metrics = broker.metrics
    big, go = int(1.8 * MiB), tmp_path / "go"
    code = _TP_PHASED.format(big_count=5, big=big, go=str(go), ordinary=20, addr=tp)
    sender = run_script(textwrap.dedent(code), tmp_path / "tensorpack.log", env=TP_ENV)
    trainer = None
    try:
        def taken() -> float:  # a broker has no consumer yet: what is not refused is buffered
            s = metrics.snapshot()
            return (s.total("feedline_broker_received_batches_total", producer="tensorpack")
                    + s.total("feedline_broker_rejected_messages_total"))

        wait_for(lambda: taken() >= 5, 60, what="the 5 datapoints with bytes")
        s = metrics.snapshot()
        held = s.total("feedline_broker_buffer_batches")
        held_bytes = s.total("feedline_broker_buffer_bytes")
        trainer = broker.trainer(window=4)
        go.touch()
        wait_for(lambda: len(ordinary(trainer)) >= 20, 20, what="the 20 ordinary batches")
    finally:
        sender.kill()
        sender.wait(10)
        if trainer is not None:
            trainer.close()
    assert held_bytes >= held * big, f"{held} batches held, counted as {held_bytes} bytes"
    got = ordinary(trainer)
    assert sorted(got) == list(range(20)), f"{len(got)} of 20 ordinary batches"


def ordinary(trainer: Trainer) -> list[int]:
    """The values of the ordinary (int64) datapoints a trainer took."""
    return [b["a"][0][2] for b in trainer.of("tensorpack") if b["a"][0][1:2] == ["<i8"]]
