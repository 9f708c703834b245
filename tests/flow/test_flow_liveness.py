"""Liveness is the link's job (issue 16): a slow pipeline never looks like a dead peer, a peer
that was dropped has its losses counted, a peer at the wrong address is told so, and what a
client or a host starts is released when it goes away or fails.

What is about the host serving producers runs against both hosts of the serving core (the
``host`` fixture: a broker process and a direct-mode trainer process); what is about the
broker's consumer side (its egress, and consumers of it) runs against the broker only.
"""

from __future__ import annotations

import gc
import signal
import socket
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import psutil
import pytest
import yaml
import zmq

from feedline.broker import Broker, BrokerConfig
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.endpoints import AddressError
from feedline.procs import free_port, wait_for
from feedline.producer import send_dataflow
from tests.support.flow_support import FAST, fake_yaml, log_lines, start_broker, start_producer
from tests.support.hosts import KINDS

DROPPED = "feedline_broker_dropped_peers_total"


def slow_pipeline(n: int, seconds: float) -> Iterator[list[np.ndarray]]:
    """A dataflow that takes ``seconds`` per datapoint (a heavy augmentation, a slow disk)."""
    for i in range(n):
        time.sleep(seconds)
        yield [np.full(4, i, np.int32)]


def test_a_slow_pipeline_is_not_a_dead_peer(host):
    """Claim: a dataflow taking 2.5 s per datapoint (the broker's heartbeat timeout is 1.5 s),
    3 datapoints, epochs=1: the consumer gets all 3 and the broker drops nobody.

    Before: the producer sends no heartbeat while the pipeline runs, is dropped before each
    batch, and a batch sent then is refused as from an unknown peer: 0 or 1 of 3 delivered
    (two runs), the producer dropped 1-2 times, 0 counted lost."""
    h = host()
    trainer = h.trainer()
    t = threading.Thread(target=send_dataflow, args=(slow_pipeline(3, 2.5), h.ingress),
                         kwargs={"epochs": 1, "producer_id": "slow", "link": FAST}, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(trainer.of("slow")) >= 3, 12, what="3 slow batches")
    except TimeoutError:
        pass
    finally:
        trainer.close()
    t.join(10)
    got = [b["a"][0][2] for b in trainer.of("slow")]
    dropped = h.metrics.value(DROPPED, role="producer", reason="timeout")
    lost = h.metrics.value("feedline_broker_lost_batches_total", producer="slow")
    assert sorted(got) == [0, 1, 2], f"got {got}, producer dropped {dropped}x, lost {lost}"
    assert dropped == 0


def test_a_dropped_producer_that_comes_back_has_its_losses_counted(host, daemons, tmp_path):
    """Claim: a producer process SIGSTOPped past the heartbeat timeout is dropped; after
    SIGCONT it comes back and finishes. Nothing disappears uncounted: the 120 batches it sent
    = what the consumer got + feedline_broker_lost_batches_total, and the broker logs a
    WARNING naming the producer.

    Before: the ledger holds (the batches refused as from an unknown peer show up as a
    sequence gap once it has registered again: 120 = 118 + 2 in the run seen), but the
    broker only logs "producer stopped dropped (timeout)" at INFO and "rejected a message:
    unknown_peer" without the id: no WARNING names the producer."""
    broker = host()
    metrics = broker.metrics
    count = 120
    cfg = tmp_path / "stopped.yaml"
    cfg.write_text(yaml.safe_dump({"factory": "tests.support.ledger_data:make", "epochs": 1,
                                   "args": {"count": count, "nbytes": 1024, "rate": 40}}))
    consumer = broker.trainer()
    try:
        prod = start_producer(daemons, broker.ingress, cfg, "stopped")
        wait_for(lambda: consumer.counts.get("stopped", 0) >= 30, 20, what="30 batches")
        prod.signal(signal.SIGSTOP)
        try:
            wait_for(lambda: metrics.value(DROPPED, role="producer") >= 1, 10,
                     what="the broker to drop the stopped producer")
        finally:
            prod.signal(signal.SIGCONT)
        assert prod.proc.wait(30) == 0, prod.log_text()[-2000:]
        lost = lambda: metrics.value("feedline_broker_lost_batches_total",  # noqa: E731
                                     producer="stopped")
        try:
            wait_for(lambda: consumer.counts.get("stopped", 0) + lost() >= count, 10,
                     what="every batch delivered or counted lost")
        except TimeoutError:
            pass
    finally:
        consumer.close()
    got = consumer.counts.get("stopped", 0)
    assert got + lost() == count, f"sent {count}, got {got}, counted lost {lost()}"
    warnings = log_lines(broker.log_text(), "WARNING", "stopped")
    assert warnings, f"got {got}, lost {lost()}; {broker.log_text()[-3000:]}"


