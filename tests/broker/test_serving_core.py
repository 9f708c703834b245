"""The serving core's protections, in both hosts (issue 22, findings 15 and 18 to 22).

A broker and a direct-mode trainer serve producers with the same core
(feedline/serving/server.py): each test here runs against both (the ``host`` fixture) where
the finding is about serving producers, and says so where only one host has what it is
about. Each test's docstring has its claim and the figure on the code before the fix.
"""

from __future__ import annotations

import textwrap
import threading
import time

import numpy as np
import pytest
import zmq

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.endpoints import AddressError
from feedline.errors import ReceiveTimeout
from feedline.procs import free_port, wait_for
from feedline.producer import Sender
from tests.support.flow_support import FAST, OVERHEAD, TP_ENV, MiB, RssSampler, run_script
from tests.support.hand_protocol import RawPeer
from tests.support.hosts import honest_round

FRAMES, FRAME = 40, 8 * MiB  # one message: 320 MiB in frames each within a 16 MiB budget


def test_messages_of_large_frames_are_weighed_before_they_are_held(host):
    """Claim (finding 19): against --max-bytes 16MiB, a peer that sends three messages of 40
    frames of 8 MiB (320 MiB each, every frame within ZMQ_MAXMSGSIZE) on one connection makes
    the host grow by at most the budget + 48 MiB + one such message: libzmq holds a message
    whole before its first frame is readable (nothing can weigh that part), but the host
    weighs the frames as it reads them, refuses the message (``message_too_large``) once it
    passes the largest the budget allows, and cuts the sender off at that moment, so the
    messages behind it are never held. Honest traffic goes on after it.

    Before: the frames were kept until the whole message was read, then refused, and the
    sender stayed connected: libzmq took the next messages meanwhile (its receive queue holds
    20 per connection). The audit's two messages of 40 x 15 MiB: +1.1 GB."""
    budget = 16 * MiB
    h = host("--max-bytes", str(budget))
    bound = budget + OVERHEAD + FRAMES * FRAME
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.DEALER)
    attacker.linger = 0
    attacker.sndhwm = 16
    frame = np.zeros(FRAME, np.uint8)
    try:
        with RssSampler(h.pid) as rss:
            attacker.connect(h.ingress)
            for _ in range(3):
                try:
                    attacker.send_multipart([frame] * FRAMES, copy=False, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
            wait_for(lambda: h.metrics.value("feedline_broker_rejected_messages_total") >= 1,
                     30, what="the message refused")
            observe_until = time.monotonic() + 3  # what else it could make the host hold
            while time.monotonic() < observe_until:
                time.sleep(0.1)
    finally:
        attacker.close(linger=0)
        ctx.term()
    refused = h.metrics.by_label("feedline_broker_rejected_messages_total", "reason")
    cut = h.metrics.value("feedline_broker_cut_off_connections_total",
                          reason="message_too_large")
    print(f"{h.kind} grew {rss.mib()} MiB (bound {bound >> 20}), refused {refused}, "
          f"cut off {cut}")
    assert rss.peak_growth <= bound, f"{h.kind} grew {rss.mib()} MiB (bound {bound >> 20})"
    assert set(refused) == {"message_too_large"} and cut >= 1, (refused, cut)
    honest_round(h)


def test_a_second_trainer_cannot_take_over_a_live_ipc_address(tmp_path):
    """Claim (finding 20; direct mode: a broker's addresses were checked already): a second
    ``RemoteDataZMQ(addr, bind=True)`` on an ``ipc://`` path a live trainer serves raises a
    one-line AddressError naming the address and what to do, and the first trainer keeps
    being served.

    Before: the second bind succeeded silently and took the path over: 300+ batches to it, 0
    to the first trainer."""
    addr = f"ipc://{tmp_path}/trainer.sock"
    stop = threading.Event()
    with RemoteDataZMQ(addr, bind=True, timeout=10, options=ConsumerOptions(link=FAST)) as first:
        it = iter(first)
        t = threading.Thread(target=_send, args=(addr, "p", stop), daemon=True)
        t.start()
        try:
            next(it)
            with pytest.raises(AddressError) as err:
                RemoteDataZMQ(addr, bind=True, timeout=5, options=ConsumerOptions(link=FAST))
            for _ in range(20):
                next(it)
        finally:
            stop.set()
            t.join(10)
    text = str(err.value)
    assert addr in text and "another process is listening" in text and "\n" not in text, text


def test_a_second_trainer_started_late_cannot_take_over_either(tmp_path):
    """Claim (finding 20, the late case): two ``RemoteDataZMQ(addr, bind=True)`` made before
    either binds (the check at construction passes for both): the second to start iterating
    raises the same one-line AddressError from its first ``next()``, as the serving core checks
    the address again just before it binds.

    Before: both bound; the second took the path over."""
    addr = f"ipc://{tmp_path}/trainer.sock"
    first = RemoteDataZMQ(addr, bind=True, timeout=0.5, options=ConsumerOptions(link=FAST))
    second = RemoteDataZMQ(addr, bind=True, timeout=0.5, options=ConsumerOptions(link=FAST))
    try:
        with pytest.raises(ReceiveTimeout):
            next(iter(first))  # binds, then waits for a batch nobody sends
        with pytest.raises(AddressError, match="another process is listening"):
            next(iter(second))
    finally:
        first.close()
        second.close()


_TP_SENDER = """
import numpy as np
from tensorpack.dataflow import DataFromList
from tensorpack.dataflow.remote import send_dataflow_zmq
dps = [[np.full((2, 3), i, np.float32), np.array([i], np.int64)] for i in range(8)]
send_dataflow_zmq(DataFromList(dps, shuffle=False), {addr!r}, hwm=4)  # loops forever
"""


def test_a_direct_mode_trainer_takes_tensorpack_datapoints(host, tmp_path):
    """Claim (finding 22): tensorpack's own ``send_dataflow_zmq`` (msgpack) into a host's
    tensorpack ingress: the training side gets the datapoints intact, as from any producer
    (in direct mode too: the ingress hands the trainer's queue a decoded batch).

    Before, in direct mode: the first datapoint killed the trainer's I/O thread (an assertion
    in the sink): 0 delivered, and its feedline producers stopped too."""
    tp = f"tcp://127.0.0.1:{free_port()}"
    h = host("--tensorpack-ingress", tp)
    trainer = h.trainer()
    sender = run_script(textwrap.dedent(_TP_SENDER.format(addr=tp)), tmp_path / "tp.log",
                        env=TP_ENV)
    try:
        wait_for(lambda: len(trainer.of("tensorpack")) >= 16, 60, what="16 datapoints")
        trainer.close()  # (a broker's consumers would share the stream with the next one)
        honest_round(h)  # the feedline producers are served beside it
    finally:
        sender.kill()
        sender.wait(10)
        trainer.close()
    got = trainer.of("tensorpack")[:16]
    values = [b["a"][1][2] for b in got]
    assert all(b["a"][0][:2] == [[2, 3], "<f4"] for b in got), got
    assert all(b["a"][0][2] == b["a"][0][3] == v for b, v in zip(got, values, strict=True)), got
    assert set(values) == set(range(8)), values


@pytest.mark.parametrize("name", ["val/0", "ééé", "", "x" * 65])
def test_a_stream_name_the_wire_refuses_is_one_line_at_both_ends(name):
    """Claim (finding 18): a producer (``Sender``) and a consumer (``RemoteDataZMQ``, either
    mode) given a stream name the wire refuses raise a one-line ValueError at once, naming the
    stream and the rule.

    Before: the producer hung saying the broker was "silent"; the consumer timed out blaming
    the address ("Is it running at that address?")."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    errors = []
    for make in (lambda: Sender(addr, stream=name, link=FAST),
                 lambda: RemoteDataZMQ(addr, stream=name, timeout=1),
                 lambda: RemoteDataZMQ(addr, bind=True, stream=name, timeout=1)):
        with pytest.raises(ValueError) as err:
            make()
        errors.append(str(err.value))
    for text in errors:
        assert repr(name) in text and "letters, digits" in text and "\n" not in text, text


def _send(addr: str, name: str, stop: threading.Event, stream: str = "default",
          nbytes: int = 1024) -> None:
    """A real Sender sending constant batches until ``stop``."""
    from feedline.errors import Stopped

    batch = [np.zeros(nbytes, np.uint8)]
    with Sender(addr, producer_id=name, link=FAST, stream=stream) as s:
        try:
            while not stop.is_set():
                s.send(batch, stop=stop)
        except Stopped:
            pass


def test_idle_registrations_on_streams_of_their_own_leave_a_working_stream_its_floor(
        thread_broker, endpoints):
    """Claim (finding 15; a broker: a direct-mode trainer takes one stream and refuses
    others, ``wrong_stream``): with --max-bytes 16MiB, 110 hand-played producers register on
    stream names of their own and never send; an honest producer of 1 MiB batches on stream
    ``train``, read by a consumer, gets its batches through (>= 100 within 10 s): streams
    count in the shares only once produced, and a stream that is read keeps at least the
    budget's stream floor (a quarter; tests/broker/test_budget.py has the rule on its own).

    Before: every registered stream counted: the honest stream's share was 1/111 of the
    budget, 151 KB, less than one of its batches: 0 batches, no credit ever (the audit: 20
    such registrations took a stream to 0.00x; with the default budget 110 stop a stream of
    9.6 MB batches). --max-streams (64 by default) would refuse the registrations past it
    (tests/exact/test_exact_streams_bounds.py): it is raised here so that all 110 weigh on the
    shares."""
    tb = thread_broker(max_bytes=16 * MiB, max_streams=256)
    ctx = zmq.Context()
    stop = threading.Event()
    idle = [RawPeer(ctx, endpoints.ingress) for _ in range(110)]
    got: list[int] = []
    try:
        for i, p in enumerate(idle):
            p.sock.send(_hello(f"idle{i}", 7000 + i, f"s{i}"))
        wait_for(lambda: len(tb.broker.ingress.producers) == 110, 10, what="110 registered")
        t = threading.Thread(target=_send, args=(endpoints.ingress, "honest", stop, "train",
                                                  MiB), daemon=True)
        t.start()
        with RemoteDataZMQ(endpoints.egress, stream="train", timeout=0.5,
                           options=ConsumerOptions(link=FAST, window=8)) as src:
            end = time.monotonic() + 10
            while time.monotonic() < end and len(got) < 100:
                try:
                    for _ in src:
                        got.append(1)
                        if len(got) >= 100 or time.monotonic() > end:
                            break
                except ReceiveTimeout:
                    pass
                for p in idle:
                    p.heartbeat()
    finally:
        stop.set()
        for p in idle:
            p.close()
        ctx.destroy(linger=0)
    assert len(got) >= 100, f"{len(got)} batches in 10 s"


def _hello(pid: str, session: int, stream: str) -> bytes:
    from feedline.protocol import messages as m

    return m.encode(m.ProducerHello(producer=pid, session=session, max_batch_bytes=MiB,
                                    registration=1, stream=stream))
