"""Per-stream state against peers that misbehave on stream names (issue 22, findings 14, 16,
17): exact HELLOs that each name a new stream, consumer HELLOs that carry large cursors for a
stream nobody serves, an exact producer that takes a training stream's name. A real broker
process; the misbehaving peers speak the protocol by hand
(:class:`tests.support.flow_support.RawPeer`)
or are real producers."""

from __future__ import annotations

import random
import time
from pathlib import Path

import yaml
import zmq

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.exact.cursor import Cursor
from feedline.procs import wait_for
from feedline.protocol import messages as m
from tests.support.exact_run import FAST, pipeline, producer
from tests.support.flow_support import MiB, RssSampler, start_broker
from tests.support.hand_protocol import RawPeer

FLOOD = 300  # exact HELLOs, each naming a stream of its own
CONNECTIONS = 30  # ... from this many connections (each may register 10 times a second)


def exact_hello(i: int) -> bytes:
    return m.encode(m.ProducerHello(producer=f"x{i}", session=i + 1, stream=f"s{i}",
                                    registration=i + 1, delivery=m.EXACT, dataset_size=100,
                                    unit_size=10))


def test_exact_hellos_on_new_stream_names_are_bounded_and_reclaimed(broker_proc, endpoints,
                                                                     tmp_path):
    """Finding 14: one exact HELLO per new stream name. Before: each left a coordinator and an
    fsync'd journal for ever (~2,300 in 15 s), and the idle broker's loop went over all of
    them, four times a second (0% -> ~50% CPU after the peers left). Now at most
    --max-streams (64) streams have state, the rest are refused and counted, and the state of
    streams nobody uses is reclaimed (4 heartbeat timeouts: 6 s here), their journals too when
    they never served a batch."""
    state = tmp_path / "state"
    broker, metrics = start_broker(broker_proc, "--state-dir", str(state))
    with zmq.Context() as ctx:
        peers = [RawPeer(ctx, endpoints.ingress) for _ in range(CONNECTIONS)]
        for i in range(FLOOD):
            peers[i % CONNECTIONS].sock.send(exact_hello(i))
        wait_for(lambda: metrics.value("feedline_broker_rejected_messages_total")
                 >= FLOOD - 64, 20, what="every HELLO answered")
        journals = len(list(state.glob("*.exact.jsonl")))
        refused = metrics.value("feedline_broker_rejected_messages_total",
                                reason="too_many_streams")
        for p in peers:
            p.close()
    assert journals <= 64 and refused >= FLOOD - 64, (journals, refused)
    wait_for(lambda: metrics.value("feedline_broker_exact_streams") == 0
             and not list(state.glob("*.exact.jsonl*")), 30,
             what="the unused streams reclaimed")
    assert not metrics.by_label("feedline_broker_exact_epoch", "stream")
    assert broker.alive()


def test_consumer_hellos_with_large_cursors_cannot_grow_the_broker(broker_proc, endpoints,
                                                                   tmp_path):
    """Finding 16: 40 consumer HELLOs, each with a 60 KiB cursor, for a stream no producer
    serves; and one connection that registers 20 times in a second. Before: the broker kept
    every cursor, decoded (+1,291 MiB in the audit), and consumer HELLOs had no rate limit.
    Now what waits for a stream's first producer is bounded (64 cursors, kept as their
    bytes) and a connection registers at most 10 times a second (the rest refused and counted,
    ``hello_flood``)."""
    broker, metrics = start_broker(broker_proc, "--state-dir", str(tmp_path / "state"))
    rng = random.Random(1)
    cursor = Cursor.from_dict({"stream": "ghost", "epoch": 0, "taken": {
        str(u): [i for i in range(1024) if rng.random() < 0.5] for u in range(470)}}).encode()
    assert 58 * 1024 < len(cursor) < 63 * 1024  # a HELLO carries up to 64 KiB
    egress = endpoints.egress
    with zmq.Context() as ctx, RssSampler(broker.pid) as rss:
        peers = [RawPeer(ctx, egress) for _ in range(40)]
        for k, p in enumerate(peers):
            p.sock.send(m.encode(m.ConsumerHello(consumer=f"c{k}", session=k + 1, window=1,
                                                 max_bytes=1 << 30, stream="ghost",
                                                 registration=1, cursor=cursor)))
        flood = RawPeer(ctx, egress)
        for r in range(20):
            flood.sock.send(m.encode(m.ConsumerHello(consumer="flood", session=99, window=1,
                                                     max_bytes=1 << 30, stream="ghost",
                                                     registration=r + 1, cursor=cursor)))
        wait_for(lambda: metrics.value("feedline_broker_peers", role="consumer") >= 40, 30,
                 what="the 40 registrations")
        time.sleep(1.0)
        for p in [*peers, flood]:
            p.close()
    assert rss.peak_growth < 64 * MiB, f"+{rss.mib()} MiB"
    assert metrics.value("feedline_broker_rejected_messages_total", reason="hello_flood") >= 9


def test_an_exact_producer_cannot_take_a_training_stream(broker_proc, daemons, endpoints,
                                                         tmp_path: Path):
    """Finding 17: an exact producer uses a training stream's name. Before: the stream turned
    exact for good; after the exact producer left, its training batches were refused
    (``not_exact``) and it ran at 0.00x. Now the exact producer is refused with one line
    saying the stream is served in training mode and exits; the training stream goes on."""
    broker_proc("--state-dir", str(tmp_path / "state"))
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({"factory": "tests.support.ledger_data:make",
                                     "args": {"nbytes": 1024, "rate": 200}}))
    producer(daemons, plain, endpoints.ingress, "trainer-data")
    with RemoteDataZMQ(endpoints.egress, timeout=10, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        it = iter(src)
        assert all(next(it).unit < 0 for _ in range(20))
        # The exact pipeline file says stream "val"; --stream gives it the training stream's.
        exact = daemons("feedline.producer", "--config", pipeline(tmp_path, epochs=1),
                        "--broker", endpoints.ingress, "--id", "intruder", "--stream",
                        "default", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5",
                        name="intruder")
        wait_for(lambda: not exact.alive(), 30, what="the exact producer to give up")
        last = exact.log_text().strip().splitlines()[-1]
        assert exact.proc.returncode == 1 and "training mode" in last, last
        # 100 more within the consumer's 10 s timeout (ReceiveTimeout otherwise).
        after = [next(it) for _ in range(100)]
        assert all(b.unit < 0 for b in after), "training batches, not exact ones"