def test_a_producer_at_the_egress_is_told_to_use_the_ingress(broker_proc, daemons,
                                                              endpoints, tmp_path):
    """Broker only (direct mode has no egress).

    Claim: a producer started with --broker = the broker's EGRESS address logs a WARNING
    containing "ingress" within 10 s, and the broker's log line for what it refused names the
    socket (egress) and the peer (the producer's id).

    Before: the producer's log stays empty (the RESETs that answer its heartbeats arrive while
    its HELLO is unanswered, and are ignored); the broker logs "rejected a message:
    bad_hello"."""
    broker, _ = start_broker(broker_proc)
    cfg = fake_yaml(tmp_path, "lost", [[4]], ["float32"])
    prod = start_producer(daemons, endpoints.egress, cfg, "wrong-door")
    try:  # both logs: the broker's line may come after the producer's
        wait_for(lambda: log_lines(prod.log_text(), "WARNING", "ingress")
                 and log_lines(broker.log_text(), "WARNING", "egress", "wrong-door"), 10,
                 what="a WARNING about the ingress, and the broker's")
    except TimeoutError:
        pass
    assert log_lines(prod.log_text(), "WARNING", "ingress"), prod.log_text()[-2000:]
    assert log_lines(broker.log_text(), "WARNING", "egress", "wrong-door"), \
        broker.log_text()[-2000:]


def test_a_consumer_at_the_ingress_is_told_to_use_the_egress(host):
    """Claim: ``RemoteDataZMQ`` pointed at the host's INGRESS (a broker's, or a direct-mode
    trainer's address) raises AddressError, before its timeout (the host's refusal says it
    all: no retry changes it), whose message mentions "egress" and does not say the broker
    "did not answer" (it did); the host's log line for what it refused names the socket
    (ingress) and the peer.

    Before: "the broker at tcp://... did not answer within 2.0s. Is it running at that
    address?"; the broker logs "rejected a message: bad_hello". Then (issue 53, finding 17):
    the refusal, but only at the timeout (ReceiveTimeout)."""
    h = host()
    # At the timeout it would be a ReceiveTimeout (not an AddressError): what arrives first.
    with RemoteDataZMQ(h.ingress, timeout=20.0,
                       options=ConsumerOptions(consumer_id="wrong-way", link=FAST)) as src:
        with pytest.raises(AddressError) as err:
            next(iter(src))
    assert "egress" in str(err.value) and "did not answer" not in str(err.value), err.value
    assert log_lines(h.log_text(), "WARNING", "ingress", "wrong-way"), h.log_text()[-2000:]


