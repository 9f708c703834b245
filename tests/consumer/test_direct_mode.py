"""Direct mode and many training hosts: a trainer that serves its producers itself
(``RemoteDataZMQ(addr, bind=True)``), and one producer fleet serving several trainers.

Real producer processes (``python -m feedline.producer`` with a YAML file,
                         as deployed), real sockets
on 127.0.0.1, real ``kill -9``.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.consumer.direct import DirectConfig
from feedline.errors import ReceiveTimeout
from feedline.procs import free_port, wait_for
from feedline.producer.targets import Targets
from feedline.serving.budget import DEPTH
from feedline.transport.link import LinkConfig
from tests.support.curve import Keys
from tests.support.flow_support import queue_when_settled

MiB = 1 << 20
FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
LIVENESS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")


def pipeline(tmp_path: Path, name: str, size: int = 100000, epochs: int | None = None) -> Path:
    """A fake source: datapoint i is [int64 i], [float32 4x4]: batches we can count."""
    cfg: dict = {"source": {"fake": {"shapes": [[1], [4, 4]], "dtypes": ["int64", "float32"],
                                     "size": size, "random": False}}}
    if epochs is not None:
        cfg["epochs"] = epochs
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def producer(daemons, cfg: Path, *brokers: str, name: str = "p", extra: tuple = ()):
    args = ["--config", cfg, "--id", name, *LIVENESS, *extra]
    for b in brokers:
        args += ["--broker", b]
    return daemons("feedline.producer", *args, name=name)


def test_the_same_producer_and_yaml_feed_a_trainer_directly(daemons, tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    producer(daemons, pipeline(tmp_path, "fake", size=50, epochs=1), addr, name="direct-1")
    with RemoteDataZMQ(addr, bind=True, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        got = list(itertools.islice(src, 50))
        wait_for(lambda: src.stats().get("direct-1") and src.stats()["direct-1"].finished, 20,
                 what="end of stream")
        stats = src.stats()["direct-1"]
    assert stats.received == 50 and stats.lost == 0
    assert {b.producer for b in got} == {"direct-1"}
    assert all(b.datapoint[1].shape == (4, 4) for b in got)


@pytest.mark.parametrize("shape, most", [
    ([1], DEPTH * 2),  # tiny batches: the window of 2 counts them by bytes
    ([9 * MiB], 2),  # batches over 8 MiB: 2, one by one
])
def test_a_trainer_that_stops_taking_holds_its_window_counted_by_bytes(daemons, tmp_path,
                                                                      shape, most):
    """A model that took one batch and stopped: what the trainer queues (and has granted)
    stays within its window, counted by bytes (budget.depth): up to DEPTH (128) x window of tiny
    batches, the window itself of batches over 8 MiB. Before the bytes count, tiny batches
    stopped at 2 too, and the credit round trip, not the wire, set their rate."""
    addr = f"tcp://127.0.0.1:{free_port()}"
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [shape], "dtypes": ["uint8"], "size": 1000, "random": False}}}))
    producer(daemons, cfg, addr, name="p")
    registry = CollectorRegistry()
    with RemoteDataZMQ(addr, bind=True, timeout=30,
                       options=ConsumerOptions(window=2, link=FAST, registry=registry)) as src:
        samples = queue_when_settled(iter(src), registry)
    assert max(samples) == most, samples


def test_direct_mode_with_curve_keys_lets_in_only_allowed_producers(daemons, tmp_path,
                                                                     monkeypatch):
    keys = Keys(tmp_path / "keys")
    addr = f"tcp://127.0.0.1:{free_port()}"
    cfg = pipeline(tmp_path, "fake")
    registry = CollectorRegistry()
    for name in ("producer", "stranger"):
        producer(daemons, cfg, addr, name=name, extra=(
            "--curve-secret", str(keys.files[name][1]),
            "--curve-broker-key", str(keys.files["broker"][0])))
    with RemoteDataZMQ(addr, bind=True, curve=keys.server(), timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST, registry=registry)) as src:
        got = list(itertools.islice(src, 30))
        wait_for(lambda: (registry.get_sample_value("feedline_broker_curve_denied_total")
                          or 0) >= 1, 20, what="the stranger refused at the handshake")
    assert {b.producer for b in got} == {"producer"}


def test_direct_mode_refuses_an_exposed_address_without_keys():
    with pytest.raises(ValueError, match="without CURVE keys"):
        RemoteDataZMQ(f"tcp://0.0.0.0:{free_port()}", bind=True)
    with pytest.raises(TypeError, match="ServerKeys"):
        RemoteDataZMQ("tcp://127.0.0.1:1", bind=True, curve=object())  # type: ignore[arg-type]


def test_a_producer_killed_and_restarted_keeps_the_trainer_fed(daemons, tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    cfg = pipeline(tmp_path, "fake")
    registry = CollectorRegistry()
    first = producer(daemons, cfg, addr, name="victim")
    with RemoteDataZMQ(addr, bind=True, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST, registry=registry)) as src:
        it = iter(src)
        assert {next(it).producer for _ in range(20)} == {"victim"}
        first.kill9()
        dropped = 'feedline_broker_dropped_peers_total'

        def dropped_for_timeout() -> bool:
            nonlocal it
            try:
                next(it)  # drain what was queued before the kill
            except ReceiveTimeout:
                it = iter(src)  # a generator that raised is done: take a new one
            v = registry.get_sample_value(dropped, {"role": "producer", "reason": "timeout"})
            return (v or 0) >= 1

        src.timeout = 0.2
        wait_for(dropped_for_timeout, 20, what="the dead producer dropped")
        src.timeout = 30
        it = iter(src)
        producer(daemons, cfg, addr, name="victim")  # the same id, a new process
        assert {next(it).producer for _ in range(20)} == {"victim"}
        unconfirmed = registry.get_sample_value(
            "feedline_broker_unconfirmed_batches_total", {"role": "producer"})
    # Its batches are tiny: the window of 4 counts them by bytes (budget.depth), 64.
    assert unconfirmed is not None and unconfirmed <= DEPTH * DirectConfig().producer_window


class Trainer:
    """A direct-mode trainer in a thread of this process, counting what it gets."""

    def __init__(self, addr: str, step: float = 0.0, keep: bool = False) -> None:
        self.addr, self.step, self.keep = addr, step, keep
        self.count = 0
        self.got: list[int] = []  # with ``keep``: each batch's first component, as an int
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with RemoteDataZMQ(self.addr, bind=True, timeout=0.3,
                           options=ConsumerOptions(link=FAST)) as src:
            while not self._stop.is_set():
                try:
                    for dp in src:
                        if self.keep:
                            self.got.append(int(dp[0]))
                        self.count += 1
                        if self.step:
                            time.sleep(self.step)  # a slower model
                        if self._stop.is_set():
                            break
                except ReceiveTimeout:
                    continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)
        assert not self._thread.is_alive()


def test_one_producer_serves_two_training_hosts_that_come_and_go(daemons, tmp_path):
    """Each batch goes to one host, by credit: the faster host gets more, and a host that
    leaves and comes back does not stop the other being served."""
    a_addr, b_addr = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    a, b = Trainer(a_addr), Trainer(b_addr, step=0.05)
    producer(daemons, pipeline(tmp_path, "fake"), a_addr, b_addr, name="fleet")
    try:
        wait_for(lambda: a.count >= 40 and b.count >= 10, 30, what="both hosts served")
        assert a.count > 2 * b.count, (a.count, b.count)  # the faster host got more
        b.close()  # host B leaves
        before = a.count
        wait_for(lambda: a.count >= before + 100, 20, what="host A served without B")
        b = Trainer(b_addr)  # host B restarts at the same address
        wait_for(lambda: b.count >= 20, 30, what="host B served again")
    finally:
        a.close()
        b.close()


def test_a_dns_name_stands_for_every_host_behind_it_and_is_resolved_again():
    """A headless Service's name resolves to one address per ready pod; pods come and go."""
    answers = {"trainers.local": ["10.0.0.1", "10.0.0.2"]}
    t = Targets(["tcp://trainers.local:7878", "ipc:///tmp/x.sock", "tcp://127.0.0.1:9"],
                resolve=lambda host, port: list(answers[host]))
    assert t.endpoints() == ["tcp://10.0.0.1:7878", "tcp://10.0.0.2:7878", "ipc:///tmp/x.sock",
                             "tcp://127.0.0.1:9"]
    answers["trainers.local"] = ["10.0.0.2", "10.0.0.3"]
    t.refresh()
    assert t.endpoints()[:2] == ["tcp://10.0.0.2:7878", "tcp://10.0.0.3:7878"]

    def fails(host: str, port: int) -> list[str]:
        raise OSError("temporary failure in name resolution")

    t._resolve = fails
    t.refresh()  # a failed lookup keeps what was known
    assert t.endpoints()[:2] == ["tcp://10.0.0.2:7878", "tcp://10.0.0.3:7878"]


