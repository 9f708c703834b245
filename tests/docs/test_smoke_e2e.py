"""The smallest end-to-end check: one producer thread -> broker thread -> RemoteDataZMQ."""

from __future__ import annotations

import itertools
import threading

import numpy as np

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.producer import send_dataflow
from feedline.transport.link import LinkConfig

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


def test_batches_arrive_intact_and_in_order(thread_broker, endpoints):
    thread_broker()
    data = [[np.full((4, 5), i, np.float32), np.arange(i, i + 3, dtype=np.int64), f"s{i}"]
            for i in range(50)]
    sender = threading.Thread(
        target=send_dataflow, args=(data, endpoints.ingress),
        kwargs={"epochs": 1, "producer_id": "p0", "link": FAST}, daemon=True)
    sender.start()
    with RemoteDataZMQ(endpoints.egress, timeout=20, options=ConsumerOptions(link=FAST)) as src:
        got = list(itertools.islice(src, 50))
    sender.join(10)
    assert not sender.is_alive()
    for i, dp in enumerate(got):
        assert dp[0].dtype == np.float32 and dp[0].shape == (4, 5)
        assert (dp[0] == i).all()
        np.testing.assert_array_equal(dp[1], np.arange(i, i + 3))
        assert dp[2] == f"s{i}"
        assert not dp[0].flags.owndata  # a view on the received frame, not a copy
