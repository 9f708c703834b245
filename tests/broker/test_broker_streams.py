"""The broker's streams against each other: what an unread stream's leftovers may take of the
budget a read stream needs (issue 53, finding 1).

Real processes: a broker, ``feedline producer`` daemons with ``fake`` sources, a
``RemoteDataZMQ`` on its egress, all on 127.0.0.1 / ipc://.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from feedline.commands import top
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import ReceiveTimeout
from feedline.procs import wait_for
from tests.support.flow_support import (
    FAST,
    fake_yaml,
    log_lines,
    run_script,
    start_broker,
    start_producer,
)

TRAIN = 20  # batches of 2.4 MB the trainer must get


@pytest.mark.parametrize("leaves", [True, False])
def test_an_unread_streams_batches_leave_a_read_stream_its_floor(
        tmp_path: Path, broker_proc, daemons, endpoints, leaves: bool) -> None:
    """A producer of tiny batches serves stream ``idle``, which nobody reads, and leaves (or
    goes on producing); a
    producer of 2.4 MB batches then serves ``train`` and a trainer reads it. The trainer gets
    its batches, and the leftovers it needed the room of are evicted and counted (before:
    the hundreds of tiny batches, counted against the budget's batches for 2.4 MB ones, left
    no room: 0 batches in 40 s, for as long as the broker ran)."""
    _, metrics = start_broker(broker_proc)
    idle = start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "idle", [[4, 8]], ["uint8"]), "idle", "--stream", "idle")

    def buffered(stream: str) -> float:
        return metrics.value("feedline_broker_stream_buffer_batches", stream=stream)
    # More tiny batches than the budget has batches for 2.4 MB ones (111 of them: depth).
    wait_for(lambda: buffered("idle") >= 200, 30, what="the idle stream's batches buffered")
    if leaves:
        idle.stop()
    left = buffered("idle")
    start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "train", [[600, 1000]], ["float32"]), "train", "--stream", "train")
    got = 0
    with RemoteDataZMQ(endpoints.egress, stream="train", timeout=20,
                       options=ConsumerOptions(link=FAST)) as src:
        try:
            for got, _ in enumerate(src, 1):
                if got >= TRAIN:
                    break
        except ReceiveTimeout:
            pass
    assert got == TRAIN, f"{got} of {TRAIN} batches of train ({left:.0f} of idle buffered)"
    evicted = metrics.value("feedline_broker_evicted_batches_total", stream="idle")
    assert evicted > 0, (evicted, left)
    # What idle keeps leaves train its floor (a quarter) of the count in force (111).
    cap = metrics.value("feedline_broker_buffer_capacity_batches")
    assert cap == 111 and buffered("idle") <= cap - cap // 4, (cap, buffered("idle"))


def test_top_and_the_help_say_what_the_batch_count_bounds(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """50 tiny batches held on a stream nobody reads (granted under a count of 4,096), then a
    producer of 8 MiB batches registers: the count in force is 32, and the broker holds 50.
    `feedline top` says what is held (buffered, in flight, granted) against that limit and
    why it is over it (before: "buffer 50/32 batches (156%)", unexplained); the metric's
    description and ``--max-batches``'s help say what the number counts (before: "at most",
    and "the configured one, small batches counted by their bytes")."""
    _, metrics = start_broker(broker_proc)
    # Their producer says no pipeline fingerprint: the large ones' pipeline does not replace
    # theirs (tests/broker/test_broker_pipelines.py), they stay.
    tiny = run_script(textwrap.dedent(f"""
        import numpy as np
        from feedline.transport.link import LinkConfig
        from feedline.producer import send_dataflow
        send_dataflow([[np.zeros(16, np.uint8)] for _ in range(50)], {endpoints.ingress!r},
                      epochs=1, producer_id="tiny",
                      link=LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5))
        """), tmp_path / "tiny.log")
    try:
        wait_for(lambda: metrics.value("feedline_broker_buffer_batches") >= 50, 20,
                 what="the 50 tiny batches")
        assert tiny.wait(20) == 0, (tmp_path / "tiny.log").read_text()
    finally:
        tiny.kill()
        tiny.wait(10)
    start_producer(daemons, endpoints.ingress, fake_yaml(
        tmp_path, "large", [[2048, 1024]], ["float32"], size=3, epochs=1), "large")
    wait_for(lambda: metrics.value("feedline_broker_buffer_capacity_batches") == 32, 20,
             what="the count in force for 8 MiB batches")
    url = f"http://127.0.0.1:{metrics.port}/metrics"
    first = top.snapshot([url])
    screen = top.render(first, top.snapshot([url]))
    lines = screen.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith("held "))
    assert lines[at].split() == (
        "held 50 batches of 32 (over it; --max-batches for the largest batches): "
        "50 buffered, 0 in flight, 0 granted").split(), lines[at]
    assert lines[at + 1].strip().startswith(
        "over it: granted while only smaller batches were produced"), lines[at + 1]
    assert not re.search(r"\b(1\d\d|[2-9]\d\d+)%", screen), screen
    # tiny said goodbye: that is no drop (before: "dropped peers 1").
    assert "dropped peers 0 (1 left cleanly)" in screen, screen

    with urllib.request.urlopen(url, timeout=5) as r:
        page = r.read().decode()
    described = next(ln for ln in page.splitlines()
                     if ln.startswith("# HELP feedline_broker_buffer_capacity_batches "))
    assert "buffered, in flight to consumers and granted to producers" in described
    assert "count by their bytes" in described
    helptext = subprocess.run([sys.executable, "-m", "feedline", "broker", "--help"],
                              capture_output=True, text=True, timeout=30,
                              env={**os.environ, "COLUMNS": "400"}).stdout
    flag = " ".join(helptext.split("\n  --max-batches MAX_BATCHES", 1)[1]
                    .split("\n  --max-bytes")[0].split())
    assert "counted for batches of 8 MiB or more" in flag and "111 of 2.4 MB" in flag, flag
    assert "(default: 32)" in flag, flag


def test_a_paused_consumers_batches_leave_another_stream_its_floor(
        tmp_path: Path, broker_proc, daemons, endpoints) -> None:
    """A trainer of stream ``small`` (tiny batches, hundreds in flight to it) is SIGSTOPped
    past the heartbeat timeout while a producer of 2.4 MB batches serves ``train``: a trainer
    of ``train`` gets its batches while the paused one is away, and the paused one, woken,
    registers again and is served again (before: what was in flight to it stayed counted,
    against a budget counted for 2.4 MB batches, for as long as it was away: 0 batches)."""
    broker, metrics = start_broker(broker_proc)
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({"factory": "tests.support.ledger_data:make",
                                     "args": {"nbytes": 64}}))
    start_producer(daemons, endpoints.ingress, small, "small", "--stream", "small")
    ledger = tmp_path / "paused.ledger"
    paused = daemons("tests.support.ledger_consumer", "--broker", endpoints.egress,
                     "--ledger", ledger, "--stream", "small", "--heartbeat-interval", "0.2",
                     "--heartbeat-timeout", "1.5", name="paused")

    def lines() -> int:
        return sum(1 for ln in ledger.read_text().splitlines() if not ln.startswith("#")) \
            if ledger.exists() else 0

    def until(what: str, predicate: Callable[[], bool]) -> None:
        try:
            wait_for(predicate, 60, what=what)
        except TimeoutError as e:  # what each side said, to tell a hang from a slow machine
            raise AssertionError(f"{e}: {lines()} batches taken; the trainer's log:\n"
                                 f"{paused.log_text()[-2000:]}\nthe broker's:\n"
                                 f"{broker.log_text()[-3000:]}") from None
    until("the small stream's trainer reading", lambda: lines() >= 1000)
    paused.signal(signal.SIGSTOP)
    try:
        until("the paused trainer dropped", lambda: metrics.value(
            "feedline_broker_dropped_peers_total", role="consumer", reason="timeout") >= 1)
        held = metrics.value("feedline_broker_inflight_batches")
        start_producer(daemons, endpoints.ingress, fake_yaml(
            tmp_path, "train", [[600, 1000]], ["float32"]), "train", "--stream", "train")
        got = 0
        with RemoteDataZMQ(endpoints.egress, stream="train", timeout=20,
                           options=ConsumerOptions(link=FAST)) as src:
            try:
                for got, _ in enumerate(src, 1):
                    if got >= TRAIN:
                        break
            except ReceiveTimeout:
                pass
        assert got == TRAIN, f"{got} of {TRAIN} batches of train ({held:.0f} in flight to " \
                             "the paused trainer)"
        before = lines()
    finally:
        paused.signal(signal.SIGCONT)
    until("the woken trainer served again", lambda: lines() >= before + 1000)
    assert paused.alive(), paused.log_text()
    assert metrics.value("feedline_broker_cut_off_connections_total", role="consumer",
                         reason="silent") == 1
    said = log_lines(broker.log_text(), "WARNING", "consumer ", "of stream small", "in flight",
                     "cut to make room for train")
    assert len(said) == 1, broker.log_text()
