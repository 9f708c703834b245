"""CURVE: who may talk to a broker, proven with the ZeroMQ socket monitor's handshake events.

Matrix: an allowed key is delivered; an unknown key and a client without CURVE are refused at
the handshake and get nothing in; a consumer with an unknown key gets nothing out. Keys wrong
on disk stop the daemons at startup with a message naming the file.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml
import zmq
from zmq.utils.monitor import recv_monitor_message

from feedline import security
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ReceiveTimeout
from feedline.procs import wait_for
from feedline.producer import send_dataflow
from feedline.protocol import wire
from feedline.transport.link import LinkConfig
from tests.support import ROOT
from tests.support.curve import Keys

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
_RESULTS = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "ok",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth_refused",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol_refused",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
}




@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path / "keys")


def handshake(addr: str, curve: security.ClientKeys | None) -> str:
    """Connect a DEALER and return how its first handshake ended (from the socket monitor)."""
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    mon = sock.get_monitor_socket()
    try:
        if curve is not None:
            curve.apply(sock)
        sock.connect(addr)
        poller = zmq.Poller()
        poller.register(mon, zmq.POLLIN)
        for _ in range(200):  # bounded: connect/retry events come before the handshake's
            if not poller.poll(20_000):
                return "no_event"
            event = recv_monitor_message(mon)["event"]
            if event in _RESULTS:
                return _RESULTS[event]
        return "no_handshake"
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)


def data(n: int, tag: int) -> list[list[np.ndarray]]:
    return [[np.full((4, 4), tag, np.int32), np.arange(i, i + 1)] for i in range(n)]


def send(addr: str, n: int, tag: int, curve: security.ClientKeys | None,
         stop: threading.Event | None = None) -> threading.Thread:
    t = threading.Thread(target=send_dataflow, args=(data(n, tag), addr), daemon=True,
                         kwargs={"epochs": 1, "producer_id": f"p{tag}", "stop": stop,
                                 "link": FAST, "curve": curve})
    t.start()
    return t


def test_allowed_keys_deliver_end_to_end(thread_broker, endpoints, keys):
    tb = thread_broker(curve=keys.server())
    assert handshake(endpoints.ingress, keys.client("producer")) == "ok"
    assert handshake(endpoints.egress, keys.client("consumer")) == "ok"
    sender = send(endpoints.ingress, 20, 7, keys.client("producer"))
    link, curve = FAST, keys.client("consumer")
    with RemoteDataZMQ(endpoints.egress, timeout=20, curve=curve,
                       options=ConsumerOptions(link=link)) as src:
        got = list(itertools.islice(src, 20))
    sender.join(10)
    assert [int(dp[1][0]) for dp in got] == list(range(20))
    assert all((dp[0] == 7).all() for dp in got)
    assert tb.broker.stats.rejected == {}


def test_unknown_key_and_plain_client_are_refused_and_get_nothing_in(
        thread_broker, endpoints, keys):
    tb = thread_broker(curve=keys.server())
    assert handshake(endpoints.ingress, keys.client("stranger")) == "auth_refused"
    # libzmq reports a NULL client at a CURVE server as a protocol failure or, on the client
    # side of some versions, without detail: either way not "ok".
    assert handshake(endpoints.ingress, None) in ("protocol_refused", "failed")
    # A stranger's producer runs (and retries) next to an allowed one: only the allowed
    # producer's batches arrive, and the broker never even saw a message from the stranger.
    stop = threading.Event()
    stranger = send(endpoints.ingress, 50, 666, keys.client("stranger"), stop)
    plain = send(endpoints.ingress, 50, 667, None, stop)
    sender = send(endpoints.ingress, 10, 1, keys.client("producer"))
    link, curve = FAST, keys.client("consumer")
    with RemoteDataZMQ(endpoints.egress, timeout=20, curve=curve,
                       return_meta=True, options=ConsumerOptions(window=1, link=link)) as src:
        got = list(itertools.islice(src, 10))
        sender.join(10)
    assert {b.producer for b in got} == {"p1"}
    assert tb.broker.stats.received == 10
    assert tb.broker.stats.rejected == {}  # nothing from the stranger got far enough to reject
    assert stranger.is_alive() and plain.is_alive()  # still knocking, never let in
    stop.set()
    stranger.join(10)
    plain.join(10)
    assert not stranger.is_alive() and not plain.is_alive()


def test_consumer_with_unknown_key_gets_nothing_out(thread_broker, endpoints, keys, caplog):
    caplog.set_level(logging.WARNING, logger="feedline.transport.link")
    tb = thread_broker(curve=keys.server())
    sender = send(endpoints.ingress, 3, 2, keys.client("producer"))
    wait_for(lambda: tb.broker.stats.received == 3, 20, what="batches buffered")
    assert handshake(endpoints.egress, keys.client("stranger")) == "auth_refused"
    link, curve = FAST, keys.client("stranger")
    with RemoteDataZMQ(endpoints.egress, timeout=2, curve=curve,
                       options=ConsumerOptions(link=link)) as src, \
            pytest.raises(ReceiveTimeout):
        next(iter(src))
    assert tb.broker.stats.forwarded == 0
    # The link's socket monitor saw the refused handshake and said what to do.
    assert any("did not accept our CURVE key" in r.getMessage()
               and "--curve-allowed" in r.getMessage() for r in caplog.records), caplog.text
    sender.join(10)


def test_a_consumer_without_keys_is_told_why_and_curve_kwarg_lets_it_in(thread_broker,
                                                                       endpoints, keys):
    """CURVE guards the ipc:// egress too: a training process without keys hears nothing, and
    its timeout must say that keys may be the reason, not only "no producers"."""
    thread_broker(curve=keys.server())
    sender = send(endpoints.ingress, 5, 3, keys.client("producer"))
    with RemoteDataZMQ(endpoints.egress, timeout=2, options=ConsumerOptions(link=FAST)) as src, \
            pytest.raises(ReceiveTimeout, match="CURVE"):
        next(iter(src))
    with RemoteDataZMQ(endpoints.egress, timeout=20, curve=keys.client("consumer"),
                       options=ConsumerOptions(link=FAST)) as src:
        got = list(itertools.islice(src, 5))
    sender.join(10)
    assert [int(dp[1][0]) for dp in got] == list(range(5))


# ------------------------------------------------------------------------- keys on disk


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "feedline.commands", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_keys_generate_writes_a_private_secret_and_refuses_to_overwrite(tmp_path):
    r = _cli("keys", "generate", str(tmp_path / "k"), "--name", "broker")
    assert r.returncode == 0, r.stderr
    pub, sec = tmp_path / "k" / "broker.key", tmp_path / "k" / "broker.key_secret"
    assert (sec.stat().st_mode & 0o777) == 0o600
    public, secret = security.load_secret(sec)
    assert security.load_public(pub) == public and len(secret) == 40
    assert zmq.curve_public(secret) == public  # the pair belongs together
    r = _cli("keys", "generate", str(tmp_path / "k"), "--name", "broker")
    assert r.returncode == 1 and "refusing to overwrite" in r.stderr
    assert security.load_secret(sec) == (public, secret)
    r = _cli("keys", "show", str(sec))
    assert r.returncode == 0 and r.stdout.strip() == public.decode()


def _broker(endpoints, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # Every case here fails before binding, so run() returns; a broker that did start would
    # hit the timeout instead, failing the test.
    return _cli("broker", "--ingress", endpoints.ingress, "--egress", endpoints.egress,
                "--metrics-port", "0", *extra, env=env)


def test_broker_refuses_a_readable_secret_key(endpoints, keys):
    sec = keys.files["broker"][1]
    sec.chmod(0o644)
    r = _broker(endpoints, "--curve-secret", str(sec), "--curve-allowed", str(keys.allowed))
    assert r.returncode != 0
    assert f"{sec}: secret key file has mode 0644" in r.stderr
    assert "Traceback" not in r.stderr


def test_broker_refuses_missing_keys(endpoints, keys, tmp_path):
    sec = keys.files["broker"][1]
    r = _broker(endpoints, "--curve-secret", str(tmp_path / "nope"),
                "--curve-allowed", str(keys.allowed))
    assert r.returncode != 0 and "no such secret key file" in r.stderr
    r = _broker(endpoints, "--curve-secret", str(sec), "--curve-allowed", str(tmp_path / "x"))
    assert r.returncode != 0 and "no such directory of allowed public keys" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _broker(endpoints, "--curve-secret", str(sec), "--curve-allowed", str(empty))
    assert r.returncode != 0 and "holds no allowed public keys" in r.stderr
    # one of the pair alone (here from the environment) is an error, not plain TCP
    r = _broker(endpoints, env={security.ENV_SECRET: str(sec)})
    assert r.returncode != 0 and "needs both" in r.stderr
    assert "Traceback" not in r.stderr


def test_broker_refuses_an_exposed_address_without_keys(endpoints):
    r = _cli("broker", "--ingress", f"tcp://0.0.0.0:{endpoints.port}", "--egress",
             endpoints.egress, "--metrics-port", "0")
    assert r.returncode != 0
    assert f"refusing to listen on tcp://0.0.0.0:{endpoints.port} without CURVE keys" in r.stderr
    assert "--insecure" in r.stderr


def test_producer_refuses_a_readable_secret_key(keys, tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {"shapes": [[2]], "size": 2}}}))
    sec = keys.files["producer"][1]
    sec.chmod(0o640)
    r = _cli("producer", "--config", str(cfg), "--broker", "tcp://127.0.0.1:1",
             "--curve-secret", str(sec), "--curve-broker-key", str(keys.files["broker"][0]))
    assert r.returncode != 0 and "mode 0640" in r.stderr and "Traceback" not in r.stderr


def test_drain_takes_keys_from_the_environment_and_refuses_a_readable_secret(keys):
    """`feedline drain` (a consumer process) checks its keys at startup like the daemons."""
    sec = keys.files["consumer"][1]
    sec.chmod(0o644)
    r = _cli("drain", "--broker", "tcp://127.0.0.1:1", "--duration", "5",
             env={security.ENV_SECRET: str(sec),
                  security.ENV_BROKER_KEY: str(keys.files["broker"][0])})
    assert r.returncode != 0 and f"{sec}: secret key file has mode 0644" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("drain", "--broker", "tcp://127.0.0.1:1", "--duration", "5",
             env={security.ENV_SECRET: str(sec)})
    assert r.returncode != 0 and "needs both" in r.stderr


def test_keys_need_a_libzmq_with_curve(keys, monkeypatch):
    """Startup check: a libzmq without CURVE is an error naming the cause, not plain TCP.
    (Every pyzmq wheel has CURVE, so the check is driven through zmq.has.)"""
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(security.CurveUnavailable, match="built without CURVE"):
        keys.server()
    with pytest.raises(security.CurveUnavailable, match="built without CURVE"):
        keys.client("producer")


def test_address_classification():
    assert security.is_loopback("tcp://127.0.0.1:7878")
    assert security.is_loopback("tcp://[::1]:7878")
    assert security.is_loopback("tcp://localhost:7878")
    assert security.is_loopback("ipc:///tmp/x.sock")
    assert not security.is_loopback("tcp://0.0.0.0:7878")
    assert not security.is_loopback("tcp://*:7878")
    assert not security.is_loopback("tcp://eth0:7878")
    assert not security.is_loopback("tcp://10.1.2.3:7878")


def test_secret_keys_never_appear_in_repr(keys):
    c, s = keys.client("producer"), keys.server()
    assert c.secret.decode() not in repr(c) and s.secret.decode() not in repr(s)


def test_processes_with_keys_from_flags_and_environment(broker_proc, daemons, endpoints, keys,
                                                        tmp_path):
    """The daemons' own flags: a broker process with keys, a producer process taking its keys
    from the environment, a consumer in this process."""
    broker_proc("--curve-secret", str(keys.files["broker"][1]),
                "--curve-allowed", str(keys.allowed))
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {"shapes": [[3]], "dtypes": ["int32"],
                                                       "size": 5, "random": False}},
                                   "epochs": 1}))
    env_keys = {security.ENV_SECRET: str(keys.files["producer"][1]),
                security.ENV_BROKER_KEY: str(keys.files["broker"][0])}
    os.environ.update(env_keys)  # Daemon inherits this process's environment
    try:
        daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress,
                "--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5", name="producer")
    finally:
        for k in env_keys:
            os.environ.pop(k)
    link, curve = FAST, keys.client("consumer")
    with RemoteDataZMQ(endpoints.egress, timeout=30, curve=curve,
                       options=ConsumerOptions(link=link)) as src:
        got = list(itertools.islice(src, 5))
    assert len(got) == 5 and all(np.asarray(dp[0]).shape[-1] == 3 for dp in got)


def test_broker_side_rejects_stay_zero_under_curve_for_plain_garbage(thread_broker, endpoints,
                                                                    keys):
    """Raw bytes at a CURVE port never reach the decoder: libzmq drops them at the handshake."""
    tb = thread_broker(curve=keys.server())
    import socket as pysocket

    with pysocket.create_connection(("127.0.0.1", endpoints.port), timeout=5) as s:
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + os.urandom(4096))
    assert handshake(endpoints.ingress, keys.client("producer")) == "ok"
    assert tb.broker.stats.rejected == {} and tb.broker.stats.received == 0
    assert wire.PROTOCOL_VERSION == 2