def test_a_dropped_consumer_releases_everything(broker_proc, daemons, endpoints, tmp_path):
    """Broker only (a consumer of the broker's egress).

    Claim: 50 RemoteDataZMQ created in a loop, one batch taken from each, dropped without
    close(): after gc.collect() and at most 6 s, this process's threads and open fds are back
    to where they were (+ small slack) and the broker counts no consumer. ``with
    RemoteDataZMQ(...)`` works.

    Before: the I/O thread holds the object, so it is never collected: +50 Python threads
    (+150 OS threads with libzmq's), +450 fds, and the broker still counts 50 consumers
    (they heartbeat)."""
    _, metrics = start_broker(broker_proc)
    start_producer(daemons, endpoints.ingress,
                   fake_yaml(tmp_path, "feed", [[8]], ["float32"]), "feed")
    me = psutil.Process()
    with RemoteDataZMQ(endpoints.egress, timeout=20, options=ConsumerOptions(link=FAST)) as src:
        next(iter(src))
    gc.collect()
    threads, os_threads, fds = threading.active_count(), me.num_threads(), me.num_fds()
    refs = []
    try:
        for _ in range(50):
            src = RemoteDataZMQ(endpoints.egress, timeout=20, options=ConsumerOptions(link=FAST))
            next(iter(src))
            refs.append(weakref.ref(src))
            del src
        gc.collect()

        def released() -> bool:
            gc.collect()
            return (threading.active_count() <= threads + 1 and me.num_threads() <= os_threads + 2
                    and me.num_fds() <= fds + 4
                    and metrics.value("feedline_broker_peers", role="consumer") == 0)

        try:
            wait_for(released, 6, interval=0.2, what="everything released")
        except TimeoutError:
            pass
        now = (threading.active_count() - threads, me.num_threads() - os_threads,
               me.num_fds() - fds, metrics.value("feedline_broker_peers", role="consumer"))
    finally:
        for r in refs:  # what leaked is closed here, so that it does not outlive the test
            obj = r()
            if obj is not None:
                obj.close()
    assert now[0] <= 1 and now[1] <= 2 and now[2] <= 4 and now[3] == 0, (
        "after 50 dropped consumers: +{} threads, +{} OS threads, +{} fds, {} at the broker"
        .format(*now))


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
@pytest.mark.parametrize("kind", KINDS)
def test_a_broker_that_fails_to_start_releases_what_it_started(kind, tmp_path, endpoints):
    """Claim: with CURVE keys and an ingress port already in use, ``Broker(config)`` raises
    and ``threading.active_count()`` is back to what it was; so does a direct-mode trainer
    whose port was taken between ``RemoteDataZMQ(bind=True)`` and its first iteration (the
    serving core's bind, in its I/O thread, fails the same way).

    Before: the ZAP authenticator thread is left running (+1 thread)."""
    from feedline import security

    _, secret = security.generate_keypair(tmp_path / "broker", "broker")
    allowed = tmp_path / "allowed"
    security.generate_keypair(allowed, "producer")
    keys = security.ServerKeys.load(secret, allowed)
    gc.collect()
    before = threading.active_count()
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    src = RemoteDataZMQ(addr, bind=True, curve=keys, timeout=5) if kind == "direct" else None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        if src is None:
            cfg = BrokerConfig(ingress=addr, egress=endpoints.egress, curve=keys)
            with pytest.raises((zmq.ZMQError, AddressError)):  # the address checks say it
                Broker(cfg)
        else:
            with pytest.raises(AddressError):
                next(iter(src))
            src.close()
    try:
        wait_for(lambda: threading.active_count() <= before, 3, what="threads released")
    except TimeoutError:
        pass
    after, left = threading.active_count(), [t.name for t in threading.enumerate()]
    _stop_leaked_authenticators()
    assert after == before, f"{after - before} thread(s) left: {left}"


def _stop_leaked_authenticators() -> None:
    """Stop what a failed Broker() left running, so that it does not outlive the test."""
    from zmq.auth.thread import ThreadAuthenticator

    for obj in gc.get_objects():
        if isinstance(obj, ThreadAuthenticator) and obj.thread is not None \
                and obj.thread.is_alive():
            obj.stop()


def test_a_peer_of_the_broker_before_its_restart_is_counted_without_a_warning(caplog):
    """The new-user review: after a broker restart every producer's and trainer's beat was
    logged as a WARNING "rejected a message ... unknown_peer: Heartbeat", which reads as a
    fault. It is what a restart makes: counted as ever, said once at INFO; a malformed
    message is still a warning."""
    import logging

    from prometheus_client import CollectorRegistry

    from feedline.serving.endpoint import Refusals
    from feedline.serving.metrics import BrokerMetrics

    metrics = BrokerMetrics(CollectorRegistry())
    refusals = Refusals(metrics, logging.getLogger("feedline.test.refusals"))
    with caplog.at_level(logging.INFO, logger="feedline.test.refusals"):
        for _ in range(3):
            refusals("unknown_peer", "Heartbeat", "ingress", "an unregistered peer (ab)")
        refusals("bad_msgpack", "", "ingress", "an unregistered peer (ab)")
    assert refusals.counts == {"unknown_peer": 3, "bad_msgpack": 1}
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(infos) == 1 and "told to register again" in infos[0].getMessage()
    assert len(warnings) == 1 and "bad_msgpack" in warnings[0]
