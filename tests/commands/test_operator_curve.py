"""A client the broker does not allow is visible to the operator: one WARNING line naming its
address and key fingerprint (rate-limited), and a callback for the broker's metric. Before,
pyzmq logged the refusal at DEBUG only and nothing counted it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
import zmq

from feedline import security
from feedline.procs import wait_for
from tests.support.curve import Keys

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path / "keys")


def _fingerprint(public_key_file: Path) -> str:
    return security.load_public(public_key_file)[:12].decode()  # the start of `keys show`


def test_broker_logs_a_refused_producer_with_its_address_and_key_fingerprint(
        broker_proc, daemons, endpoints, keys, tmp_path):
    broker = broker_proc("--curve-secret", str(keys.files["broker"][1]),
                         "--curve-allowed", str(keys.allowed))
    cfg = tmp_path / "p.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {"shapes": [[2]], "size": 4}}}))
    daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress,
            "--curve-secret", keys.files["stranger"][1],
            "--curve-broker-key", keys.files["broker"][0], name="stranger")
    fp = _fingerprint(keys.files["stranger"][0])

    def refusal() -> list[str]:
        return [line for line in broker.log_text().splitlines()
                if "WARNING" in line and "refused" in line]

    lines = wait_for(refusal, 30, what="the broker's refusal line")
    assert "at 127.0.0.1" in lines[0] and f"(key {fp})" in lines[0], lines[0]
    assert "--curve-allowed" in lines[0]


def test_denials_call_back_each_time_and_log_one_line_per_interval(keys, caplog):
    """A stranger retrying is counted every time (the metric) and logged once per interval
    (the log), with the count of lines held back in the next one."""
    ctx = zmq.Context()
    denied: list[tuple[str, str]] = []
    auth = keys.server().authenticator(ctx, on_denied=lambda a, f: denied.append((a, f)))
    server = ctx.socket(zmq.ROUTER)
    clients: list[zmq.Socket] = []
    try:
        keys.server().apply(server)
        server.linger = 0
        port = server.bind_to_random_port("tcp://127.0.0.1")
        with caplog.at_level(logging.WARNING, logger="feedline.security"):
            for _ in range(3):  # three connections, three handshakes refused
                c = ctx.socket(zmq.DEALER)
                c.linger = 0
                keys.client("stranger").apply(c)
                c.connect(f"tcp://127.0.0.1:{port}")
                clients.append(c)
            wait_for(lambda: len(denied) >= 3, 20, what="three denials")
        fp = _fingerprint(keys.files["stranger"][0])
        assert set(denied) == {("127.0.0.1", fp)}
        lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) == 1 and fp in lines[0]
        assert security.fingerprint(security.load_public(keys.files["stranger"][0])) == fp
    finally:
        for c in clients:
            c.close(0)
        server.close(0)
        auth.stop()
        ctx.term()
