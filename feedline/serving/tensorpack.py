"""tensorpack compatibility: ``send_dataflow_zmq`` (``TENSORPACK_SERIALIZE=msgpack``) in.

tensorpack's PUSH knows one flow control, its high-water mark. The host's PULL socket holds
at most one message per connection (RCVHWM 1, MAXMSGSIZE within the budget) and is read only
while the budget has room for a message as large as the largest seen
(:meth:`~feedline.serving.budget.Budget.has_room`), so a fast tensorpack sender is pushed back
by its own HWM instead of growing the broker or the trainer. Each datapoint is decoded
safely (:mod:`feedline.tensorpack_wire`: never unpickled), re-encoded as a feedline batch
under the same limits every consumer applies (a datapoint a consumer would refuse is refused
here, and counted), and counted at its full size, header included: bytes a datapoint carries
as Python ``bytes`` travel inline in the header. The re-encoded batch is decoded again as a
consumer would (views, no copy), so that a sink which takes batches (a direct-mode trainer's
queue) gets one as from any producer.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from feedline import wire
from feedline.codec import DecodeError, EncodeError, Limits
from feedline.serving.budget import Budget
from feedline.serving.endpoint import Endpoint
from feedline.serving.held import Held
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.producers import Sink

PRODUCER = "tensorpack"


class TensorpackIngress:
    """Reads the tensorpack PULL endpoint (owned by the host's loop) into the sink."""

    def __init__(self, endpoint: Endpoint, sink: Sink, metrics: BrokerMetrics, limits: Limits,
                 budget: Budget, stream: str) -> None:
        self.endpoint, self.sock = endpoint, endpoint.sock
        self.sink, self.metrics, self.limits = sink, metrics, limits
        self.budget, self.stream = budget, stream
        self.largest = 0  # the largest datapoint seen (wire bytes): room needed to read one
        self._seq = 0
        metrics.init_producer(PRODUCER)

    def has_room(self, reserved_bytes: int) -> bool:
        _, held = self.sink.held()
        return self.budget.has_room(held, reserved_bytes, self.largest)

    def drain(self, reserved_bytes: int, reject: Callable[[str, str], None]) -> int:
        """Read while there is room; returns how many datapoints were read."""
        n = 0
        while self.has_room(reserved_bytes) and n < 64:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            n += 1
            self.largest = max(self.largest, len(frame))
            try:
                dp = wire.decode_tensorpack(frame, self.limits)
                frames = wire.encode_batch(dp, producer=PRODUCER, session=0, seq=self._seq,
                                           limits=self.limits)
                batch = wire.decode_batch(frames, self.limits)
            except DecodeError as e:
                reject(e.reason, str(e))
                continue
            except EncodeError as e:  # decodable, but no consumer would take it
                reject("tensorpack_over_limits", str(e))
                continue
            self._seq += 1
            nbytes = batch.wire_bytes
            self.largest = max(self.largest, nbytes)
            self.metrics.received_batches.labels(PRODUCER).inc()
            self.metrics.received_bytes.labels(PRODUCER).inc(batch.nbytes)
            self.sink.accept(self.stream, Held(frames, nbytes, batch.nbytes, 0, 0, batch=batch))
        return n
