"""Real HTTP servers for the shard tests: a file server with byte ranges, and a proxy in front
of it that injects faults (503s, connections reset mid-body, stalls, a slow link).

Both are ``http.server.ThreadingHTTPServer`` on 127.0.0.1 with an ephemeral port, in a thread
of the test process (:func:`serve`); the producers that read through them are real processes.
The proxy forwards each request with ``http.client`` and answers according to its
:class:`Plan`, which counts every fault it injected, so a test can hold the producer's retry
counter to it. ``python -m tests.support.shard_server DIR`` serves a folder (the benchmark uses it).
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class RangeHandler(SimpleHTTPRequestHandler):
    """SimpleHTTPRequestHandler plus single byte ranges (what object stores answer)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def end_headers(self) -> None:
        self.send_header("Accept-Ranges", "bytes")
        super().end_headers()

    def send_head(self):  # type: ignore[no-untyped-def]
        m = _RANGE.match(self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if m is None or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(m.group(1))
        end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        if start >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        f = open(path, "rb")  # noqa: SIM115 (closed by copyfile's caller)
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self._left = end - start + 1
        return f

    def copyfile(self, source, outputfile):  # type: ignore[no-untyped-def]
        left = getattr(self, "_left", None)
        if left is None:
            return super().copyfile(source, outputfile)
        while left > 0:
            buf = source.read(min(left, 1 << 16))
            if not buf:
                break
            outputfile.write(buf)
            left -= len(buf)
        self._left = None


@dataclass
class Plan:
    """What the proxy does to each request. ``rules``: (path substring, action, times) tried
    in order: action ``503``, ``reset`` (half the body, then a TCP reset), or ``stall`` (half
    the body, then ``stall`` seconds of silence); ``times`` -1 is every time. ``rate``:
    bytes/s of every body (a slow link; 0 is unlimited). ``injected`` counts what was done.

    Only reads of data (ranged GETs) are faulted: a GET without a Range is fsspec's probe
    for a shard's size after a HEAD that failed (a HEAD slower than the read timeout, on a
    loaded machine), which reads the headers alone; a fault there would be used up unseen."""

    rules: list[list] = field(default_factory=list)
    rate: float = 0.0
    stall: float = 3.0
    every: list[tuple[str, int]] = field(default_factory=list)  # (action, n): each n-th GET
    injected: Counter = field(default_factory=Counter)
    requests: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gets: int = 0

    def decide(self, method: str, path: str, ranged: bool = True) -> str:
        with self.lock:
            self.requests[path] += 1
            if method != "GET" or not ranged:
                return "pass"
            self.gets += 1
            for action, n in self.every:
                if self.gets % n == 0:
                    self.injected[action] += 1
                    return action
            for rule in self.rules:
                sub, action, times = rule
                if sub in path and times != 0:
                    rule[2] = times - 1 if times > 0 else times
                    self.injected[action] += 1
                    return str(action)
            return "pass"

    def add(self, sub: str, action: str, times: int = 1) -> None:
        with self.lock:
            self.rules.append([sub, action, times])

    def total(self) -> int:
        with self.lock:
            return sum(self.injected.values())


class FaultProxy(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int] = ("127.0.0.1", 0)
    plan: Plan

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._forward("HEAD")

    def do_GET(self) -> None:
        self._forward("GET")

    def _forward(self, method: str) -> None:
        action = self.plan.decide(method, self.path, "Range" in self.headers)
        if action == "503":
            body = b"injected 503"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("range",)}
        conn.request(method, self.path, headers=headers)
        r = conn.getresponse()
        self.send_response(r.status)
        length = r.getheader("Content-Length")
        for k, v in r.getheaders():
            if k.lower() in ("content-length", "content-range", "content-type",
                             "accept-ranges"):
                self.send_header(k, v)
        self.end_headers()
        if method == "HEAD":
            conn.close()
            return
        total = int(length) if length else None
        sent = 0
        cut = (total or 0) // 2 if action in ("reset", "stall") else None
        t0 = time.monotonic()
        try:
            while True:
                buf = r.read(1 << 16)
                if not buf:
                    break
                if cut is not None and sent + len(buf) > cut:
                    buf = buf[:max(0, cut - sent)]
                    self.wfile.write(buf)
                    self.wfile.flush()
                    if action == "stall":
                        time.sleep(self.plan.stall)
                    self._reset()
                    return
                self.wfile.write(buf)
                sent += len(buf)
                if self.plan.rate:
                    ahead = sent / self.plan.rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            conn.close()

    def _reset(self) -> None:
        """Close with a TCP RST (SO_LINGER 0): a connection reset by peer, mid-body."""
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that went away (the proxy's resets): nothing to report


@contextmanager
def serve(handler: type, **attrs: object) -> Iterator[str]:
    """A ThreadingHTTPServer on 127.0.0.1 in a thread; yields its base URL."""
    server = _Quiet(("127.0.0.1", 0), handler)
    for k, v in attrs.items():
        setattr(server.RequestHandlerClass, k, v)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


@contextmanager
def file_server(root: str) -> Iterator[str]:
    handler = type("Files", (RangeHandler,), {})
    with serve(partial(handler, directory=root)) as url:  # type: ignore[arg-type]
        yield url


@contextmanager
def fault_proxy(upstream: str, plan: Plan) -> Iterator[str]:
    host, port = upstream.rsplit("/", 1)[-1].split(":")
    handler = type("Proxy", (FaultProxy,), {"upstream": (host, int(port)), "plan": plan})
    with serve(handler) as url:
        yield url


def main() -> None:
    ap = argparse.ArgumentParser(description="serve DIR over HTTP with byte ranges")
    ap.add_argument("dir")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    handler = partial(RangeHandler, directory=a.dir)
    server = ThreadingHTTPServer(("127.0.0.1", a.port), handler)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
