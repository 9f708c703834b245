"""Plumbing shared by the process-parallel stages: forked workers and ZeroMQ IPC between them.

Workers are forked (they inherit the pipeline without pickling it) and each makes a fresh
``zmq.Context``: a context never crosses a fork. Endpoints are ``ipc://`` files in a private
(0700) temporary directory, and messages between a stage and its own children are pickled
with protocol 5, arrays as out-of-band frames (no copy into the pickle). Nothing from a
network peer ever reaches ``pickle.loads`` here.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from feedline.procs import die_with_parent

LINGER_MS = 200
POLL_MS = 200


def pack(obj: Any) -> list[Any]:
    """``obj`` -> frames (the pickle, then each out-of-band buffer)."""
    bufs: list[pickle.PickleBuffer] = []
    head = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    return [head, *(b.raw() for b in bufs)]


def unpack(frames: Sequence[Any]) -> Any:
    return pickle.loads(frames[0], buffers=[memoryview(f) for f in frames[1:]])


def offer(sock: zmq.Socket, obj: Any) -> bool:
    """Send ``obj`` if ``sock`` takes it now. A poll that said POLLOUT does not make a blocking
    send safe: the peer (a worker that just exited) can go between the two, and the send would
    then wait forever."""
    try:
        sock.send_multipart(pack(obj), flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    return True


def recv(sock: zmq.Socket) -> Any:
    return unpack(sock.recv_multipart(copy=False))


class Endpoints:
    """A private directory of ``ipc://`` endpoints, removed by :meth:`close`."""

    def __init__(self, prefix: str = "feedline-df-") -> None:
        self.dir = tempfile.mkdtemp(prefix=prefix)  # mode 0700: only this user connects

    def __call__(self, name: str) -> str:
        return f"ipc://{self.dir}/{name}"

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def socket(ctx: zmq.Context, kind: int, hwm: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, LINGER_MS)
    s.setsockopt(zmq.SNDHWM, hwm)
    s.setsockopt(zmq.RCVHWM, hwm)
    return s


def _child_entry(target: Callable[..., None], args: tuple) -> None:
    # The parent's handlers (e.g. the producer's stop event) mean nothing here: a worker
    # dies on SIGTERM and leaves Ctrl-C to its parent.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()  # a worker busy in a long map call still ends when its parent dies
    target(*args)


def fork_workers(target: Callable[..., None], args_for: Callable[[int], tuple],
                 count: int, name: str) -> list[mp.process.BaseProcess]:
    """Fork ``count`` daemon processes running ``target(*args_for(k))``."""
    ctx = mp.get_context("fork")
    procs: list[mp.process.BaseProcess] = []
    for k in range(count):
        p = ctx.Process(target=_child_entry, args=(target, args_for(k)), daemon=True,
                        name=f"{name}-{k}")
        p.start()
        procs.append(p)
    return procs


def parent_gone(parent_pid: int) -> bool:
    """True once the process that forked us has exited (we were re-parented)."""
    return os.getppid() != parent_pid


def dead_worker(procs: Sequence[mp.process.BaseProcess]) -> str | None:
    """A description of the first worker that has exited, else None."""
    for p in procs:
        if p.exitcode is not None:
            return f"{p.name} (pid {p.pid}) exited with code {p.exitcode}"
    return None


def stop_workers(procs: Sequence[mp.process.BaseProcess], timeout: float = 5.0,
                 grace: float = 0.5) -> None:
    """Wait ``grace`` seconds for a clean exit, then terminate, join, and kill what is left."""
    import time

    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join(timeout)
