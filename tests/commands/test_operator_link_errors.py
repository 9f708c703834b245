"""What a producer and a consumer say when the other side is not there or not right (issue 53,
findings 16 and 17): real processes and sockets on 127.0.0.1, a real CURVE broker.

A producer that never reached a broker says so, naming the address and the likely cause
(nothing listening, CURVE keys missing or wrong), again with backoff for as long as it lasts,
and its exit summary counts only the batches a broker took. A consumer is told in one line:
at once where that is knowable (an address without a scheme, a producers' port), at its
timeout otherwise, with what its link saw (no handshake, CURVE keys; a broker silent for N s).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import yaml
import zmq

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import AddressError, ConfigError, ReceiveTimeout
from feedline.procs import free_port, wait_for
from feedline.producer import Sender
from feedline.security import ClientKeys
from feedline.transport.link import LinkConfig
from tests.support.curve import Keys
from tests.support.flow_support import Metrics, start_broker

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.0)
NEVER = "never connected to a broker"
needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path / "keys")


@pytest.fixture
def big_batches(tmp_path: Path) -> Path:
    """A pipeline of 9.6 MB batches (the issue's: two of them fill the producer's backlog)."""
    cfg = tmp_path / "big.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {"shapes": [[1200, 1000, 2]],
                                                       "dtypes": ["float32"], "size": 4}}}))
    return cfg


def producer(daemons, cfg: Path, broker: str, name: str, *extra: object):
    """``feedline producer`` with a 1 s heartbeat timeout: its reports come at 1, 3, 7 s ..."""
    return daemons("feedline.producer", "--config", cfg, "--broker", broker,
                   "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1", *extra,
                   name=name)


def warnings(text: str, *needles: str) -> list[str]:
    return [line for line in text.splitlines()
            if "WARNING" in line and all(n in line for n in needles)]


def curve_broker(broker_proc, keys: Keys):
    return broker_proc("--curve-secret", str(keys.files["broker"][1]),
                       "--curve-allowed", str(keys.allowed))


# -- finding 16: a producer without a broker ---------------------------------------------

def test_a_producer_that_never_reached_a_broker_says_so_with_backoff_and_sent_nothing(
        daemons, big_batches):
    """Claim: a producer whose --broker has nothing listening logs, at WARNING, that it never
    connected, naming the address and "nothing accepts connections"; again and again, each
    report further from the last (backoff: 1, 3, 7, 15 s into the search with a 1 s
    heartbeat timeout); never "silent for" (no broker was ever there to fall silent); and on
    SIGTERM its summary says it sent 0 batches and why.

    Before: "broker ... silent for 1.0s (it stopped, restarted, ...); reconnecting" once (a
    30 s rate limit held the rest back), then nothing; on exit "sent 2 batches (19.2 MB)"
    though no broker existed (the two batches handed to its backlog)."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    p = producer(daemons, big_batches, addr, "nobody-there")
    wait_for(lambda: len(warnings(p.log_text(), NEVER)) >= 4 or not p.alive(), 60,
             interval=0.2, what="four reports of the search")
    assert p.alive(), p.log_text()[-2000:]
    p.signal(signal.SIGTERM)
    p.proc.wait(20)
    text = p.log_text()
    reports = warnings(text, NEVER, addr, "nothing accepts connections")
    assert len(reports) >= 4, text[-3000:]
    assert not warnings(text, "silent for"), text[-3000:]
    # The search's age, as each report gives it: the gaps between reports grow (backoff).
    ages = [int(m.group(1)) for line in reports
            if (m := re.search(r"trying for (\d+)s", line))]
    gaps = [b - a for a, b in zip(ages, ages[1:], strict=False)]
    assert len(gaps) >= 3 and all(b > a for a, b in zip(gaps, gaps[1:], strict=False)), ages
    summary = warnings(text, "sent 0 batches")
    assert summary and NEVER in summary[0] and addr in summary[0], text[-3000:]
    assert not re.search(r"sent [1-9]\d* batches", text), text[-3000:]


@needs_curve
def test_a_producer_without_keys_or_with_the_wrong_broker_key_names_curve(
        broker_proc, daemons, endpoints, keys, big_batches):
    """Claim: against a broker with CURVE keys, a producer with no keys is told the broker
    has CURVE keys and it has none (naming --curve-secret and --curve-broker-key); one given
    another key as the broker's is asked whether --curve-broker-key is that broker's key.
    Both say they never connected, and both summaries say 0 batches sent.

    Before: "silent for 5.0s" (nothing about keys), and "sent 2 batches (19.2 MB)"."""
    curve_broker(broker_proc, keys)
    bare = producer(daemons, big_batches, endpoints.ingress, "no-keys")
    wrong = producer(daemons, big_batches, endpoints.ingress, "wrong-key",
                     "--curve-secret", keys.files["producer"][1],
                     "--curve-broker-key", keys.files["stranger"][0])
    wait_for(lambda: warnings(bare.log_text(), NEVER) and warnings(wrong.log_text(), NEVER),
             30, interval=0.2, what="both producers' reports")
    for p in (bare, wrong):
        p.signal(signal.SIGTERM)
    for p in (bare, wrong):
        p.proc.wait(20)
    line = warnings(bare.log_text(), NEVER)[0]
    assert "has CURVE keys and this process has none" in line, line
    assert "--curve-secret" in line and "--curve-broker-key" in line, line
    line = warnings(wrong.log_text(), NEVER)[0]
    assert "CURVE handshake never completed" in line and "--curve-broker-key" in line, line
    for p in (bare, wrong):
        assert warnings(p.log_text(), "sent 0 batches", NEVER), p.log_text()[-2000:]


