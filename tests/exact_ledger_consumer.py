"""A training process on an exact stream that keeps a ledger of every batch it took.

``python -m tests.exact_ledger_consumer --broker ADDR --ledger FILE`` iterates
``RemoteDataZMQ(..., stream=..., return_meta=True).epoch()`` over and over and appends, for
each batch taken, one line (:func:`tests.exact_ledger.format_entry`): time, producer, session,
seq, epoch, unit, index, crc ok, and ``id:digest`` of each sample, flushed at once. Each time
an ``epoch()`` iteration ends (the broker said every batch of the epoch was taken) it writes
``#end TIME EPOCHS``: the epochs of the batches that iteration yielded (one, if the epoch ends
where it should). ``--step`` seconds of sleep per batch play a model step. SIGTERM ends it
(the iteration waits without a timeout: a restarted ``epoch()`` would start where it is).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

from feedline.consumer import RemoteDataZMQ
from feedline.consumer.drain import parse_schedule, step_at
from feedline.link import LinkConfig
from tests.exact_ledger import STREAM, digest, format_entry
from tests.ledger_data import check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--broker", required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--stream", default=STREAM)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--step", type=float, default=0.0, help="seconds per batch (a model step)")
    ap.add_argument("--schedule", type=parse_schedule, default=None,
                    help="a step that changes: SECONDS:STEP,... as feedline drain --schedule")
    ap.add_argument("--heartbeat-interval", type=float, default=1.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    a = ap.parse_args()
    schedule = a.schedule or [(1.0, a.step)]
    t0 = time.monotonic()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    link = LinkConfig(heartbeat_interval=a.heartbeat_interval,
                      heartbeat_timeout=a.heartbeat_timeout)
    with open(a.ledger, "a", buffering=1) as out, \
            RemoteDataZMQ(a.broker, stream=a.stream, window=a.window, return_meta=True,
                          link=link) as src:
        def closer() -> None:  # close() from another thread ends a waiting iteration
            stop.wait()
            src.close()

        threading.Thread(target=closer, daemon=True).start()
        epochs: set[int] = set()  # of the batches the current epoch() iteration yielded
        while not stop.is_set():
            for b in src.epoch():
                data, meta = b.datapoint
                samples, ok = [], True
                for k in range(len(meta)):
                    try:
                        i = check([data[k], meta[k]])
                    except AssertionError:
                        ok, i = False, int(meta[k][0])
                    samples.append((i, digest(data[k])))
                out.write(format_entry(time.time(), b, samples, ok))
                epochs.add(b.epoch)
                step = step_at(schedule, time.monotonic() - t0)
                if step:
                    time.sleep(step)
            if stop.is_set():
                break
            out.write(f"#end {time.time():.6f} {','.join(map(str, sorted(epochs)))}\n")
            epochs = set()


if __name__ == "__main__":
    main()
