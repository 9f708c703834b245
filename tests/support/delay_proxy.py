"""A TCP proxy that adds latency, for kernels without ``netem``.

``python -m tests.support.delay_proxy --listen 127.0.0.1:7000 --target 10.213.0.1:7878 --delay 0.1``
forwards every connection to ``--target``; each chunk read in either direction is written out
``delay`` seconds after it was read, in order, so both directions see the delay (the round trip
grows by ``2 * delay``). SIGUSR1 turns the delay on, SIGUSR2 off (``--start-off`` starts with
it off): a test can add and remove latency without breaking connections.

Memory is bounded: at most ``--max-buffer`` bytes wait per direction of a connection; beyond
that the proxy stops reading (TCP flow control pushes back on the sender).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time


class Delay:
    def __init__(self, seconds: float, on: bool) -> None:
        self.seconds, self.on = seconds, on

    @property
    def now(self) -> float:
        return self.seconds if self.on else 0.0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay,
                max_buffer: int) -> None:
    pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    room = asyncio.Semaphore(max(1, max_buffer // 65536))

    async def read() -> None:
        try:
            while data := await reader.read(65536):
                await room.acquire()
                await pending.put((time.monotonic() + delay.now, data))
        finally:
            await pending.put((0.0, b""))

    async def write() -> None:
        while True:
            due, data = await pending.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            room.release()
            await writer.drain()

    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _serve(listen: str, target: str, delay: Delay, max_buffer: int) -> None:
    thost, tport = target.rsplit(":", 1)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.wait_for(asyncio.open_connection(thost, int(tport)), 10)
        except (OSError, asyncio.TimeoutError):
            w.close()
            return
        await asyncio.gather(_pipe(r, tw, delay, max_buffer), _pipe(tr, w, delay, max_buffer))

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(delay, "on", True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(delay, "on", False))
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen", required=True, help="host:port to accept connections on")
    ap.add_argument("--target", required=True, help="host:port to forward them to")
    ap.add_argument("--delay", type=float, default=0.1, help="seconds added each way")
    ap.add_argument("--start-off", action="store_true", help="start without the delay")
    ap.add_argument("--max-buffer", type=int, default=16 << 20,
                    help="bytes held per direction of a connection")
    a = ap.parse_args()
    asyncio.run(_serve(a.listen, a.target, Delay(a.delay, not a.start_off), a.max_buffer))


if __name__ == "__main__":
    main()
