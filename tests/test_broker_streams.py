"""The broker's streams against each other: what an unread stream's leftovers may take of the
budget a read stream needs (issue 53, finding 1).

Real processes: a broker, ``feedline producer`` daemons with ``fake`` sources, a
``RemoteDataZMQ`` on its egress, all on 127.0.0.1 / ipc://.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from feedline.consumer import RemoteDataZMQ
from feedline.errors import ReceiveTimeout
from feedline.procs import wait_for
from tests.flow_support import FAST, fake_yaml, start_broker, start_producer

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
    with RemoteDataZMQ(endpoints.egress, stream="train", timeout=20, link=FAST) as src:
        try:
            for got, _ in enumerate(src, 1):
                if got >= TRAIN:
                    break
        except ReceiveTimeout:
            pass
    assert got == TRAIN, f"{got} of {TRAIN} batches of train ({left:.0f} of idle buffered)"
    evicted = metrics.value("feedline_broker_evicted_batches_total", stream="idle")
    assert evicted > 0 if leaves else evicted >= left, (evicted, left)
