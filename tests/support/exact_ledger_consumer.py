"""A training process on an exact stream that keeps a ledger of every batch it took.

``python -m tests.support.exact_ledger_consumer --broker ADDR --ledger FILE`` iterates
``RemoteDataZMQ(..., stream=..., return_meta=True).epoch()`` over and over and appends, for
each batch taken, one line (:func:`tests.support.exact_ledger.format_entry`): time, producer,
session,
seq, epoch, unit, index, crc ok, and ``id:digest`` of each sample, flushed at once. Each time
an ``epoch()`` iteration ends (the broker said every batch of the epoch was taken) it writes
``#end TIME EPOCHS``: the epochs of the batches that iteration yielded (one, if the epoch ends
where it should). ``--step`` seconds of sleep per batch play a model step. SIGTERM ends it
(the iteration waits without a timeout: a restarted ``epoch()`` would start where it is).

A job that checkpoints and crashes: ``--save FILE`` writes ``remote.state()`` (the cursor's
bytes) to FILE on SIGUSR1 or after ``--save-after N`` batches, and ``#ckpt`` to the ledger
(what the model had seen when the checkpoint was taken); ``--crash-after N`` kills this process
(SIGKILL) after N batches; ``--resume FILE`` resumes from a saved cursor, ``--resume A,B``
from the merge of several (each rank merges them itself, as docs/tensorflow.md says).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path
from typing import TextIO

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.consumer.drain import parse_schedule, step_at
from feedline.exact.cursor import Cursor
from feedline.transport.link import LinkConfig
from tests.support.exact_ledger import STREAM, digest, format_entry
from tests.support.ledger_data import check


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
    ap.add_argument("--save", default=None, help="write the cursor here (SIGUSR1, --save-after)")
    ap.add_argument("--save-after", type=int, default=0, help="batches, then --save")
    ap.add_argument("--crash-after", type=int, default=0, help="batches, then SIGKILL")
    ap.add_argument("--resume", default=None, help="cursor file(s) to resume from, merged")
    a = ap.parse_args()
    schedule = a.schedule or [(1.0, a.step)]
    t0 = time.monotonic()
    stop, save = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: save.set())
    link = LinkConfig(heartbeat_interval=a.heartbeat_interval,
                      heartbeat_timeout=a.heartbeat_timeout)
    resume = None
    if a.resume:
        resume = Cursor.merge(Cursor.decode(Path(f).read_bytes()) for f in a.resume.split(","))
    taken = 0
    with open(a.ledger, "a", buffering=1) as out, \
            RemoteDataZMQ(a.broker, stream=a.stream, return_meta=True, resume=resume,
                          options=ConsumerOptions(window=a.window, link=link)) as src:
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
                taken += 1
                if a.save and (save.is_set() or taken == a.save_after):
                    save.clear()
                    checkpoint(src, Path(a.save), out)
                if taken == a.crash_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # what it took since: gone with it
                step = step_at(schedule, time.monotonic() - t0)
                if step:
                    time.sleep(step)
            if stop.is_set():
                break
            out.write(f"#end {time.time():.6f} {','.join(map(str, sorted(epochs)))}\n")
            epochs = set()


def checkpoint(src: RemoteDataZMQ, path: Path, ledger: TextIO) -> None:
    """Save the cursor (atomically: a crash leaves the last whole one) and mark the ledger."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(src.state().encode())
    os.replace(tmp, path)
    ledger.write(f"#ckpt {time.time():.6f}\n")


if __name__ == "__main__":
    main()
