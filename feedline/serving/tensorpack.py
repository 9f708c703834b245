"""tensorpack compatibility: ``send_dataflow_zmq`` (``TENSORPACK_SERIALIZE=msgpack``) in.

tensorpack's PUSH knows one flow control, its high-water mark. The host's PULL socket holds
at most one message per connection (RCVHWM 1, MAXMSGSIZE within the budget), and the host
reads a datapoint only with credit: tensorpack's ingress is one more producer to the credit
planner (:class:`feedline.serving.credit.CreditPlanner`, under :data:`KEY`), so it gets
credit in batches and bytes within the same budget and shares as every producer (its window,
its stream's share, slow start), fewest-outstanding first beside them, and gives unused
credit back at once when asked. A fast tensorpack sender is pushed back by its own HWM
instead of growing the host or taking the room of the producers beside it.

Each datapoint is decoded safely (:mod:`feedline.protocol.tensorpack_wire`: never unpickled),
re-encoded as a feedline batch under the same limits every consumer applies (a datapoint a
consumer would refuse is refused here, and counted), and counted at its full size, header
included: bytes a datapoint carries as Python ``bytes`` travel inline in the header. The
re-encoded batch is decoded again as a consumer would (views, no copy), so that a sink which
takes batches (a direct-mode trainer's queue) gets one as from any producer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from feedline.protocol import wire
from feedline.protocol.codec import DecodeError, EncodeError, Limits
from feedline.protocol.framing import Oversized, recv_message, waiting
from feedline.serving.credit import CreditPlanner
from feedline.serving.endpoint import Endpoint
from feedline.serving.held import Held, Sink
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.peers import connection

PRODUCER = "tensorpack"
# Its key in the credit planner: no ROUTER identity (5 bytes when libzmq makes one, never a
# leading zero byte when a peer sets one) can be this.
KEY = b"\0tensorpack-ingress"


class TensorpackIngress:
    """Reads the tensorpack PULL endpoint (owned by the host's loop) into the sink."""

    def __init__(self, endpoint: Endpoint, sink: Sink, metrics: BrokerMetrics, limits: Limits,
                 planner: CreditPlanner, stream: str) -> None:
        self.endpoint, self.sock = endpoint, endpoint.sock
        self.sink, self.metrics, self.limits = sink, metrics, limits
        self.planner, self.stream = planner, stream
        self.credit = planner.join(KEY, declared=0, stream=stream)
        self._seq = 0
        metrics.init_producer(PRODUCER)

    def has_room(self) -> bool:
        """Whether to read now (it holds credit); asks for credit when a datapoint waits and
        it holds none, and gives credit back when the planner asks for it (call once a loop
        turn, before the plan)."""
        c = self.credit
        if c.revoking_since is not None:
            self.planner.returned(KEY, c.received, c.received_bytes)  # ours to give at once
        if c.outstanding > 0:
            return True
        if not c.wanting and c.revoking_since is None and waiting(self.sock):
            # The size of the next datapoint is not known before it is read: the largest seen
            # (one more datapoint than that may exceed its credit: within max_message).
            self.planner.want(KEY, c.received, c.received_bytes, max(1, c.largest))
        return False

    def drain(self, reject: Callable[[str, str], None]) -> int:
        """Read while it holds credit; returns how many datapoints were read."""
        n = 0
        while self.credit.outstanding > 0 and n < 64:
            try:
                # One frame per datapoint: tensorpack never sends more, so a message of several
                # (or of more bytes than a datapoint may have) is refused and its sender cut
                # off before the rest of it is read.
                frame = recv_message(self.sock, 1, max_bytes=self.endpoint.max_message,
                                     oversized=self._cut_off)[0]
            except zmq.Again:
                break
            except Oversized as e:
                n += 1
                reject(e.reason, e.what)
                continue
            n += 1
            now = time.monotonic()
            try:
                dp = wire.decode_tensorpack(frame, self.limits)
                frames = wire.encode_batch(dp, producer=PRODUCER, session=0, seq=self._seq,
                                           limits=self.limits)
                batch = wire.decode_batch(frames, self.limits)
            except DecodeError as e:
                self.planner.batch(KEY, len(frame), now)  # its credit comes back with a plan
                reject(e.reason, str(e))
                continue
            except EncodeError as e:  # decodable, but no consumer would take it
                self.planner.batch(KEY, len(frame), now)
                reject("tensorpack_over_limits", str(e))
                continue
            self._seq += 1
            # Its size here: the batch, or the frame its arrays may be views on.
            nbytes = max(batch.wire_bytes, len(frame))
            # A datapoint larger than its byte credit (the first, or one larger than all
            # before) is taken all the same: tensorpack cannot be asked to wait for it.
            self.planner.batch(KEY, nbytes, now)
            self.metrics.received_batches.labels(PRODUCER).inc()
            self.metrics.received_bytes.labels(PRODUCER).inc(batch.nbytes)
            self.sink.accept(self.stream, Held(frames, nbytes, batch.nbytes, 0, 0, batch=batch))
        return n

    def _cut_off(self, reason: str, fd: int) -> None:
        self.endpoint.refusals.cut_off(*connection(fd), PRODUCER, reason)