def test_a_producer_summary_counts_what_a_broker_took(broker_proc, daemons, endpoints,
                                                       big_batches):
    """Claim: with a broker but no trainer, the summary's "sent" is the batches the broker
    took (its feedline_broker_received_batches_total), not what the dataflow made; what it
    made beyond is named as made and not taken.

    Before: "sent N batches" with N every batch the dataflow handed over, the backlog's
    included."""
    _, metrics = start_broker(broker_proc, "--max-bytes", str(40 << 20))  # ~4 batches
    port = free_port()
    p = producer(daemons, big_batches, endpoints.ingress, "few", "--metrics-port", port)
    mine = Metrics(port)

    def made_more() -> bool:  # the dataflow is ahead of the broker by more than a backlog
        if not mine.up():
            return False
        made = mine.value("feedline_producer_stage_datapoints_total")
        return made >= metrics.value("feedline_broker_received_batches_total") + 3
    wait_for(made_more, 30, interval=0.2, what="the dataflow ahead of the broker")
    p.signal(signal.SIGTERM)
    p.proc.wait(20)
    text = p.log_text()
    got = re.search(r"sent (\d+) batches \(([\d.]+) MB\)", text)
    assert got, text[-2000:]
    received = metrics.value("feedline_broker_received_batches_total")
    assert int(got.group(1)) == received, (text[-2000:], received)
    assert "more made that no broker took" in text, text[-2000:]


# -- finding 17: a consumer without a broker ----------------------------------------------

def test_an_address_without_a_scheme_is_one_line_at_once() -> None:
    """Claim: ``RemoteDataZMQ("127.0.0.1:7879")`` raises AddressError (a ConfigError, a
    ValueError), the CLI's words: "no scheme; use tcp://127.0.0.1:7879"; so does a producer's
    ``Sender``.

    Before: a raw ZMQError ("Invalid argument") from the I/O thread after 20 frames of
    traceback, at the first iteration."""
    with pytest.raises(AddressError) as err:
        with RemoteDataZMQ("127.0.0.1:7879", timeout=5) as src:
            next(iter(src))
    assert isinstance(err.value, ConfigError) and isinstance(err.value, ValueError)
    assert "no scheme; use tcp://127.0.0.1:7879" in str(err.value), err.value
    assert "\n" not in str(err.value)
    with pytest.raises(AddressError, match="no scheme; use tcp://127.0.0.1:7879"):
        Sender("127.0.0.1:7879").close()


def test_a_consumer_with_nothing_listening_is_told_so() -> None:
    """Claim: the timeout of a consumer whose address has nothing listening says it never
    connected and that nothing accepts connections there.

    Before: "did not answer within 1.0s. Is it running at that address? If it has CURVE
    keys ..." (both guesses, whichever it was)."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    with RemoteDataZMQ(addr, timeout=1.5, options=ConsumerOptions(link=FAST)) as src:
        with pytest.raises(ReceiveTimeout) as err:
            next(iter(src))
    assert NEVER in str(err.value) and f"nothing accepts connections at {addr}" in str(
        err.value), err.value


@needs_curve
def test_a_consumer_without_keys_on_a_curve_broker_is_told_the_handshake_never_completed(
        broker_proc, endpoints, keys):
    """Claim: a consumer without keys on a CURVE broker (its ipc:// egress) times out with
    "handshake never completed" and the keys to give (curve=ClientKeys.load); one given the
    wrong broker key, with the broker_key to check.

    Before: "did not answer within 2.0s. Is it running at that address? If it has CURVE keys,
    it needs ours ..." for both, and for a broker that is not there."""
    curve_broker(broker_proc, keys)
    with RemoteDataZMQ(endpoints.egress, timeout=2.0, options=ConsumerOptions(link=FAST)) as src:
        with pytest.raises(ReceiveTimeout) as err:
            next(iter(src))
    text = str(err.value)
    assert "handshake never completed" in text and "CURVE keys" in text, text
    assert "curve=ClientKeys.load" in text, text
    wrong = ClientKeys.load(keys.files["consumer"][1], keys.files["stranger"][0])
    with RemoteDataZMQ(endpoints.egress, timeout=2.0, curve=wrong,
                       options=ConsumerOptions(link=FAST)) as src:
        with pytest.raises(ReceiveTimeout) as err:
            next(iter(src))
    text = str(err.value)
    assert "CURVE handshake never completed" in text and "broker_key" in text, text


def test_a_consumer_whose_broker_died_is_told_the_broker_is_silent(broker_proc, endpoints):
    """Claim: a consumer registered with a broker that is then killed -9 times out saying
    the broker has been silent for N s (N at least the heartbeat timeout), not to check the
    producers.

    Before: "no batch from the broker ... (producers seen so far: none). Are producers
    connected to its ingress, with this stream?" though its link knew the broker was
    silent."""
    broker = broker_proc()
    with RemoteDataZMQ(endpoints.egress, timeout=3.0, options=ConsumerOptions(link=FAST)) as src:
        with pytest.raises(ReceiveTimeout):  # registered, no producer: the broker answers
            next(iter(src))
        broker.kill9()
        with pytest.raises(ReceiveTimeout) as err:
            next(iter(src))
    text = str(err.value)
    silent = re.search(r"has been silent for (\d+)s", text)
    assert silent and int(silent.group(1)) >= FAST.heartbeat_timeout, text
    assert "Are producers connected" not in text, text
