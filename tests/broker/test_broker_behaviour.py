"""Broker behaviour against real sockets: loss accounting, errors that travel, flow control,
hostile peers, the tensorpack ingress, and the CLI's help."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ProducerError, ReceiveTimeout
from feedline.procs import free_port, wait_for
from feedline.producer import Sender, send_dataflow
from feedline.protocol import messages as m
from feedline.protocol import wire
from feedline.scrape import scrape
from feedline.serving.budget import SMALL_BATCH
from feedline.transport.link import LinkConfig

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


def whole(i: int) -> np.ndarray:
    """A batch that counts as one in any window: 2 MiB (smaller ones count by their bytes,
    several to a batch of a window: feedline.serving.budget.depth)."""
    return np.full(SMALL_BATCH // 4, i, np.int32)


def test_gaps_in_a_producer_sequence_are_counted_once(thread_broker, endpoints):
    thread_broker()

    def produce() -> None:
        with Sender(endpoints.ingress, producer_id="gappy", link=FAST) as s:
            for i in range(10):
                if i == 5:
                    s.seq += 3  # three batches "lost" between producer and broker
                s.send([np.full(8, i, np.int32)])
            s.end(1)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    with RemoteDataZMQ(endpoints.egress, timeout=20, options=ConsumerOptions(link=FAST)) as src:
        got = [int(dp[0][0]) for dp in itertools.islice(src, 10)]
        stats = src.stats()
    t.join(10)
    assert got == list(range(10))
    assert stats["gappy"].received == 10 and stats["gappy"].lost == 3


def test_a_pipeline_error_reaches_the_consumer_with_its_traceback(thread_broker, endpoints):
    thread_broker()

    def broken():
        yield [np.zeros(4)]
        raise KeyError("corrupt-record-17")

    def produce() -> None:
        with pytest.raises(KeyError):
            send_dataflow(broken(), endpoints.ingress, epochs=1, producer_id="bad", link=FAST)

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    with RemoteDataZMQ(endpoints.egress, timeout=20, options=ConsumerOptions(link=FAST)) as src:
        it = iter(src)
        next(it)
        with pytest.raises(ProducerError) as err:
            next(it)
    t.join(10)
    assert "corrupt-record-17" in str(err.value) and "in broken" in err.value.remote_traceback


def test_receive_timeout_says_what_is_missing(tmp_path, thread_broker, endpoints):
    with RemoteDataZMQ(f"ipc://{tmp_path}/nobody.sock", timeout=0.5,
                       options=ConsumerOptions(link=FAST)) as src:
        with pytest.raises(ReceiveTimeout, match="never connected to a broker: nothing accepts"
                           ".*is the broker running"):
            next(iter(src))
    thread_broker()  # a broker that answers, and no producer behind it
    with RemoteDataZMQ(endpoints.egress, timeout=1.0, options=ConsumerOptions(link=FAST)) as src:
        with pytest.raises(ReceiveTimeout, match="producers seen so far: none"):
            next(iter(src))


def test_a_consumer_whose_credit_runs_ahead_is_clamped_not_stalled(thread_broker, endpoints):
    """A consumer that counts a batch of an earlier registration as taken reports more than
    the broker delivered. Refusing that CREDIT stalled both sides forever (found by the
    consumer SIGSTOP fault scenario); the broker clamps it to what it delivered instead, and
    the consumer's room never exceeds its window."""
    tb = thread_broker()
    with Sender(endpoints.ingress, producer_id="p", link=FAST) as s:
        for i in range(12):
            s.send([whole(i)])  # blocks while there is no credit
        wait_for(lambda: tb.broker.stats.received == 12, 10, what="12 batches buffered")
        ctx = zmq.Context()
        c = ctx.socket(zmq.DEALER)
        c.linger = 0
        c.connect(endpoints.egress)
        try:
            c.send(m.encode(m.ConsumerHello(consumer="hand", session=1, window=2,
                                            max_bytes=1 << 30, registration=1)))

            def deliveries(n: int, seconds: float = 0.5) -> list[int]:
                """Batches delivered within ``seconds``, up to ``n``. Short: this hand-made
                consumer sends no heartbeats, and the broker drops it after 1.5 s."""
                got: list[int] = []
                end = time.monotonic() + seconds
                while (len(got) < n and time.monotonic() < end
                       and c.poll(max(1, int((end - time.monotonic()) * 1000)))):
                    frames = c.recv_multipart(copy=False)
                    if isinstance(m.decode(frames[0]), m.Deliver):
                        got.append(int(wire.decode_batch(frames[1:]).datapoint[0][0]))
                return got

            assert deliveries(3) == [0, 1], "window 2: two batches, then nothing"
            c.send(m.encode(m.Taken(taken=5, registration=1)))  # ahead of the 2 delivered
            assert deliveries(3) == [2, 3], "room again, and still only the window"
            c.send(m.encode(m.Taken(taken=6, registration=1)))
            assert deliveries(3) == [4, 5]
        finally:
            c.close()
            ctx.term()


