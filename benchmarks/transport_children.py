"""The child processes of benchmarks/transport.py: plain ZeroMQ senders, the relay,
tensorpack's sender, and the measuring consumers, as scripts run with ``python -c``.

Every sender takes ``ADDR SHAPE LABELS [HWM]``: the batch is ``[data, labels]``, ``data`` a
uint8 array of ``SHAPE`` (comma-separated: ``425,224,224,3`` images or ``16000`` bytes) and
``labels`` ``LABELS`` int32s, the same two frames feedline's fake source sends.
"""

from __future__ import annotations

import textwrap

# Every plain ZeroMQ sender: its arguments and the constant batch.
_BATCH = """
    import queue, sys, threading, numpy as np, zmq
    addr, shape, nlabels = sys.argv[1], tuple(map(int, sys.argv[2].split(","))), int(sys.argv[3])
    HWM = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    images = np.zeros(shape, np.uint8)
    labels = np.zeros(nlabels, np.int32)
"""

# With feedline's thread layout: the owner thread hands each batch to an I/O thread that owns
# the socket (``io``, defined before this), through a bounded queue.
_OWNER = """
    q = queue.Queue(maxsize=1)
    threading.Thread(target=io, daemon=True).start()
    while True:
        q.put([b"batch", images, labels])
"""

SENDER = textwrap.dedent(_BATCH + """
    header = b"batch"  # plain ZeroMQ: no real header, the cheapest possible framing
    s = zmq.Context().socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, HWM)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    while True:
        s.send_multipart([header, images, labels], copy=False)
""")

# The same, with feedline's thread layout and nothing else (at both ends).
SENDER_THREADS = textwrap.dedent(_BATCH + """
    def io():
        s = zmq.Context().socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, HWM)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        while True:
            s.send_multipart(q.get(), copy=False)
""" + _OWNER)

# The same with a credit loop: the I/O thread sends only what the consumer granted (a DEALER
# that says hello, then reads grants: ASCII counts), as feedline's producers do.
SENDER_CREDIT = textwrap.dedent(_BATCH + """
    def io():
        s = zmq.Context().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        s.send(b"hello")
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        credit, head = 0, None
        while True:
            while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                credit += int(s.recv())
            while credit > 0:
                if head is None:
                    try:
                        head = q.get_nowait()
                    except queue.Empty:
                        break
                s.send_multipart(head, copy=False)
                head, credit = None, credit - 1
            poller.poll(5)
""" + _OWNER)

RELAY = textwrap.dedent("""
    import sys, zmq
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    hwm = int(sys.argv[3])
    for s in (front, back):
        s.setsockopt(zmq.RCVHWM, hwm); s.setsockopt(zmq.SNDHWM, hwm); s.setsockopt(zmq.LINGER, 0)
    front.bind(sys.argv[1]); back.bind(sys.argv[2])
    zmq.proxy(front, back)
""")

TP_SENDER = textwrap.dedent("""
    import sys, numpy as np
    from tensorpack.dataflow import DataFlow
    from tensorpack.dataflow.remote import send_dataflow_zmq
    addr, shape, nlabels = sys.argv[1], tuple(map(int, sys.argv[2].split(","))), int(sys.argv[3])
    class Const(DataFlow):
        def __iter__(self):
            images = np.zeros(shape, np.uint8)
            labels = np.zeros(nlabels, np.int32)
            while True:
                yield [images, labels]
    send_dataflow_zmq(Const(), addr, hwm=4)
""")

