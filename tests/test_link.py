"""The client link's registration protocol against a broker played by hand (a real ROUTER).

Found by the consumer SIGSTOP fault scenario: a peer that wakes up after the broker dropped
it has several messages in flight (credit, heartbeats); the broker answers each with RESET.
Re-registering on every one of them made the broker reset its state of that peer several
times while batches and credit of the earlier registrations were still on the wire, and the
credit accounting of the two sides drifted apart until neither sent anything: a deadlock
with both sides alive and heartbeating.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from feedline import wire
from feedline.link import BrokerLink, LinkConfig
from feedline.procs import free_port, wait_for

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=5.0)
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

    def received(self) -> list[dict]:
        """Everything the link has sent so far (without waiting)."""
        out = []
        while self.sock.poll(0):
            ident, frame = self.sock.recv_multipart()
            self.ident = ident
            out.append(wire.decode_header(frame))
        return out

    def send(self, kind: wire.Kind, **fields: object) -> None:
        assert self.ident is not None
        self.sock.send_multipart([self.ident,
                                  wire.encode_control(kind, b=BROKER_ID, **fields)])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def drive(link: BrokerLink, seconds: float) -> None:
    """Let the link handle what arrives, and do its liveness work, for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if link.socket is None:  # between a reconnect and its retry
            time.sleep(0.02)
        elif link.socket.poll(20):
            link.handle(wire.decode_header(link.socket.recv()))
        link.tick()


def kinds(msgs: list[dict]) -> list[wire.Kind]:
    return [m["k"] for m in msgs]


@dataclass
class Linked:
    """A link welcomed by a hand-played broker; ``registrations`` counts its HELLO cycles."""

    broker: HandBroker
    link: BrokerLink
    registrations: list[int] = field(default_factory=list)


def welcomed_link(config: LinkConfig) -> Iterator[Linked]:
    broker = HandBroker()
    ctx = zmq.Context()
    registrations: list[int] = []
    link = BrokerLink(ctx, broker.addr, hello=lambda: {"r": "consumer", "c": 4},
                      config=config, on_register=lambda: registrations.append(1))
    try:
        def said_hello() -> bool:
            drive(link, 0.05)
            return wire.Kind.HELLO in kinds(broker.received())

        wait_for(said_hello, 10, what="the first HELLO")
        broker.send(wire.Kind.CREDIT, t=0)  # instance BROKER_ID welcomes it
        drive(link, 0.1)
        assert link.welcomed and len(registrations) == 1
        yield Linked(broker, link, registrations)
    finally:
        link.close()
        ctx.term()
        broker.close()


@pytest.fixture
def linked() -> Iterator[Linked]:
    yield from welcomed_link(FAST)


@pytest.fixture
def quick_linked() -> Iterator[Linked]:
    """Heartbeats every 0.1 s, timeout 0.5 s: pauses beyond it fit in a test."""
    yield from welcomed_link(LinkConfig(heartbeat_interval=0.1, heartbeat_timeout=0.5))


def test_stale_resets_after_a_hello_do_not_register_again(linked: Linked) -> None:
    broker, link, registrations = linked.broker, linked.link, linked.registrations
    # The broker forgets the peer (it was silent too long). Three messages the peer sent
    # before it knew are answered with three RESETs, in a row, before its new HELLO.
    for _ in range(3):
        broker.send(wire.Kind.RESET)
    drive(link, 0.3)
    hellos = kinds(broker.received()).count(wire.Kind.HELLO)
    assert hellos == 1, "one RESET, one new registration: the others answered old messages"
    assert len(registrations) == 2
    # The answer to that HELLO welcomes it; a RESET after that is a new event again.
    broker.send(wire.Kind.CREDIT, t=0)
    drive(link, 0.1)
    assert link.welcomed
    broker.send(wire.Kind.RESET)
    drive(link, 0.2)
    assert kinds(broker.received()).count(wire.Kind.HELLO) == 1
    assert len(registrations) == 3


def test_a_late_message_of_a_restarted_broker_does_not_register_again(linked: Linked) -> None:
    broker, link, registrations = linked.broker, linked.link, linked.registrations
    new = BROKER_ID + 1
    broker.sock.send_multipart([broker.ident or b"",
                                wire.encode_control(wire.Kind.HEARTBEAT, b=new)])
    drive(link, 0.2)
    assert len(registrations) == 2, "a new instance: register with it"
    assert kinds(broker.received()).count(wire.Kind.HELLO) == 1
    # A message the old instance had sent before it died arrives late: ignore it.
    broker.send(wire.Kind.HEARTBEAT)
    drive(link, 0.2)
    assert len(registrations) == 2 and link.broker_id == new
    assert wire.Kind.HELLO not in kinds(broker.received())


def test_a_peer_that_was_away_does_not_blame_the_broker(quick_linked: Linked) -> None:
    """A process paused past the heartbeat timeout (SIGSTOP, a long GC or swap stall) must
    not take its own absence for the broker's silence: reconnecting drops the batches the
    broker delivered meanwhile (seen in the consumer SIGSTOP scenario, where libzmq had not
    yet moved them from the kernel into the socket when the woken loop checked). It asks
    instead, and gives up on a broker that is really gone one timeout later."""
    broker, link = quick_linked.broker, quick_linked.link
    broker.received()
    time.sleep(1.0)  # the scenario itself: this peer does not run for two timeouts
    link.tick()  # the first thing a resumed loop may do, before anything arrived
    assert link.reconnects == 0 and link.socket is not None
    wait_for(lambda: wire.Kind.HEARTBEAT in kinds(broker.received()), 5,
             what="a heartbeat: it asks the broker")
    broker.send(wire.Kind.HEARTBEAT)
    drive(link, 0.3)
    assert link.reconnects == 0, "the broker answered: nothing to reconnect for"
    drive(link, 1.0)  # now the broker is silent for two timeouts while we run
    assert link.reconnects >= 1, "a broker silent while we run is still given up on"


def test_the_client_socket_refuses_oversized_messages(linked: Linked) -> None:
    """Producers and consumers receive through this socket: libzmq drops a peer whose message
    exceeds the limit before any of it is buffered (ZMQ_MAXMSGSIZE), as on the broker."""
    assert linked.link.socket is not None
    assert linked.link.socket.getsockopt(zmq.MAXMSGSIZE) == FAST.limits.max_message_bytes