def test_a_host_the_name_no_longer_lists_is_left_after_its_answer_and_loses_nothing(caplog):
    """The name stands for hosts A and B, then for A only: the producer says BYE to B and
    closes that link once B answered it, not at once (a connection closed with a GRANT unread
    is reset, and the reset throws away what the kernel had not sent yet). Every batch sent
    arrives once, at A or at B, and the producer goes on serving A meanwhile."""
    import logging

    from feedline.producer import Sender

    port = free_port()
    answers = {"trainers.test": ["127.0.0.1", "127.0.0.2"]}
    a = Trainer(f"tcp://127.0.0.1:{port}", keep=True)
    b = Trainer(f"tcp://127.0.0.2:{port}", keep=True)
    sent = 0

    def left() -> bool:
        return any("left tcp://127.0.0.2" in r.getMessage() for r in caplog.records)

    try:
        with caplog.at_level(logging.INFO, logger="feedline.producer.leaving"), \
                Sender(f"tcp://trainers.test:{port}", producer_id="dns", link=FAST) as s:
            s.targets._resolve = lambda host, _port: list(answers[host])
            s.targets.refresh()
            deadline = time.monotonic() + 30
            while not (a.count >= 20 and b.count >= 20):
                assert time.monotonic() < deadline, (a.count, b.count)
                s.send([sent])
                sent += 1
            answers["trainers.test"] = ["127.0.0.1"]
            s.targets.refresh()  # what the resolver thread does every 30 s
            while not left():  # B is dropped within a second (the targets are synced then)
                assert time.monotonic() < deadline, "B never left"
                s.send([sent])
                sent += 1
            for _ in range(50):
                s.send([sent])
                sent += 1
        wait_for(lambda: a.count + b.count >= sent, 20, what="every batch sent taken")
        assert sorted(a.got + b.got) == list(range(sent))
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert f"left tcp://127.0.0.2:{port} (it answered BYE" in text, text
        assert b.got and max(b.got) < max(a.got)  # A served on, after B was left
    finally:
        a.close()
        b.close()