def test_credit_bounds_what_a_producer_can_push(thread_broker, endpoints):
    tb = thread_broker(max_batches=6, producer_window=4)
    stop = threading.Event()
    with Sender(endpoints.ingress, producer_id="eager", link=FAST) as s:

        def push() -> None:  # no consumer: only credit lets batches through
            try:
                while True:
                    s.send([whole(0)], stop=stop)
            except Exception:
                pass

        t = threading.Thread(target=push, daemon=True)
        t.start()
        wait_for(lambda: tb.broker.stats.received >= 6, 10, what="the buffer's worth")
        time.sleep(1.0)  # the claim: nothing more gets through while nobody consumes
        received = tb.broker.stats.received
        stop.set()
        t.join(5)
    assert received == 6, "exactly the buffer's worth, then producers wait"
    assert not tb.broker.stats.rejected


def _raw_dealer(ctx: zmq.Context, addr: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    return s


def test_hostile_messages_are_refused_counted_and_the_stream_goes_on(thread_broker, endpoints,
                                                                      tmp_path):
    tb = thread_broker()
    marker = tmp_path / "pwned"
    ctx = zmq.Context()
    try:
        bad = _raw_dealer(ctx, endpoints.ingress)
        hello = m.encode(m.ProducerHello(producer="evil", session=1, max_batch_bytes=1024,
                                         registration=1))
        bad.send(hello)

        sent = [0, 0]  # batches sent, credit granted (GRANT carries the total)

        def with_credit(frames: list[bytes]) -> None:
            # A producer that has not sent a good batch holds one credit at a time (slow
            # start), and after a refused batch it gets more only when it asks: ask, wait
            # for credit beyond what it sent, then send. (Its first WANT after a refusal
            # brings a window of small batches: later ones find credit left.)
            bad.send(m.encode(m.Want(sent=sent[0], sent_bytes=0, size=1024, registration=1)))

            def credited() -> bool:
                while bad.poll(100):
                    msg = m.decode(bad.recv_multipart()[-1])
                    if isinstance(msg, m.Grant):
                        sent[1] = msg.batches
                return sent[1] > sent[0]

            wait_for(credited, 10, what="credit for the hostile peer")
            bad.send_multipart(frames)
            sent[0] += 1

        header = msgpack.unpackb(wire.encode_batch([np.zeros(4, np.uint8)], producer="evil",
                                                   session=1, seq=0)[0])
        lying = dict(header, a=[["|u1", [1 << 20]]])
        objdt = dict(header, a=[["|O", [4]]])
        with_credit([msgpack.packb(lying), b"\0" * 4])
        with_credit([b"\xc1garbage"])  # a one-frame batch: its header is not msgpack
        with_credit([msgpack.packb(objdt), b"\0" * 32])
        with_credit([msgpack.packb({"v": 99, "k": 2}), b""])
        # the same pickle payload msgpack-numpy would unpickle, in a header: never executed
        pickled = f"__import__('pathlib').Path({str(marker)!r}).touch()"
        with_credit([msgpack.packb(dict(header, d={b"nd": True, b"kind": b"O",
                                                    b"data": pickled.encode()})), b"\0" * 4])
        wait_for(lambda: sum(tb.broker.stats.rejected.values()) >= 4, 10, what="rejections")
        rejected = tb.broker.stats.rejected
        assert rejected.get("bad_msgpack") == 1 and rejected.get("shape_mismatch") == 1
        assert rejected.get("bad_dtype") == 1 and rejected.get("bad_version") == 1
        t = threading.Thread(target=send_dataflow, args=([[np.arange(3)]] * 5,
                             endpoints.ingress), kwargs={"epochs": 1, "link": FAST},
                             daemon=True)
        t.start()
        with RemoteDataZMQ(endpoints.egress, timeout=20, options=ConsumerOptions(link=FAST)) as src:
            got = list(itertools.islice(src, 5))
        t.join(10)
        assert len(got) >= 5 and tb.thread.is_alive()
        assert not marker.exists()
    finally:
        ctx.destroy(linger=0)


def test_tensorpack_send_dataflow_zmq_is_served_safely(thread_broker, endpoints, tmp_path):
    # Not imported here: tensorpack's import monkeypatches msgpack in the importing process.
    if importlib.util.find_spec("tensorpack") is None:
        pytest.skip("tensorpack is in the test extra")
    tp_addr = f"tcp://127.0.0.1:{free_port()}"
    thread_broker(tensorpack_ingress=tp_addr)
    script = textwrap.dedent(f"""
        import numpy as np
        from tensorpack.dataflow import DataFromList
        from tensorpack.dataflow.remote import send_dataflow_zmq
        dps = [[np.full((2, 3), i, np.float32), i, "label-%d" % i] for i in range(20)]
        send_dataflow_zmq(DataFromList(dps, shuffle=False), {tp_addr!r}, hwm=10)
    """)
    env = {**os.environ, "TENSORPACK_SERIALIZE": "msgpack", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with RemoteDataZMQ(endpoints.egress, timeout=90, options=ConsumerOptions(link=FAST)) as src:
            got = list(itertools.islice(src, 20))
    finally:
        proc.kill()
        proc.wait(10)
    values = sorted(int(dp[1]) for dp in got)
    assert values == list(range(20))
    for arr, i, label in got:
        assert arr.dtype == np.float32 and arr.shape == (2, 3) and (arr == i).all()
        assert label == f"label-{i}"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) for ``parser`` and every subcommand under it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


def _help_entries(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's entry in the rendered help, keyed by its first option string: from its
    "  --flag" line up to the next option's (the terminal is made wide enough that an entry
    only spans two lines when its flag column is full)."""
    out = parser.format_help()
    options = out[out.index("options:"):].splitlines()[1:]
    entries: dict[str, str] = {}
    for line in options:
        if line.startswith("  -"):
            key = line.split()[0].rstrip(",")
            entries[key] = line
        elif line.startswith("   ") and entries:
            entries[key] += " " + line.strip()
        else:
            break
    return entries


def test_help_documents_every_flag_with_its_default(monkeypatch):
    """Every subcommand's --help (all of them: ``feedline --help`` and its subcommands, down
    to ``lmdb info`` and ``keys show``) has a description, and shows each option's default
    exactly once, by this rule:

    - an option that takes a value shows exactly one "(default: ...)";
    - except a required option (e.g. producer's --config), which shows none: it has none;
    - and an option whose default is None, which shows at most one, and only one its help
      writes out ("(default: hostname-pid)", "(default: until SIGTERM)"): the formatter has
      no value to show, and "(default: None)" means nothing to a user;
    - a flag that takes no value (store_true) shows none: it is off unless given.
    """
    from feedline.commands.main import build_parser

    monkeypatch.setenv("COLUMNS", "1000")
    commands = dict(_commands(build_parser()))
    names = {" ".join(path) for path in commands}
    assert {"broker", "producer", "demo", "lmdb", "lmdb build", "lmdb info", "drain", "top",
            "keys", "keys generate", "keys show"} <= names, names
    for path, parser in commands.items():
        cmd = " ".join(("feedline", *path))
        assert "(default: None)" not in parser.format_help(), cmd
        if path:
            assert parser.description and parser.description.strip(), f"{cmd}: no description"
        entries = _help_entries(parser)
        for action in parser._actions:
            if not action.option_strings or action.default == argparse.SUPPRESS:
                continue  # positionals, --help, --version
            flag = action.option_strings[0]
            shown = entries[flag].count("(default:")
            if action.required or action.nargs == 0:
                assert shown == 0, f"{cmd} {flag}: required or a flag, but shows a default"
            elif action.default is None:
                assert shown <= 1, f"{cmd} {flag}: {shown} defaults"
            else:
                assert shown == 1, f"{cmd} {flag}: {shown} defaults"


def test_a_silent_producer_is_dropped_and_its_credit_returns(thread_broker, endpoints):
    # One batch of room: a producer that has not sent yet may hold it (a quarter of the
    # budget, at least one batch). Heartbeat timeout 1.5 s. Batches of 2 MiB: smaller ones
    # would count by their bytes, several to a batch of room.
    tb = thread_broker(max_batches=1, producer_window=1)
    ctx = zmq.Context()
    try:
        mute = _raw_dealer(ctx, endpoints.ingress)
        mute.send(m.encode(m.ProducerHello(producer="mute", session=5,
                                           max_batch_bytes=SMALL_BATCH, registration=1)))
        mute.send(m.encode(m.Want(sent=0, sent_bytes=0, size=SMALL_BATCH, registration=1)))

        def grant() -> m.Grant | None:
            while mute.poll(100):
                msg = m.decode(mute.recv())
                if isinstance(msg, m.Grant):
                    return msg
            return None

        credit = wait_for(grant, 10, what="credit for the mute producer")
        assert credit.batches == 1  # it holds all the room
        with Sender(endpoints.ingress, producer_id="live", link=FAST) as live:
            # No room is left until the broker gives up on the mute peer and takes back its
            # credit; then the live producer gets it. Nothing but heartbeats moves it.
            live.send([np.zeros(SMALL_BATCH, np.uint8)])  # waits in the producer for credit
            wait_for(lambda: tb.broker.stats.received == 1, 15, what="credit for live")
        dropped = tb.broker.registry.get_sample_value(
            "feedline_broker_dropped_peers_total", {"role": "producer", "reason": "timeout"})
        assert dropped == 1
    finally:
        ctx.destroy(linger=0)


def test_a_producer_says_when_it_waits_long_for_credit_and_why(thread_broker, endpoints,
                                                               caplog):
    """No consumer: the buffer fills, the producer's next batch waits for credit. After
    ``credit_warn`` seconds it says so, once per minute, naming the side that is slow."""
    thread_broker(max_batches=2)
    link = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5, credit_warn=1.0)
    stop = threading.Event()
    with caplog.at_level("WARNING", logger="feedline.producer.channel"), \
            Sender(endpoints.ingress, producer_id="waiting", link=link) as s:
        for i in range(4):
            s.send([whole(i)], stop=stop)  # 2 go, 1 waits, 1 in the outbox
        wait_for(lambda: "no credit" in caplog.text, 10, what="the warning")
    line = next(r.getMessage() for r in caplog.records if "no credit" in r.getMessage())
    assert "waiting" in line and "training side" in line and endpoints.ingress in line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_broker_stopped_by_a_signal_says_so_and_what_it_held(tmp_path, endpoints,
                                                                  sig) -> None:
    """A broker process serves 5 batches of ``default`` to a trainer and buffers 5 of
    ``idle``, which nobody reads; stopped by SIGTERM (or SIGINT), it exits 0 and its last
    stderr line names the signal, what it served and the 5 batches it drops (before: it
    exited without a word)."""
    port = free_port()
    broker = subprocess.Popen(
        [sys.executable, "-m", "feedline.broker", "--ingress", endpoints.ingress, "--egress",
         endpoints.egress, "--metrics-port", str(port), "--heartbeat-interval", "0.2",
         "--heartbeat-timeout", "1.5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for stream in ("default", "idle"):
            send_dataflow(([np.full(4, i, np.int32)] for i in range(5)), endpoints.ingress,
                          epochs=1, producer_id=stream, link=FAST, stream=stream)
        with RemoteDataZMQ(endpoints.egress, timeout=20, options=ConsumerOptions(link=FAST)) as src:
            assert len(list(itertools.islice(src, 5))) == 5
        wait_for(lambda: scrape(port).total("feedline_broker_inflight_batches") == 0 and
                 scrape(port).total("feedline_broker_buffer_batches") == 5, 20,
                 what="the trainer's batches reported taken, idle's buffered")
        broker.send_signal(sig)
        _, err = broker.communicate(timeout=20)
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.communicate()
    assert broker.returncode == 0, err
    last = err.strip().splitlines()[-1]
    assert f"INFO feedline.broker.cli: broker stopped by {signal.Signals(sig).name}: served 5 " \
           "batches to consumers; dropped what it held: 5 batches buffered" in last, err


def test_a_second_sigint_while_stopping_ends_the_broker_without_a_traceback(tmp_path,
                                                                           endpoints) -> None:
    """Ctrl-C in a terminal (or ``timeout`` and the shell) can deliver SIGINT twice: a new
    user got a KeyboardInterrupt traceback from zmq_poll. The second one ends it at once, in
    one line, status 130. If it came after the broker had stopped (its last line said so), the
    status is 0, or death by SIGINT (-2; 130 in a shell) when it landed while Python tore the
    process down: CPython puts the default handlers back then. CI saw that once."""
    broker = subprocess.Popen(
        [sys.executable, "-m", "feedline.broker", "--ingress", endpoints.ingress, "--egress",
         endpoints.egress, "--metrics-port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: Path(endpoints.egress[len("ipc://"):]).exists(), 30, what="broker")
        broker.send_signal(signal.SIGINT)
        time.sleep(0.02)  # the second while the first's shutdown runs (a broker takes ~0.1 s)
        broker.send_signal(signal.SIGINT)
        _, err = broker.communicate(timeout=20)
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.communicate()
    assert "Traceback" not in err, err
    assert broker.returncode in (0, 130, -signal.SIGINT), (broker.returncode, err)
    last = err.strip().splitlines()[-1]
    if broker.returncode == 130:
        assert last.startswith("feedline broker: interrupted again"), err
    else:  # it had stopped and said so before the second signal counted
        assert "INFO feedline.broker.cli: broker stopped by SIGINT" in last, err
