"""Exact delivery's work units, as producers ask for them and say they are done.

A producer asks for a unit (UNIT_REQUEST, numbered: the answer echoes the number) and is
answered with one (UNIT), or told why not (UNIT_WAIT: ``busy``, the epoch's last units are in
progress elsewhere or the broker is recovering; ``finished``, its run is served). One told
``busy`` is remembered, and sent its unit as soon as the coordinator may have one (its
``progress`` moved: the next epoch began, a unit was given back): an epoch's end then costs no
producer a backoff, only a message. A producer that does not number its requests asks again
by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from feedline.errors import Refusal
from feedline.exact import Coordinator, ExactStreams, NoUnit
from feedline.protocol import messages as m
from feedline.serving.claims import ClaimStreams
from feedline.serving.peers import Peer

Control = Callable[[bytes, m.Message], int]


class Units:
    """The unit requests of exact streams' producers (``control`` sends one a message,
    ``epoch_end(stream, epoch)`` tells a stream's consumers an epoch is complete)."""

    def __init__(self, exact: ExactStreams, control: Control, instance: int,
                 epoch_end: Callable[[str, int], None],
                 claims: ClaimStreams | None = None) -> None:
        self.exact, self._control, self.instance = exact, control, instance
        self.claims = claims if claims is not None else ClaimStreams()
        self._epoch_end = epoch_end
        # producers told "busy": ident -> (the coordinator's progress then, request, first)
        self._waiting: dict[bytes, tuple[int, int, bool]] = {}

    def route(self, p: Peer, msg: m.UnitRequest | m.UnitDone) -> None:
        """A producer's UNIT_REQUEST or UNIT_DONE: answered by its training stream's shard
        claims, or by its exact stream's coordinator (:meth:`message`); refused on a stream
        that is neither."""
        c = self.exact.get(p.stream)
        claims = self.claims.get(p.stream) if c is None else None
        if claims is not None:  # a training producer claims a shard, or starts one
            reply = claims.answer(p.ident, msg, self.instance, p.registration)
            if reply is not None:
                self._control(p.ident, reply)
            return
        if c is None:
            raise Refusal("not_exact", f"{type(msg).__name__} on stream {p.stream}")
        self.message(p, c, msg)

    def message(self, p: Peer, c: Coordinator, msg: m.UnitRequest | m.UnitDone) -> None:
        """A producer of ``c``'s stream asks for a unit or says one is done."""
        if msg.registration != p.registration:
            return  # about an earlier registration on this connection
        if isinstance(msg, m.UnitDone):
            for epoch in c.unit_done(p.ident, msg.epoch, msg.unit, msg.batches, msg.empty):
                self._epoch_end(p.stream, epoch)
            return
        self._answer(p, c, msg.ask, msg.first, time.monotonic())

    def _answer(self, p: Peer, c: Coordinator, ask: int, first: bool, now: float,
                pushed: bool = False) -> None:
        """Answer request ``ask`` with a unit or why not (``pushed``: a try for one told
        ``busy``, which is not told so again)."""
        got = c.request(p.ident, now, first)
        if got is NoUnit.BUSY:
            if ask:
                self._waiting[p.ident] = (c.progress, ask, first)
            if not pushed:
                self._control(p.ident, m.UnitWait(broker=self.instance, reason=got.value,
                                                  registration=p.registration, ask=ask))
            return
        self._waiting.pop(p.ident, None)
        if isinstance(got, NoUnit):
            self._control(p.ident, m.UnitWait(broker=self.instance, reason=got.value,
                                              registration=p.registration, ask=ask))
        else:
            self._control(p.ident, m.Unit(broker=self.instance, epoch=got.epoch, unit=got.unit,
                                          start=got.start, registration=p.registration,
                                          ask=ask))

    def push(self, now: float, producers: Callable[[bytes], Peer | None]) -> None:
        """Try again for every producer told ``busy`` whose coordinator moved since."""
        for ident, (seen, ask, first) in list(self._waiting.items()):
            p = producers(ident)
            c = self.exact.get(p.stream) if p is not None else None
            if p is None or c is None:
                del self._waiting[ident]
            elif c.progress != seen:
                self._answer(p, c, ask, first, now, pushed=True)

    def waiting(self) -> bool:
        return bool(self._waiting)

    def forget(self, idents: Iterable[bytes]) -> None:
        for ident in idents:
            self._waiting.pop(ident, None)
