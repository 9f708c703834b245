"""An operator's address mistakes: each is one line naming the flag, the value, the reason and
what to do, with a non-zero exit status, before anything is bound; and a second broker never
takes over a live one. Real daemons, real sockets on 127.0.0.1 and ipc:// under tmp_path."""

from __future__ import annotations

import itertools
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.procs import free_port, wait_for
from feedline.producer import send_dataflow
from feedline.transport.link import LinkConfig
from tests.support import tcp_ready
from tests.support.operator_support import feedline, one_line_failure

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


@pytest.fixture
def pipeline(tmp_path: Path) -> Path:
    cfg = tmp_path / "p.yaml"
    cfg.write_text("source: {fake: {shapes: [[2]], size: 4}}\nepochs: 1\n")
    return cfg


@pytest.fixture
def held_port():
    """A TCP port on 127.0.0.1 that a listening socket holds for the test."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def _send(addr: str, n: int) -> threading.Thread:
    data = [[np.full((2, 2), i, np.int32)] for i in range(n)]
    t = threading.Thread(target=send_dataflow, args=(data, addr), daemon=True,
                         kwargs={"epochs": 1, "producer_id": "p", "link": FAST})
    t.start()
    return t


def test_a_second_broker_on_a_live_ipc_egress_refuses_and_the_first_keeps_serving(
        daemons, tmp_path):
    """The second `docker compose up`: same egress, same metrics port. It must refuse, naming
    the egress, and a consumer connecting afterwards must still get the first broker's
    batches (before the fix the second bound the path first, took it over, then died on the
    metrics port, and new consumers of the first got nothing)."""
    egress = f"ipc://{tmp_path}/egress.sock"
    port, metrics = free_port(), free_port()
    first = daemons("feedline.broker", "--ingress", f"tcp://127.0.0.1:{port}", "--egress", egress,
                    "--metrics-port", str(metrics), "--heartbeat-interval", "0.2",
                    "--heartbeat-timeout", "1.5", name="first")
    wait_for(lambda: tcp_ready(port) or not first.alive(), 20, what="first broker")
    assert first.alive(), first.log_text()

    r = feedline("broker", "--ingress", f"tcp://127.0.0.1:{free_port()}", "--egress", egress,
                 "--metrics-port", str(metrics))
    one_line_failure(r, "feedline broker:", "--egress", egress, "another process is listening")

    sender = _send(f"tcp://127.0.0.1:{port}", 5)
    with RemoteDataZMQ(egress, timeout=20, options=ConsumerOptions(link=FAST)) as src:
        got = list(itertools.islice(src, 5))
    sender.join(10)
    assert sorted(int(dp[0][0, 0]) for dp in got) == list(range(5))
    assert first.alive()


def test_a_stale_ipc_socket_file_nobody_listens_on_is_replaced(daemons, tmp_path):
    """The other side of the check: a socket file left by a process that died is not "in use"
    (a broker restarted after kill -9 must start)."""
    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the file stays, nobody listens
    port = free_port()
    b = daemons("feedline.broker", "--ingress", f"tcp://127.0.0.1:{port}", "--egress", f"ipc://{path}",
                "--metrics-port", "0", name="restarted")
    wait_for(lambda: tcp_ready(port) or not b.alive(), 20, what="broker")
    assert b.alive(), b.log_text()


def test_broker_ingress_port_in_use_is_one_line(held_port, tmp_path):
    r = feedline("broker", "--ingress", f"tcp://127.0.0.1:{held_port}",
                 "--egress", f"ipc://{tmp_path}/e.sock", "--metrics-port", "0")
    one_line_failure(r, "--ingress", f"tcp://127.0.0.1:{held_port}", "already in use",
                     "another port")
    assert not (tmp_path / "e.sock").exists()  # nothing bound before the refusal


def test_broker_metrics_port_in_use_is_one_line(held_port, tmp_path):
    r = feedline("broker", "--ingress", f"tcp://127.0.0.1:{free_port()}",
                 "--egress", f"ipc://{tmp_path}/e.sock", "--metrics-port", str(held_port))
    one_line_failure(r, "--metrics-port", str(held_port), "already in use", "--metrics-port 0")
    assert not (tmp_path / "e.sock").exists()


def test_broker_ingress_without_a_scheme_names_the_fix_not_curve(tmp_path):
    port = free_port()
    r = feedline("broker", "--ingress", f"127.0.0.1:{port}",
                 "--egress", f"ipc://{tmp_path}/e.sock", "--metrics-port", "0")
    line = one_line_failure(r, "--ingress", f"use tcp://127.0.0.1:{port}")
    assert "CURVE" not in line


def test_broker_addresses_that_collide_are_one_line(tmp_path):
    port = free_port()
    r = feedline("broker", "--ingress", f"tcp://127.0.0.1:{port}",
                 "--egress", f"tcp://127.0.0.1:{port}", "--metrics-port", "0")
    one_line_failure(r, "--egress", "--ingress", "same port")


def test_producer_broker_without_a_scheme_is_one_line(pipeline):
    r = feedline("producer", "--config", str(pipeline), "--broker", "127.0.0.1:7878")
    one_line_failure(r, "feedline producer:", "--broker 127.0.0.1:7878",
                     "use tcp://127.0.0.1:7878")


def test_producer_broker_host_that_does_not_resolve_is_one_line(pipeline):
    r = feedline("producer", "--config", str(pipeline), "--broker",
                 "tcp://no-such-host.invalid:7878", timeout=30)
    one_line_failure(r, "--broker tcp://no-such-host.invalid:7878", "cannot resolve host",
                     "IP address")


def test_producer_metrics_port_in_use_is_one_line(pipeline, held_port):
    r = feedline("producer", "--config", str(pipeline), "--broker",
                 f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(held_port),
                 timeout=30)
    one_line_failure(r, "feedline producer:", f"--metrics-port {held_port}", "already in use")


def test_drain_broker_without_a_scheme_is_one_line():
    r = feedline("drain", "--broker", "/tmp/feedline.sock", "--duration", "5", timeout=30)
    one_line_failure(r, "feedline drain:", "--broker /tmp/feedline.sock",
                     "use ipc:///tmp/feedline.sock")


def test_insecure_on_a_non_loopback_address_warns_who_can_reach_it(daemons, tmp_path):
    port = free_port()
    b = daemons("feedline.broker", "--ingress", f"tcp://0.0.0.0:{port}", "--egress",
                f"ipc://{tmp_path}/e.sock", "--metrics-port", "0", "--insecure", name="open")
    wait_for(lambda: tcp_ready(port) or not b.alive(), 20, what="broker")
    assert b.alive(), b.log_text()
    warning = [line for line in b.log_text().splitlines() if "WARNING" in line]
    assert len(warning) == 1, b.log_text()
    assert f"tcp://0.0.0.0:{port}" in warning[0]
    assert f"any host that can reach port {port}" in warning[0]
    assert "--curve-secret" in warning[0]


@pytest.mark.parametrize("addr, flag, expect", [
    ("127.0.0.1:7878", "--broker", "use tcp://127.0.0.1:7878"),
    (":7878", "--broker", "use tcp://127.0.0.1:7878"),
    ("/tmp/x.sock", "--broker", "use ipc:///tmp/x.sock"),
    ("ipc:/tmp/x.sock", "--egress", "use ipc:///tmp/x.sock"),
    ("udp://1.2.3.4:5", "--broker", "unknown scheme 'udp'"),
    ("tcp://127.0.0.1", "--broker", "needs a host and a port"),
    ("tcp://127.0.0.1:http", "--broker", "not a number"),
    ("tcp://[::1]:7878", "--broker", "IPv6"),
    ("tcp://0.0.0.0:7878", "--broker", "listening address"),
])
def test_bad_client_addresses_say_what_to_write(addr, flag, expect):
    from feedline import endpoints

    with pytest.raises(endpoints.AddressError) as e:
        endpoints.check_connect(addr, flag)
    assert str(e.value).startswith(f"{flag} {addr}: ") and expect in str(e.value)
    assert "\n" not in str(e.value)


def test_bind_checks_refuse_a_file_that_is_not_a_socket_and_a_missing_directory(tmp_path):
    from feedline import endpoints

    plain = tmp_path / "notes.txt"
    plain.write_text("keep me")
    with pytest.raises(endpoints.AddressError, match="is not a socket"):
        endpoints.check_bind(f"ipc://{plain}", "--egress")
    assert plain.read_text() == "keep me"
    with pytest.raises(endpoints.AddressError, match="does not exist"):
        endpoints.check_bind(f"ipc://{tmp_path}/no/such/dir.sock", "--egress")
    with pytest.raises(endpoints.AddressError, match="longer than a unix socket allows"):
        endpoints.check_bind(f"ipc://{tmp_path}/{'x' * 120}.sock", "--egress")
    assert endpoints.check_bind("tcp://127.0.0.1:0", "--ingress").port is None  # any port


def test_remove_ipc_removes_only_our_own_socket_file(tmp_path):
    from feedline import endpoints

    path = tmp_path / "e.sock"
    addr = f"ipc://{path}"
    ours = socket.socket(socket.AF_UNIX)
    ours.bind(str(path))
    owner = endpoints.ipc_owner(addr)
    ours.close()
    path.unlink()
    theirs = socket.socket(socket.AF_UNIX)  # another process bound the path since
    theirs.bind(str(path))
    theirs.listen()
    try:
        assert not endpoints.remove_ipc(addr, owner) and path.exists()
        assert not endpoints.remove_ipc(addr) and path.exists()  # someone answers on it
        assert endpoints.remove_ipc(addr, endpoints.ipc_owner(addr)) and not path.exists()
    finally:
        theirs.close()


def test_producer_data_on_a_source_without_a_path_is_one_line(pipeline):
    r = feedline("producer", "--config", str(pipeline), "--data", "/srv/imagenet")
    one_line_failure(r, "--data /srv/imagenet", "(fake)", "image_folder and lmdb")


def test_drain_at_the_ingress_or_at_nothing_fails_in_one_last_line(daemons, tmp_path):
    """A new user's drain of a broker's ingress ended in a traceback (AddressError from the
    iterator); one with no broker there exited 0 ("drained 0 batches"). Both end non-zero with
    one last line that says what to check."""
    port = free_port()
    b = daemons("feedline.broker", "--ingress", f"tcp://127.0.0.1:{port}", "--egress",
                f"ipc://{tmp_path}/e.sock", "--metrics-port", "0", name="b")
    wait_for(lambda: tcp_ready(port) or not b.alive(), 20, what="broker")
    r = feedline("drain", "--broker", f"tcp://127.0.0.1:{port}", "--duration", "10", timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("feedline drain:") and "wrong_port" in last and "--egress" in last
    r = feedline("drain", "--broker", f"tcp://127.0.0.1:{free_port()}", "--duration", "2",
                 timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("feedline drain: no broker at"), r.stderr
