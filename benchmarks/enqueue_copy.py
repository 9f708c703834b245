"""Why QueueInput's enqueue copies each batch: where libzmq puts a received array, and when
TensorFlow's enqueue op takes a NumPy array without copying it.

Two measurements, printed as lines (benchmarks/NOTES.md, "TensorFlow input overhead"):

- ``received``: ``--messages`` messages of ``--size`` bytes, pushed over tcp on 127.0.0.1 to
  a PULL socket (``copy=False``, as feedline's consumers receive), and the received array's
  address modulo 64, counted. libzmq allocates a large message and its header in one block
  (``malloc``, 16-byte aligned) and the data follows the header.
- ``enqueue``: ``tf.raw_ops.QueueEnqueueV2`` (what QueueInput calls) given a float32 array of
  ``--size`` bytes at a 64-byte boundary and 32 bytes past one: whether the dequeued tensor
  shares the array's memory (a write to the array shows in it) and the microseconds an
  enqueue and dequeue take, median of ``--rounds``.

    python benchmarks/enqueue_copy.py --size 1048576 --messages 400 --rounds 200
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time

import numpy as np
import zmq


def received(size: int, messages: int) -> dict[int, int]:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    data = b"\1" * size
    sender = threading.Thread(target=lambda: [push.send_multipart([b"h", data], copy=False)
                                              for _ in range(messages)])
    sender.start()
    counts: collections.Counter[int] = collections.Counter()
    held: collections.deque = collections.deque(maxlen=32)  # a window's worth, held
    for _ in range(messages):
        frames = pull.recv_multipart(copy=False)
        counts[np.frombuffer(frames[1].buffer, np.uint8).ctypes.data % 64] += 1
        held.append(frames)
    sender.join()
    held.clear()
    push.close(0)
    pull.close(0)
    ctx.term()
    return dict(sorted(counts.items()))


def enqueue(size: int, offset: int, rounds: int) -> tuple[bool, float]:
    import tensorflow as tf

    n = size // 4  # float32 values: the array is size bytes, rounded down to 4
    block = np.empty(4 * n + 128, np.uint8)
    start = (-block.ctypes.data) % 64 + offset
    x = block[start:start + 4 * n].view(np.float32)
    x[:] = 1.0
    q = tf.queue.FIFOQueue(2, [tf.float32], shapes=[(n,)])
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        tf.raw_ops.QueueEnqueueV2(handle=q.queue_ref, components=[x])
        q.dequeue()
        times.append(time.perf_counter() - t0)
    tf.raw_ops.QueueEnqueueV2(handle=q.queue_ref, components=[x])
    x[0] = 42.0
    shared = float(q.dequeue()[0]) == 42.0
    return shared, statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1 << 20, help="bytes a message / an array")
    ap.add_argument("--messages", type=int, default=400, help="messages received")
    ap.add_argument("--rounds", type=int, default=200, help="enqueues timed per alignment")
    args = ap.parse_args()
    counts = received(args.size, args.messages)
    print(f"received: address % 64 of {args.messages} arrays of {args.size} bytes: {counts}")
    for offset in (0, 32):
        shared, us = enqueue(args.size, offset, args.rounds)
        print(f"enqueue: an array {offset} bytes past a 64-byte boundary: "
              f"{'shared, no copy' if shared else 'copied'}; enqueue + dequeue {us:.0f} us")


if __name__ == "__main__":
    main()