# The measuring consumers: run in their own process (KIND ADDR SHAPE LABELS SECONDS WARMUP
# [hold]),
# print {"bytes": B, "batches": N, "seconds": S, "cpu": C}: C is this process's CPU-seconds
# (user + system, all its threads) over the measured S seconds.
CONSUMER = textwrap.dedent("""
    import json, os, resource, sys, time
    DEEP = 64  # the "-deep" variants' windows: consumer, producer (and broker budget 2x)
    import numpy as np, psutil
    kind, addr, shape, nlabels, seconds, warmup = sys.argv[1:7]
    shape, nlabels = tuple(map(int, shape.split(","))), int(nlabels)
    seconds, warmup = float(seconds), float(warmup)
    def arrays(frames):  # plain ZeroMQ's data and label frames as numpy views
        return (np.frombuffer(frames[0].buffer, np.uint8).reshape(shape),
                np.frombuffer(frames[1].buffer, np.int32))
    if kind in ("feedline", "feedline-direct", "feedline-deep", "feedline-direct-deep"):
        from feedline.consumer import RemoteDataZMQ
        # Direct mode: its window is every batch in flight (queued here or granted); plain
        # ZeroMQ holds HWM batches at each end: the same depth is 2 x HWM.
        direct, deep = kind.startswith("feedline-direct"), kind.endswith("-deep")
        window = DEEP if deep else 2 * 4 if direct else 4
        # bind= only where it is needed: --before may be a checkout that predates it.
        extra = {"bind": True} if direct else {}
        options = {"window": window}
        if direct and deep:  # the producers' window a user of small batches sets too
            from feedline.consumer.direct import DirectConfig
            options["direct"] = DirectConfig(producer_window=DEEP)
        try:
            from feedline.consumer import ConsumerOptions
        except ImportError:  # a --before checkout from before ConsumerOptions
            src = RemoteDataZMQ(addr, timeout=60, **extra, **options)
        else:
            src = RemoteDataZMQ(addr, timeout=60, **extra, options=ConsumerOptions(**options))
        it = iter(src)
        def one():
            images, labels = next(it)
            return images.nbytes + labels.nbytes
    elif kind == "plain-credit":  # an I/O thread grants what the queue has room for
        import queue, threading, zmq
        WINDOW, PER_SENDER = 8, 4  # direct mode's: the trainer's window, a producer's
        q = queue.Queue(maxsize=WINDOW)
        def io():
            sock = zmq.Context().socket(zmq.ROUTER)
            sock.setsockopt(zmq.RCVHWM, WINDOW + 16)
            sock.bind(addr)
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            sender, granted = None, 0  # granted: not arrived yet
            while True:
                poller.poll(5)
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    f = sock.recv_multipart(copy=False)
                    sender = f[0].bytes
                    if len(f) == 4:  # [sender, tag, data, labels]
                        granted -= 1
                        q.put_nowait(arrays(f[2:]))
                room = min(WINDOW - q.qsize() - granted, PER_SENDER - granted)
                if sender is not None and room > 0:
                    sock.send_multipart([sender, str(room).encode()])
                    granted += room
        threading.Thread(target=io, daemon=True).start()
        def one():
            images, labels = q.get()
            return images.nbytes + labels.nbytes
    elif kind == "tensorpack":
        from tensorpack.dataflow.remote import RemoteDataZMQ as TPRemote
        src = TPRemote(addr, hwm=4)
        src.reset_state()
        it = iter(src)
        def one():
            images, labels = next(it)
            return images.nbytes + labels.nbytes
    else:
        import queue, threading, zmq
        sock = zmq.Context().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 4)
        (sock.bind if kind.startswith("plain-bind") else sock.connect)(addr)
        def recv():
            a, b = arrays(sock.recv_multipart(copy=False)[1:])
            return a.nbytes + b.nbytes
        if kind == "plain-bind-threads":  # an I/O thread owns the socket, a queue between
            q = queue.Queue(maxsize=8)
            def io():
                while True:
                    q.put(recv())
            threading.Thread(target=io, daemon=True).start()
            one = q.get
        else:
            one = recv
    t0 = time.perf_counter()
    n = 0
    while n < 10 or time.perf_counter() - t0 < warmup:  # connections made, pipes full
        one()
        n += 1
    me = psutil.Process()
    print("MARK", n, flush=True)  # measuring from now (benchmarks/message_cost.py samples here)
    c0, r0 = me.cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
    count, nbytes, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        nbytes += one()
        count += 1
    dt = time.perf_counter() - t0
    c1, r1 = me.cpu_times(), resource.getrusage(resource.RUSAGE_SELF)
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    print(json.dumps({"bytes": nbytes, "batches": count, "seconds": dt, "cpu": cpu,
                      "sys": c1.system - c0.system, "faults": r1.ru_minflt - r0.ru_minflt,
                      "switches": (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw)}),
          flush=True)
    if sys.argv[7:] == ["hold"]:  # until told: message_cost.py reads our threads' times first
        sys.stdin.readline()
    os._exit(0)
""")
