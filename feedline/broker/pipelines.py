"""What producers that left (or went silent) have buffered on a training stream, against the
pipeline that produces it now (docs/architecture.md, "Streams").

A producer names its pipeline in its HELLO (a fingerprint; 0: not said). A consumer of a
stream expects the batches of what produces the stream now, so what a producer of another
pipeline left is dropped once a producer of this one has registered after that producer was
last heard from. "Last heard from", not "seen to leave": a producer killed with ``kill -9``
stays registered until the heartbeat timeout, and a new pipeline's producer that registers
within it must not get the dead one's batches served to its trainer meanwhile. So while a
registered producer has been silent since before a producer of another pipeline registered,
its buffered batches are *held back* (kept, counted, not served): heard from again, it was
producing beside the other (two pipelines feeding one stream on purpose) and they are served;
dropped at the timeout, they are replaced. A live producer is heard from at least once a
heartbeat interval, so that is how long its batches can wait.

Exact streams are not judged here: their coordinator knows their pipeline and units.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from feedline.broker.buffer import Buffer
from feedline.logs import RateLimitedLog
from feedline.serving.held import Held
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.peers import Producer

log = logging.getLogger(__name__)


@dataclass
class _Session:
    """A producer session whose batches the buffer may hold: who, of which pipeline, when it
    was seen to register (by the loop) and to leave, and its registration (whose
    ``last_seen`` says when it was last heard from, after it left too)."""

    name: str
    stream: str
    pipeline: int  # its HELLO's fingerprint (0: not said)
    joined: float
    peer: Producer
    left: float | None = None
    told: bool = False  # its leftovers being served was logged

    @property
    def heard(self) -> float:
        return self.peer.last_seen


@dataclass
class _HeldBack:
    """Batches (and end/error messages, in order) of a session silent since before a
    producer of another pipeline registered (at ``since``, the latest such)."""

    stream: str
    since: float
    items: list[Held] = field(default_factory=list)
    batches: int = 0
    nbytes: int = 0


def _fp(pipeline: int) -> str:
    return f"pipeline {pipeline:016x}" if pipeline else "no pipeline fingerprint"


class Leftovers:
    """The broker's judge of leftovers (call :meth:`judge` when producers come or go and on
    the loop's tick, :meth:`heard` for every message a producer's batch brings)."""

    def __init__(self, buffer: Buffer, metrics: BrokerMetrics,
                 is_exact: Callable[[str], bool]) -> None:
        # ``is_exact(stream)``: the stream is served exactly (its coordinator judges it)
        self.buffer, self.metrics, self.is_exact = buffer, metrics, is_exact
        # Producer sessions seen, and departed ones whose batches may still be buffered
        # (bounded: the registered producers, and departed ones with something buffered).
        self._sessions: dict[int, _Session] = {}
        self.held_back: dict[int, _HeldBack] = {}  # by session (at most one per producer)
        self._log = RateLimitedLog(log, interval=10.0, burst=8)
        self.registered = 0  # producers registered when judge last looked
        self.departed = False  # ... and whether departed ones' batches were held then

    # -- what is held back counts in the budget ------------------------------------------
    def held(self) -> tuple[int, int]:
        return (sum(h.batches for h in self.held_back.values()),
                sum(h.nbytes for h in self.held_back.values()))

    def held_by_stream(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for h in self.held_back.values():
            b, y = out.get(h.stream, (0, 0))
            out[h.stream] = (b + h.batches, y + h.nbytes)
        return out

    def keys(self, stream: str) -> set[tuple[int, int, int]]:
        """The exact keys of ``stream``'s batches held back."""
        return {i.batch.key for h in self.held_back.values() if h.stream == stream
                for i in h.items if i.batch is not None}

    def heard(self, session: int) -> None:
        """A message of ``session`` arrived: what it had held back goes back in line, in
        front of it (its order is kept)."""
        h = self.held_back.pop(session, None)
        if h is not None:
            for item in reversed(h.items):
                self.buffer.requeue(h.stream, item)

    # -- judging ---------------------------------------------------------------------------
    def judge(self, now: float, producers: Iterable[Producer],
              read: Callable[[str], bool]) -> bool:
        """What departed or silent producers left in a (training) stream's buffer, against
        what produces the stream now (``read``: whether a consumer reads a stream):

        - batches of a departed pipeline whose fingerprint differs from those the producers
          of the stream now say, one of which registered after it was last heard from, are
          dropped, counted (``feedline_broker_replaced_batches_total``) and logged once,
          naming both: a consumer of the stream expects the batches of what produces it
          (before, a Keras ``fit`` got the last run's, of another shape, minutes later);
        - while the producer is still registered but silent since before that registration,
          they are held back, not served (a producer killed with ``kill -9`` is registered
          until the timeout: a trainer of the new pipeline got its batches meanwhile);
        - a departed producer's end and error messages are dropped as soon as a producer
          of the stream has registered after it was last heard from (its run was replaced: a
          trainer started now must not get the old run's ``ProducerError``);
        - leftovers that stay (the same pipeline, or no producer now, or one that says no
          fingerprint, or a pipeline that produced beside it) are served, and logged once a
          departed session (WARNING unless the same pipeline produces the stream now) when a
          consumer reads them.

        Returns True if it dropped anything (room freed: a plan)."""
        self.registered = 0
        live: dict[str, list[_Session]] = {}
        keys = set()
        for p in producers:
            self.registered += 1
            keys.add(p.session)
            s = self._sessions.get(p.session)
            if s is None or s.stream != p.stream:
                s = self._sessions[p.session] = _Session(p.name, p.stream, p.pipeline, now, p)
            s.peer, s.left = p, None  # (back, if it had left: on a new registration)
            live.setdefault(p.stream, []).append(s)
        for key, h in list(self.held_back.items()):
            s = self._sessions.get(key)
            if key not in keys or s is None or s.heard > h.since:
                self.heard(key)  # heard from again, or gone: judged below as departed
        gone: dict[str, dict[int, _Session]] = {}
        for key, s in self._sessions.items():
            if s.left is None and key not in keys:
                s.left = now
            if s.left is not None:
                gone.setdefault(s.stream, {})[key] = s
        freed = False
        for stream, departed in gone.items():
            if not self.is_exact(stream):
                freed |= self._drop(stream, departed, live.get(stream, []), read(stream))
            held = {h.session for h in self.buffer.items(stream)}
            for key in departed:
                if key not in held:
                    del self._sessions[key]
        for stream, current in live.items():
            if not self.is_exact(stream):
                self._hold_back(stream, current)
        self.departed = any(s.left is not None for s in self._sessions.values())
        return freed

    def _hold_back(self, stream: str, current: list[_Session]) -> None:
        """Hold back the batches of each producer of ``stream`` that has been silent since
        before a producer of another pipeline registered, and that no other producer of its
        own pipeline goes on producing (those would be served whatever it does). Linear in
        the stream's producers: it runs every tick."""
        per: dict[int, list[float]] = {}  # pipeline -> [producers, latest registration]
        for n in current:
            if n.pipeline:
                t = per.setdefault(n.pipeline, [0, 0.0])
                t[0], t[1] = t[0] + 1, max(t[1], n.joined)
        if len(per) < 2:
            return  # one pipeline (or none said): nothing replaces anything
        latest = sorted(per.items(), key=lambda kv: kv[1][1], reverse=True)[:2]
        for s in current:
            if not s.pipeline or per[s.pipeline][0] > 1 or s.peer.session in self.held_back:
                continue
            # The latest registration of another pipeline than its own.
            since = latest[1][1][1] if latest[0][0] == s.pipeline else latest[0][1][1]
            if since <= s.heard:
                continue
            key = s.peer.session
            h = _HeldBack(stream, since)

            def mine(item: Held, key: int = key, h: _HeldBack = h) -> bool:
                if item.session != key:
                    return False
                h.items.append(item)
                if not item.broadcast:
                    h.batches, h.nbytes = h.batches + item.count, h.nbytes + item.nbytes
                return True

            if self.buffer.discard(stream, mine):
                self.held_back[key] = h
                newer = sorted({n.name for n in current if n.pipeline
                                and n.pipeline != s.pipeline and n.joined > s.heard})
                self._log.info(
                    "stream %s: holding back %d batches of producer %s (%s), silent since "
                    "before producer %s of another pipeline registered: served if it is heard "
                    "from again, dropped if it is dropped", stream, h.batches, s.name,
                    _fp(s.pipeline), ", ".join(newer))

    def _drop(self, stream: str, departed: dict[int, _Session], current: list[_Session],
              read: bool) -> bool:
        """:meth:`judge` for one stream: ``departed`` sessions, by key, and those of the
        producers registered on it ``current``; True if it dropped anything."""
        fps = {s.pipeline for s in current if s.pipeline}
        # Replaced: a producer registered after it was last heard from (of another
        # pipeline, for its batches). One of another pipeline that registered while it
        # produced (two pipelines feeding one stream on purpose) replaces nothing: what it
        # left is served.
        replaced = {k for k, s in departed.items() if any(n.joined > s.heard for n in current)}
        stale = {k for k, s in departed.items()
                 if k in replaced and s.pipeline and fps and s.pipeline not in fps
                 and any(n.pipeline and n.joined > s.heard for n in current)}
        freed = False
        if stale or replaced:
            dropped: dict[int, list[int]] = {}  # session -> [batches, end/error messages]

            def void(h: Held) -> bool:
                if h.session in stale or (h.broadcast and h.session in replaced):
                    n = dropped.setdefault(h.session, [0, 0])
                    n[h.broadcast] += 1 if h.broadcast else h.count
                    return True
                return False

            if self.buffer.discard(stream, void):
                freed = True
                label = self.metrics.stream_label.label(stream)
                for key, (n, controls) in dropped.items():
                    s = departed[key]
                    newer = [c for c in current if c.joined > s.heard]
                    self.metrics.replaced.labels(label).inc(n)
                    self._log.warning(
                        "stream %s: dropped %d batches%s left by producer %s (%s), which "
                        "left: producer %s (%s) registered after it was last heard from and "
                        "produces the stream now", stream, n,
                        f" and {controls} end/error message(s)" if controls else "",
                        s.name, _fp(s.pipeline), ", ".join(sorted({c.name for c in newer})),
                        ", ".join(sorted({_fp(c.pipeline) for c in newer})))
        if not read:
            return freed
        left = {h.session for h in self.buffer.items(stream) if not h.broadcast}
        for key in left & departed.keys():
            s = departed[key]
            if s.told:
                continue
            s.told = True
            same = bool(s.pipeline) and fps == {s.pipeline}
            self._log.log(
                logging.INFO if same else logging.WARNING,
                "stream %s: serving batches left by producer %s (%s), which left; %s",
                stream, s.name, _fp(s.pipeline), _why_served(s.pipeline, fps, bool(current)))
        return freed


def _why_served(pipeline: int, fps: set[int], producing: bool) -> str:
    """Why a departed producer's batches (of ``pipeline``) are served while producers of
    ``fps`` (those that say one) produce the stream (``producing``: any does)."""
    if not producing:
        return "no producer of the stream is registered now"
    if pipeline and fps == {pipeline}:
        return "the same pipeline produces the stream now"
    if not pipeline:
        return "it said no pipeline fingerprint to compare with its producers' now"
    if not fps:
        return "its producers now say no pipeline fingerprint to compare"
    others = ", ".join(_fp(f) for f in sorted(fps - {pipeline}))
    if pipeline in fps:
        return f"its pipeline produces the stream now, beside {others}"
    return (f"{others} produced the stream beside it (registered while it was heard from): "
            "pipelines that feed one stream together are served together")
