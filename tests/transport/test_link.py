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
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from feedline.procs import wait_for
from feedline.protocol import messages as m
from feedline.transport.link import Link, LinkConfig
from tests.support.hand_broker import BROKER_ID, HandBroker

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=5.0)




def drive(link: Link, seconds: float) -> None:
    """Let the link handle what arrives, and do its liveness work, for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if link.socket is None:  # between a reconnect and its retry
            time.sleep(0.02)
        elif link.socket.poll(20):
            link.receive(lambda _link, _msg, _frames: None)
        link.tick()


def hellos(msgs: list[m.Message]) -> list[m.ConsumerHello]:
    return [x for x in msgs if isinstance(x, m.ConsumerHello)]


@dataclass
class Linked:
    """A link welcomed by a hand-played broker; ``registrations`` counts its HELLO cycles."""

    broker: HandBroker
    link: Link
    registrations: list[int] = field(default_factory=list)

    def welcome(self, broker_id: int = BROKER_ID) -> None:
        self.broker.send(m.Welcome(broker=broker_id, registration=self.link.registration))


def welcomed_link(config: LinkConfig) -> Generator[Linked, None, None]:
    broker = HandBroker()
    ctx = zmq.Context()
    registrations: list[int] = []
    link = Link(ctx, broker.addr, config=config, on_register=registrations.append,
                hello=lambda reg: m.ConsumerHello(consumer="c", session=1, window=4,
                                                  max_bytes=1 << 20, registration=reg))
    linked = Linked(broker, link, registrations)
    try:
        def said_hello() -> bool:
            drive(link, 0.05)
            return bool(hellos(broker.received()))

        wait_for(said_hello, 10, what="the first HELLO")
        linked.welcome()  # instance BROKER_ID welcomes it
        drive(link, 0.1)
        assert link.welcomed and len(registrations) == 1
        yield linked
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
        broker.send(m.Reset(broker=BROKER_ID))
    drive(link, 0.3)
    sent = hellos(broker.received())
    assert len(sent) == 1, "one RESET, one new registration: the others answered old messages"
    assert len(registrations) == 2
    # The answer to that HELLO welcomes it; a RESET after that is a new event again.
    linked.welcome()
    drive(link, 0.1)
    assert link.welcomed
    broker.send(m.Reset(broker=BROKER_ID))
    drive(link, 0.2)
    assert len(hellos(broker.received())) == 1
    assert len(registrations) == 3


def test_a_late_message_of_a_restarted_broker_does_not_register_again(linked: Linked) -> None:
    broker, link, registrations = linked.broker, linked.link, linked.registrations
    new = BROKER_ID + 1
    broker.send(m.Heartbeat(broker=new))
    drive(link, 0.2)
    assert len(registrations) == 2, "a new instance: register with it"
    assert len(hellos(broker.received())) == 1
    # A message the old instance had sent before it died arrives late: ignore it.
    broker.send(m.Heartbeat(broker=BROKER_ID))
    drive(link, 0.2)
    assert len(registrations) == 2 and link.broker_id == new
    assert not hellos(broker.received())


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
    wait_for(lambda: any(isinstance(x, m.Heartbeat) for x in broker.received()), 5,
             what="a heartbeat: it asks the broker")
    broker.send(m.Heartbeat(broker=BROKER_ID))
    drive(link, 0.3)
    assert link.reconnects == 0, "the broker answered: nothing to reconnect for"
    drive(link, 1.0)  # now the broker is silent for two timeouts while we run
    assert link.reconnects >= 1, "a broker silent while we run is still given up on"


def test_the_client_socket_refuses_oversized_messages() -> None:
    """Producers and consumers receive through this socket: a broker (or anything posing as
    one) that sends a message larger than the limit is disconnected by libzmq before any of
    it is buffered (ZMQ_MAXMSGSIZE), and the link sees nothing of it."""
    limits = LinkConfig().limits
    small = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=5.0,
                       limits=type(limits)(max_message_bytes=1 << 16, max_header_bytes=1024))
    gen = welcomed_link(small)
    linked = next(gen)
    try:
        broker, link = linked.broker, linked.link
        seen: list[m.Message] = []
        broker.sock.send_multipart([broker.ident or b"", b"\0" * (1 << 20)])
        broker.send(m.Heartbeat(broker=BROKER_ID))  # on the same, now cut, connection
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            if link.socket is not None and link.socket.poll(20):
                link.receive(lambda _link, msg, _frames: seen.append(msg))
        assert seen == [], "nothing of the oversized message, nor what followed it, arrived"
        # libzmq reconnects by itself: the link registers again on the new connection.
        def new_hello() -> bool:
            drive(link, 0.05)
            return bool(hellos(broker.received()))

        wait_for(new_hello, 10, what="a HELLO on the new connection")
    finally:
        gen.close()