def test_a_producer_follows_the_hosts_a_name_resolves_to():
    """End to end with a real Sender: the name first stands for host A (127.0.0.1), then for
    A and B (127.0.0.2, same port, as pods behind a headless Service): B gets served too."""
    from feedline.producer import Sender

    port = free_port()
    answers = {"trainers.test": ["127.0.0.1"]}
    a = Trainer(f"tcp://127.0.0.1:{port}")
    b = Trainer(f"tcp://127.0.0.2:{port}")
    stop = threading.Event()
    try:
        with Sender(f"tcp://trainers.test:{port}", producer_id="dns", link=FAST) as s:
            s.targets._resolve = lambda host, _port: list(answers[host])
            s.targets.refresh()

            def push() -> None:
                for i in itertools.count():
                    try:
                        s.send([i], stop=stop)
                    except Exception:  # Stopped: the test is over
                        return

            t = threading.Thread(target=push, daemon=True)
            t.start()
            wait_for(lambda: a.count >= 20, 20, what="host A served")
            assert b.count == 0
            answers["trainers.test"] = ["127.0.0.1", "127.0.0.2"]
            s.targets.refresh()  # what the resolver thread does every 30 s
            wait_for(lambda: b.count >= 20, 20, what="host B found and served")
            stop.set()
            t.join(10)
    finally:
        stop.set()
        a.close()
        b.close()
