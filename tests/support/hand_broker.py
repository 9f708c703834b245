"""A broker played by hand: a ROUTER socket that speaks the wire protocol message by message,
for tests of what a peer does when its broker says (or does not say) a thing."""


from __future__ import annotations

import zmq

from feedline.procs import free_port
from feedline.protocol import messages as m

BROKER_ID = 12345


class HandBroker:
    """A ROUTER that records what a link sends and answers what the test says."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.addr)
        self.ident: bytes | None = None

    def received(self) -> list[m.Message]:
        """Everything the link has sent so far (without waiting)."""
        out = []
        while self.sock.poll(0):
            ident, frame = self.sock.recv_multipart()
            self.ident = ident
            out.append(m.decode(frame))
        return out

    def send(self, msg: m.Message) -> None:
        assert self.ident is not None
        self.sock.send_multipart([self.ident, m.encode(msg)])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
