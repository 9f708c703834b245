"""The data path with real processes: producers and brokers as `python -m` daemons, kill -9,
restarts, a stalled consumer. Consumers run in this process (each its own socket and thread).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from feedline.broker.config import BrokerConfig
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ReceiveTimeout
from feedline.procs import free_port, wait_for
from feedline.producer.outbox import BACKLOG_ITEMS
from feedline.protocol.bundle import MAX_BUNDLE
from feedline.scrape import scrape
from feedline.serving.budget import depth
from feedline.transport.link import LinkConfig
from tests.support.ledger_data import check

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


def producer_yaml(tmp_path: Path, name: str, epochs: int | None, **args) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"factory": "tests.support.ledger_data:make", "args": args,
                                    "epochs": epochs}))
    return path


def start_producer(daemons, endpoints, tmp_path, name: str, epochs: int | None = None, **args):
    cfg = producer_yaml(tmp_path, name, epochs, **args)
    return daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress, "--id",
                   name,
                   "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5", name=name)


def receive(src: RemoteDataZMQ, n: int, ledger: list) -> None:
    it = iter(src)
    for _ in range(n):
        b = next(it)
        ledger.append((b.producer, b.session, check(b.datapoint)))


def test_n_producers_m_consumers_every_batch_once_intact(broker_proc, daemons, endpoints,
                                                          tmp_path):
    port = free_port()
    broker_proc("--metrics-port", str(port))
    n_prod, per = 3, 40
    ledgers: list[list] = [[], []]
    done = threading.Event()

    def consume(ledger: list) -> None:
        with RemoteDataZMQ(endpoints.egress, timeout=0.5, return_meta=True,
                           options=ConsumerOptions(link=FAST)) as src:
            while not done.is_set():
                try:
                    receive(src, 1, ledger)
                except ReceiveTimeout:
                    pass

    threads = [threading.Thread(target=consume, args=(lg,)) for lg in ledgers]
    for t in threads:
        t.start()
    try:
        # Both registered before the data flows: a window of 64 KB batches holds 128 of them
        # (counted by bytes), so one consumer alone could take the whole stream.
        wait_for(lambda: scrape(port).total("feedline_broker_peers", role="consumer") >= 2,
                 20, what="both consumers registered")
        for i in range(n_prod):
            start_producer(daemons, endpoints, tmp_path, f"p{i}", epochs=1, count=per,
                           nbytes=65536, seed=i)
        wait_for(lambda: sum(map(len, ledgers)) >= n_prod * per, 60, what="all batches")
        time.sleep(1.0)  # anything duplicated would arrive now
    finally:
        done.set()
        for t in threads:
            t.join(10)
    everything = [(p, i) for lg in ledgers for p, _, i in lg]
    assert sorted(everything) == sorted((f"p{k}", i) for k in range(n_prod) for i in range(per))
    assert all(len(lg) > 0 for lg in ledgers), "both consumers share the stream"


def test_kill9_producer_others_go_on_and_loss_is_bounded(broker_proc, daemons, endpoints,
                                                         tmp_path):
    window = 4
    port = free_port()
    broker_proc("--producer-window", str(window), "--metrics-port", str(port))
    log_a = tmp_path / "a.log"
    a = start_producer(daemons, endpoints, tmp_path, "a", nbytes=16384, log=str(log_a))
    start_producer(daemons, endpoints, tmp_path, "b", nbytes=16384, seed=1)
    ledger: list = []
    with RemoteDataZMQ(endpoints.egress, timeout=20, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        while sum(1 for p, _, _ in ledger if p == "a") < 20:
            receive(src, 1, ledger)
        a.kill9()
        b_before = sum(1 for p, _, _ in ledger if p == "b")
        # Everything of a's that reached the broker comes first: its budget (buffered, in
        # flight, granted) holds depth(max-batches, 16 KB) such batches, a's and b's.
        drain = depth(BrokerConfig().max_batches, 16384) + 100
        while sum(1 for p, _, _ in ledger if p == "b") < b_before + drain:
            receive(src, 1, ledger)
        stats = src.stats()
    got_a = sorted(i for p, _, i in ledger if p == "a")
    assert got_a == list(range(len(got_a))), "a's batches arrive without holes or repeats"
    produced_a = len(log_a.read_text().split())
    # Beyond its credit (sent, or granted and unused), a producer holds datapoints the broker
    # never saw: the one its pipeline made and the owner thread is handing over, the backlog's
    # (BACKLOG_ITEMS), and what its I/O thread holds while it waits for credit or room in
    # its pipe: a batch, or a bundle of at most MAX_BUNDLE.
    producer_side = 1 + BACKLOG_ITEMS + MAX_BUNDLE
    # Batches of 16 KB are counted by their bytes: the window of 4 holds depth(4, 16 KB).
    assert produced_a - len(got_a) <= depth(window, 16384) + producer_side
    # a's in-flight batches cannot show as a sequence gap (a never sends again): its loss is
    # what the broker counts when it drops a, the credit a held (an upper bound).
    wait_for(lambda: scrape(port).total("feedline_broker_dropped_peers_total",
                                        role="producer", reason="timeout") >= 1, 10,
             what="the broker to drop the killed producer")
    unconfirmed = scrape(port).total("feedline_broker_unconfirmed_batches_total",
                                     role="producer")
    assert produced_a - len(got_a) <= unconfirmed + producer_side, \
        (produced_a, len(got_a), unconfirmed)
    assert stats["b"].lost == 0  # b went on: a gap in its sequence would have shown


def test_kill9_broker_restart_resumes_without_restarting_peers(broker_proc, daemons,
                                                               endpoints, tmp_path):
    broker = broker_proc()
    prod = start_producer(daemons, endpoints, tmp_path, "p", nbytes=16384)
    ledger: list = []
    with RemoteDataZMQ(endpoints.egress, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        receive(src, 20, ledger)
        broker.kill9()
        broker_proc()
        before = len(ledger)
        receive(src, 20, ledger)
    assert prod.alive()
    sessions = {s for _, s, _ in ledger}
    assert len(sessions) == 1, "the same producer process (session) resumed"
    after = [i for _, _, i in ledger[before:]]
    assert after == sorted(after) and len(set(after)) == len(after)


def test_producer_started_before_broker_connects(broker_proc, daemons, endpoints, tmp_path):
    start_producer(daemons, endpoints, tmp_path, "early", epochs=1, count=10, nbytes=1024)
    time.sleep(0.5)  # the scenario: the broker is not up yet
    broker_proc()
    ledger: list = []
    with RemoteDataZMQ(endpoints.egress, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        receive(src, 10, ledger)
    assert sorted(i for _, _, i in ledger) == list(range(10))


def test_sigterm_exits_cleanly(broker_proc, daemons, endpoints, tmp_path):
    broker = broker_proc()
    prod = start_producer(daemons, endpoints, tmp_path, "p", nbytes=1024)
    with RemoteDataZMQ(endpoints.egress, timeout=30, options=ConsumerOptions(link=FAST)) as src:
        next(iter(src))
    assert prod.stop(timeout=10) == 0, prod.log_text()
    assert broker.stop(timeout=10) == 0, broker.log_text()


@pytest.mark.slow
def test_stalled_consumer_memory_stays_bounded_then_resumes(broker_proc, daemons, endpoints,
                                                            tmp_path):
    batch = 4 << 20
    max_bytes = 24 << 20
    broker = broker_proc("--max-batches", "64", "--max-bytes", str(max_bytes))
    prod = start_producer(daemons, endpoints, tmp_path, "p", nbytes=batch)
    procs = {"broker": psutil.Process(broker.pid), "producer": psutil.Process(prod.pid)}
    ledger: list = []
    with RemoteDataZMQ(endpoints.egress, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        receive(src, 10, ledger)
        base = {k: p.memory_info().rss for k, p in procs.items()}
        peak = dict(base)
        t_end = time.monotonic() + 30  # the consumer stops reading for 30 s
        while time.monotonic() < t_end:
            for k, p in procs.items():
                peak[k] = max(peak[k], p.memory_info().rss)
            time.sleep(0.5)
        receive(src, 20, ledger)
    growth = {k: (peak[k] - base[k]) >> 20 for k in procs}
    # Without flow control the producer would have pushed tens of GB in 30 s.
    assert growth["broker"] <= (max_bytes >> 20) + 32, growth
    assert growth["producer"] <= 4 * (batch >> 20) + 32, growth
    idx = [i for _, _, i in ledger]
    assert idx == list(range(30)), "stream resumed in order with nothing lost"


def test_a_finite_producer_delivers_every_batch_and_its_end_of_stream(broker_proc, daemons,
                                                                      endpoints, tmp_path):
    broker_proc()
    ledger: list = []
    with RemoteDataZMQ(endpoints.egress, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        # The producer exits right after its last send, so its last batches, its EOS and its
        # BYE may still be queued in its socket: closing must flush them (this failed 1 in 3
        # runs while the close dropped them).
        start_producer(daemons, endpoints, tmp_path, "fin", epochs=1, count=60, nbytes=262144)
        receive(src, 60, ledger)
        wait_for(lambda: src.stats()["fin"].finished, 10, what="end-of-stream")
    assert sorted(i for _, _, i in ledger) == list(range(60))
