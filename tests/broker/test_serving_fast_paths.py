"""The serving side's per-batch fast paths give what the general code gives.

- The credit planner tallies its producers in one pass (:meth:`CreditPlanner._tally`) and
  remembers the budget's per-stream shares: after every step of a random history the tally,
  each stream's room and the new producers' room equal what the per-producer properties and
  ``Budget.per_stream`` say, computed here from scratch the way the planner did before.
- The planner grants a top-up in bulk once a single producer is left that can take more
  (:meth:`CreditPlanner._more_of`): the same grants, in every plan of a random history, as
  giving it one credit per pass over the producers.
- The broker sends a batch without a gap behind the DELIVER envelope it built once for the
  consumer's registration: the same bytes as encoding that Deliver, for every registration;
  a batch after a gap gets its own.
- A producer's received batches and bytes go to the series of its label, looked up once:
  the exposition counts every batch, shared "other" label included.
- A direct-mode trainer counts a bundle's batches against the producer's credit, and hands
  them to its queue, all at once: the credit, the gaps, the metrics, the producer's stats and
  the queue are what counting and taking each batch alone makes them, after every bundle of
  a random history (lost batches, a bundle beyond its credit included).
"""

from __future__ import annotations

import numpy as np
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from prometheus_client import CollectorRegistry

from feedline.broker.buffer import Buffer
from feedline.broker.egress import ConsumerSide
from feedline.consumer.direct import _LocalSink
from feedline.consumer.io import Shared
from feedline.errors import Refusal
from feedline.protocol import messages as m
from feedline.protocol import wire
from feedline.protocol.bundle import MAX_BUNDLE, bundle_frames, decode_bundle
from feedline.protocol.codec import DEFAULT_LIMITS, packb
from feedline.protocol.encode import prepare_batch
from feedline.serving.budget import Budget, Share, depth, top_up
from feedline.serving.credit import CreditPlanner
from feedline.serving.held import Held
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.producers import IngressConfig, ProducerSide

KEYS = [bytes([i]) for i in range(6)]
STREAMS = ["a", "b", "c"]


def general_shares(cp: CreditPlanner, by_stream: dict[str, tuple[int, int]],
                   unread: set[str], budget: Budget) -> dict[str, Share]:
    """The rule of ``CreditPlanner.shares`` computed without its cache, of ``budget``."""
    produced = {p.stream for p in cp.producers.values() if p.received > 0}
    produced |= {s for s, (b, y) in by_stream.items() if b > 0 or y > 0}
    registered = {p.stream for p in cp.producers.values()}
    counted = produced | {s for s in registered if s not in unread}
    return {s: budget.per_stream(len(counted) + (s not in counted), read=s not in unread)
            for s in registered | counted}


def planner_model(budget: Budget, sizes: st.SearchStrategy[int], held_bytes: int,
                  by_bytes: bool, first: st.SearchStrategy[int] | None = None
                  ) -> type[RuleBasedStateMachine]:
    """The planner's model: batches of ``sizes`` within ``budget``; ``by_bytes`` (a broker's
    and a direct-mode trainer's planner): small batches counted by their bytes. Every run starts
    with one producer running, its first batch of ``first`` bytes (default ``sizes``)."""
    running_sizes: st.SearchStrategy[int] = sizes if first is None else first

    class PlannerTally(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.cp = CreditPlanner(budget, window=4, lease=1.0, by_bytes=by_bytes)
            self.now = 0.0
            self.held: dict[str, tuple[int, int]] = {}
            self.unread: set[str] = set()
            self.deepest = 0  # the most batches the budget has counted so far

        @rule(key=st.sampled_from(KEYS), stream=st.sampled_from(STREAMS),
              declared=st.one_of(st.just(0), sizes))
        def join(self, key: bytes, stream: str, declared: int) -> None:
            self.cp.join(key, declared, stream)

        @initialize(size=running_sizes)
        def running(self, size: int) -> None:
            """A producer that has sent and been planned for: its window (a deep one for small
            batches, counted by bytes) is what the steps then spend and top up."""
            self.cp.join(KEYS[0], 0, STREAMS[0])
            self.cp.batch(KEYS[0], size, self.now)
            self.cp.plan(self.now, 0, 0, {}, set())

        @precondition(lambda self: self.cp.producers)
        @rule(data=st.data(), size=sizes)
        def want(self, data: st.DataObject, size: int) -> None:
            key = data.draw(st.sampled_from(sorted(self.cp.producers)))
            p = self.cp.producers[key]
            self.cp.want(key, p.received, p.received_bytes, size)

        @precondition(lambda self: self.cp.producers)
        @rule(data=st.data(), size=sizes)
        def batch(self, data: st.DataObject, size: int) -> None:
            key = data.draw(st.sampled_from(sorted(self.cp.producers)))
            self.cp.batch(key, size, self.now)  # a breach too: it is counted all the same

        @precondition(lambda self: self.cp.producers)
        @rule(data=st.data(), size=running_sizes, n=st.integers(1, 12))
        def stream(self, data: st.DataObject, size: int, n: int) -> None:
            """A producer that keeps up: ``n`` batches of one size (as the first's) arrive
            between plans."""
            key = data.draw(st.sampled_from(sorted(self.cp.producers)))
            for _ in range(n):
                self.cp.batch(key, size, self.now)

        @precondition(lambda self: self.cp.producers)
        @rule(data=st.data(), size=sizes)
        def refused(self, data: st.DataObject, size: int) -> None:
            key = data.draw(st.sampled_from(sorted(self.cp.producers)))
            self.cp.batch(key, size, self.now)
            self.cp.refused(key)

        @precondition(lambda self: self.cp.producers)
        @rule(data=st.data())
        def returned(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.cp.producers)))
            p = self.cp.producers[key]
            self.cp.returned(key, p.received, p.received_bytes)

        @precondition(lambda self: self.cp.producers)
        @rule(data=st.data())
        def leave(self, data: st.DataObject) -> None:
            self.cp.leave(data.draw(st.sampled_from(sorted(self.cp.producers))))

        @rule(stream=st.sampled_from(STREAMS), b=st.integers(0, 6),
              y=st.integers(0, held_bytes), read=st.booleans())
        def hold(self, stream: str, b: int, y: int, read: bool) -> None:
            self.held[stream] = (b, y)
            (self.unread.discard if read else self.unread.add)(stream)

        @rule(dt=st.sampled_from([0.0, 0.5, 2.0]))
        def plan(self, dt: float) -> None:
            self.now += dt
            hb = sum(b for b, _ in self.held.values())
            hy = sum(y for _, y in self.held.values())
            idle = {k: p.granted for k, p in self.cp.producers.items()
                    if p.idle and not p.wanting}
            before = {k: p.outstanding for k, p in self.cp.producers.items()}
            granted = {k: p.granted for k, p in self.cp.producers.items() if not p.wanting}
            out_before = sum(before.values())
            self.cp.plan(self.now, hb, hy, dict(self.held), set(self.unread))
            cp, ps = self.cp, self.cp.producers
            # A producer held idle (new, gave its credit back, or its batch was refused) gets
            # nothing it did not ask for.
            assert all(ps[k].granted == g for k, g in idle.items()), idle
            # No plan grants beyond the budget counted for the producers' largest unit, nor
            # a producer beyond its window (one credit it asked for aside).
            units = [p.unit for p in ps.values() if p.unit > 0]
            if by_bytes and units:
                assert cp.budget == budget.for_unit(max(units))
            elif not by_bytes:
                assert cp.budget == budget
            out = sum(p.outstanding for p in ps.values())
            assert out <= max(out_before, cp.budget.max_batches - hb), (out, hb, cp.budget)
            for k, p in ps.items():
                window = depth(4, p.unit) if by_bytes else 4
                assert p.outstanding <= max(before[k], window, 1), (p, window)
                # A deep window is topped up by parts: no unasked credit while less than
                # top_up(window) of it was free.
                if k in granted and window - before[k] < top_up(window):
                    assert p.granted == granted[k], (p, window, before[k])

        @invariant()
        def tally_is_the_general_sums(self) -> None:
            cp = self.cp
            out_b, out_y, mine, produced, fresh_b, fresh_y = cp._tally()
            ps = list(cp.producers.values())
            assert (out_b, out_y) == cp.outstanding()
            assert produced == {p.stream for p in ps if p.received > 0}
            assert mine == {s: [sum(p.outstanding for p in ps if p.stream == s),
                                sum(p.reserved for p in ps if p.stream == s)]
                            for s in {p.stream for p in ps}}
            new = [p for p in ps if p.received == 0]
            assert (fresh_b, fresh_y) == (sum(p.outstanding for p in new),
                                          sum(p.reserved for p in new))
            share = cp.budget.new_producers
            assert cp._fresh_room(fresh_b, fresh_y) == [share.batches - fresh_b,
                                                        share.nbytes - fresh_y,
                                                        int(fresh_b == fresh_y == 0)]

        @invariant()
        def room_is_the_general_room(self) -> None:
            cp = self.cp
            _, _, mine, produced, _, _ = cp._tally()
            # What a stream may keep (the shares that evict) is counted for the deepest
            # budget so far: a count that shrank must not evict batches granted under the
            # deeper one. What may be granted is counted for the budget now.
            self.deepest = max(self.deepest, cp.budget.max_batches)
            assert cp.deepest.max_batches == self.deepest
            kept = cp.shares(self.held, self.unread)
            assert kept == general_shares(cp, self.held, self.unread, cp.deepest)
            shares = general_shares(cp, self.held, self.unread, cp.budget)
            assert all(kept[s].batches >= sh.batches and kept[s].nbytes == sh.nbytes
                       for s, sh in shares.items()), (kept, shares)
            room = cp._stream_room(self.held, self.unread, mine, produced)
            ps = list(cp.producers.values())
            assert room == {s: [sh.batches - self.held.get(s, (0, 0))[0]
                                - sum(p.outstanding for p in ps if p.stream == s),
                                sh.nbytes - self.held.get(s, (0, 0))[1]
                                - sum(p.reserved for p in ps if p.stream == s)]
                            for s, sh in shares.items()}

    return PlannerTally


_MODEL = settings(max_examples=60, stateful_step_count=40, deadline=None)
# A planner counting windows in batches, whatever their size (``by_bytes=False``).
TestPlannerTally = planner_model(Budget(12, 12_000), st.integers(1, 3000), 6000,
                                 by_bytes=False).TestCase
TestPlannerTally.settings = _MODEL
# A broker's and a direct-mode trainer's: batches on both sides of 8 MiB (SMALL_BATCH), small
# ones counted by bytes, and a producer of large batches joining and leaving changes the count.
TestPlannerTallyByBytes = planner_model(
    Budget(12, 60 << 20), st.one_of(st.integers(1, 3000), st.integers(1 << 20, 10 << 20)),
    24 << 20, by_bytes=True, first=st.integers(1, 3000)).TestCase
TestPlannerTallyByBytes.settings = settings(_MODEL, max_examples=200)  # top-ups are rarer


def _consumer_side(sent: list[tuple[bytes, list]]) -> ConsumerSide:
    def send(ident: bytes, frames: list) -> int:
        sent.append((ident, frames))
        return 0

    return ConsumerSide(send, Buffer(), BrokerMetrics(CollectorRegistry()), DEFAULT_LIMITS,
                        Budget(64, 1 << 26), 16, 987654321, lambda *_: None)


def test_the_broker_sends_the_envelope_its_registration_would_encode() -> None:
    sent: list[tuple[bytes, list]] = []
    side = _consumer_side(sent)
    for reg, ident in ((0, b"c0"), (7, b"c7"), (2**40, b"big")):
        side.on_message(ident, [zmq.Frame(m.encode(m.ConsumerHello(
            consumer=ident.decode(), session=5, window=8, max_bytes=1 << 24,
            registration=reg)))], -1, 0.0)
    gaps = [0, 0, 3, 0, 1, 0, 0, 0, 0]
    for gap in gaps:
        side.buffer.push("default", Held([b"h", b"x" * 10], 12, 10, 5, gap))
    sent.clear()
    assert side.dispatch(1.0) == len(gaps)
    regs = {b"c0": 0, b"c7": 7, b"big": 2**40}
    assert [f[0] for _, f in sent] == [
        m.encode(m.Deliver(broker=987654321, gap=gap, registration=regs[ident]))
        for (ident, _), gap in zip(sent, gaps, strict=True)]
    assert {ident for ident, _ in sent} == set(regs), "every consumer was sent some"
    assert [m.decode(f[0]) for _, f in sent] == [
        m.Deliver(broker=987654321, gap=gap, registration=regs[ident])
        for (ident, _), gap in zip(sent, gaps, strict=True)], "and they decode as sent"


def test_a_taken_counts_the_batches_it_frees_and_plans_only_past_the_wake() -> None:
    """A consumer's TAKEN (one per delivery) adds the batches it took to ``taken_since``,
    a bundle's as its batches, and does not set ``freed``: a broker whose last plan was short
    of room plans again once ``wake`` batches were taken (feedline.broker.core), not at
    every TAKEN. A HELLO (a consumer came) still sets ``freed``."""
    sent: list[tuple[bytes, list]] = []
    side = _consumer_side(sent)
    side.on_message(b"c", [zmq.Frame(m.encode(m.ConsumerHello(
        consumer="c", session=5, window=8, max_bytes=1 << 24, registration=1, bundle=8)))],
        -1, 0.0)
    assert side.freed
    for _ in range(3):
        side.buffer.push("default", Held([b"h", b"x" * 10], 12, 10, 5, 0))
    side.buffer.push("default", Held([b"h", b"x" * 40], 42, 40, 5, 0, count=4))
    assert side.dispatch(1.0) == 7
    side.freed, side.taken_since = False, 0
    for taken, since in ((2, 2), (3, 3), (7, 7), (7, 7)):
        side.on_message(b"c", [zmq.Frame(m.encode(m.Taken(taken=taken, waited=0,
                                                            registration=1)))], -1, 1.0)
        assert side.taken_since == since and not side.freed
    c = side.consumers.get(b"c")
    assert c is not None and c.inflight_bytes == 0, "the bundle left once all taken"


class _Sink:
    def __init__(self) -> None:
        self.items: list[Held] = []

    def held(self) -> tuple[int, int]:
        return len(self.items), sum(i.nbytes for i in self.items)

    def held_by_stream(self) -> dict[str, tuple[int, int]]:
        return {"default": self.held()}

    def read(self, stream: str) -> bool:
        return True

    def accept(self, stream: str, item: Held) -> bool:
        self.items.append(item)
        return True

    def accept_batches(self, stream: str, batches: list, gap: int) -> None:
        raise AssertionError("a broker's ingress keeps a bundle whole")

    def epoch_end(self, stream: str, epoch: int) -> None:
        pass

    def producer_joined(self, stream: str, producer: str) -> None:
        pass

    def keys(self, stream: str) -> set[tuple[int, int, int]]:
        return set()


def test_received_batches_count_in_the_producers_series_looked_up_once() -> None:
    """Three producers with room for two labels: the third shares "other" with nobody
    else's series; every batch and byte is counted in the series of its producer's label."""
    reg = CollectorRegistry()
    metrics = BrokerMetrics(reg, max_producer_labels=3)
    sink, sent = _Sink(), []  # what the host sent back (WELCOME, GRANT)

    def send(ident: bytes, frames: list) -> int:
        sent.append((ident, frames))
        return 0

    side = ProducerSide(send, sink, metrics,
                        DEFAULT_LIMITS, IngressConfig(Budget(64, 1 << 26), 4, 2.0, 16), 1,
                        lambda *_: None)
    prepared = prepare_batch([np.arange(100, dtype=np.uint8)], DEFAULT_LIMITS, 2)
    names = {b"i1": "p1", b"i2": "p2", b"i3": "p3"}
    for ident, name in names.items():
        side.on_message(ident, [zmq.Frame(m.encode(m.ProducerHello(
            producer=name, session=int.from_bytes(ident, "big"),
            max_batch_bytes=prepared.wire_bytes)))], -1, 0.0)
        side.on_message(ident, [zmq.Frame(m.encode(m.Want(sent=0, sent_bytes=0,
                                                          size=prepared.wire_bytes)))], -1, 0.0)
    counts = {b"i1": 3, b"i2": 1, b"i3": 2}
    seqs = dict.fromkeys(names, 0)
    for _ in range(4):
        side.plan(0.0)
        for ident, n in counts.items():
            if seqs[ident] < n and side.planner.producers[ident].outstanding:
                frames = prepared.frames(producer=packb(names[ident]),
                                         session=int.from_bytes(ident, "big"),
                                         seq=seqs[ident], epoch=0)
                side.on_message(ident, [zmq.Frame(f) for f in frames], -1, 0.0)
                seqs[ident] += 1
    assert seqs == counts, "every producer got credit for its batches"

    def value(name: str, label: str) -> float | None:
        return reg.get_sample_value(f"feedline_broker_received_{name}_total",
                                    {"producer": label})

    labels = {p.ident: p.label for p in side.producers}
    assert sorted(labels.values()) == ["other", "p1", "p2"]
    for label in set(labels.values()):
        n = sum(counts[i] for i, lab in labels.items() if lab == label)
        assert value("batches", label) == n
        assert value("bytes", label) == n * 100
    assert len(sink.items) == sum(counts.values())


def _walked(buf: Buffer) -> dict[str, tuple[int, int]]:
    """(batches, bytes) per stream counted by walking every item, as by_stream once did."""
    out = {}
    for s in buf.streams():
        items = [h for h in buf.items(s) if not h.broadcast]
        out[s] = (len(items), sum(h.nbytes for h in items))
    return out


_ops = st.lists(st.tuples(st.sampled_from(["push", "control", "pop", "requeue", "evict",
                                           "discard"]),
                          st.sampled_from(STREAMS), st.integers(0, 50)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_the_buffers_kept_totals_are_what_a_walk_of_it_counts(ops) -> None:
    buf = Buffer(control_slack=4)
    popped: list[tuple[str, Held]] = []
    for op, stream, n in ops:
        if op == "push":
            buf.push(stream, Held([b"h"], n, n, 0, 0))
        elif op == "control":
            buf.push(stream, Held([b"c"], 0, 0, 0, 0, broadcast=True))
        elif op == "pop" and buf.peek(stream) is not None:
            popped.append((stream, buf.pop(stream)))
        elif op == "requeue" and popped:
            buf.requeue(*popped.pop())
        elif op == "evict":
            buf.evict(stream, n % 4, n * 3)
        elif op == "discard":
            rest = n % 3

            def void(h: Held, rest: int = rest) -> bool:
                return h.nbytes % 3 == rest

            buf.discard(stream, void)
        assert buf.by_stream() == _walked(buf)
        assert buf.batches == sum(b for b, _ in _walked(buf).values())
        assert buf.nbytes == sum(y for _, y in _walked(buf).values())


class OneAtATime(CreditPlanner):
    """The planner without its bulk top-up: one credit per producer per pass, to the end."""

    BULK = False


SIZES = st.sampled_from([100, 16_000, 150_528, 1 << 20, 9 << 20])
# Batches arrive most often, as they do, of a part of the bytes of credit their producer
# holds (a whole one can be more than its unit: the bytes it asked for). held: what the host
# holds, as a part of the budget.
OPS = st.lists(st.tuples(st.sampled_from(["batch"] * 6 + ["want", "rejoin", "returned"]),
                         st.sampled_from(KEYS[:3]), SIZES,
                         st.sampled_from([0.1, 0.5, 1.0]),
                         st.sampled_from([0.0, 0.0, 0.25, 0.5, 0.9])), min_size=10, max_size=150)


@settings(max_examples=300, deadline=None)
@given(max_batches=st.sampled_from([4, 32, 128]),
       max_bytes=st.sampled_from([1 << 20, 64 << 20, 1 << 30]),
       window=st.sampled_from([1, 4, 16]), by_bytes=st.booleans(),
       joins=st.lists(st.tuples(SIZES, st.sampled_from(STREAMS[:2])), min_size=3, max_size=3),
       ops=OPS)
def test_a_bulk_top_up_grants_what_one_credit_per_pass_grants(
        max_batches: int, max_bytes: int, window: int, by_bytes: bool,
        joins: list[tuple[int, str]], ops: list[tuple[str, bytes, int, float, float]]) -> None:
    budget = Budget(max_batches, max_bytes)
    bulk = CreditPlanner(budget, window, 1.0, by_bytes=by_bytes)
    ref = OneAtATime(budget, window, 1.0, by_bytes=by_bytes)
    streams = {key: stream for key, (_, stream) in zip(KEYS[:3], joins, strict=True)}
    for key, (size, stream) in zip(KEYS[:3], joins, strict=True):
        for cp in (bulk, ref):
            cp.join(key, size, stream)
            cp.want(key, 0, 0, size)
    now = 0.0
    for op, key, size, part, held in ops:
        now += 0.1
        p = ref.producers[key]
        if op == "want":
            assert bulk.want(key, p.received, p.received_bytes, size) \
                == ref.want(key, p.received, p.received_bytes, size)
        elif op == "batch" and p.outstanding > 0:
            nbytes = max(1, int(part * p.reserved))
            assert bulk.batch(key, nbytes, now) == ref.batch(key, nbytes, now)
        elif op == "rejoin":  # a new registration of it, which asks for credit
            for cp in (bulk, ref):
                cp.leave(key)
                cp.join(key, size, streams[key])
                cp.want(key, 0, 0, size)
        elif op == "returned":
            sent, sent_bytes = p.received, p.received_bytes
            assert bulk.returned(key, sent, sent_bytes) == ref.returned(key, sent, sent_bytes)
        hb, hy = int(held * max_batches), int(held * max_bytes)
        by_stream = {"a": (hb, hy)}
        unread = {"b"} if held == 0.25 else set()
        got, want = (cp.plan(now, hb, hy, by_stream, unread) for cp in (bulk, ref))
        assert sorted(got.grants) == sorted(want.grants) and got.revokes == want.revokes
        assert {k: (q.granted, q.granted_bytes) for k, q in bulk.producers.items()} \
            == {k: (q.granted, q.granted_bytes) for k, q in ref.producers.items()}
        assert (bulk.blocked, bulk.due) == (ref.blocked, ref.due)


def _direct_side() -> tuple[ProducerSide, Shared, CollectorRegistry]:
    shared = Shared("c", 1, 8, 1 << 30, "default", "raise", CollectorRegistry(), slots=4096)
    registry = CollectorRegistry()
    side = ProducerSide(lambda ident, frames: 0, _LocalSink(shared), BrokerMetrics(registry),
                        DEFAULT_LIMITS, IngressConfig(Budget(64, 1 << 30), 8, 2.0, 16,
                                                      stream="default", by_bytes=True,
                                                      bundle=MAX_BUNDLE), 1, lambda *_: None)
    return side, shared, registry


def _on_message(side: ProducerSide, ident: bytes, frames: list, now: float) -> None:
    side.on_message(ident, frames, -1, now)


def _one_by_one(side: ProducerSide, ident: bytes, frames: list, now: float) -> None:
    """What a direct-mode trainer did with a bundle before it took its batches at once: each
    batch charged, then taken, alone."""
    header = wire.header_map(frames[0])
    p = side._sender(ident, "BUNDLE", now)
    batches = decode_bundle(frames, DEFAULT_LIMITS, header, MAX_BUNDLE)
    for b in batches:
        side._charge(p, b.wire_bytes, now)
    side.dirty = side.dirty or side.planner.producers[ident].received == len(batches)
    for b in batches:
        side._take(p, b, [], b.wire_bytes)


def _samples(registry: CollectorRegistry) -> list:
    return [(s.name, s.labels, s.value) for f in registry.collect() for s in f.samples
            if not s.name.endswith("_created")]


def _state(side: ProducerSide, shared: Shared, registry: CollectorRegistry,
           ident: bytes) -> tuple:
    c = side.planner.producers.get(ident)
    credit = None if c is None else (vars(c).copy(), side.planner.due, side.planner.blocked)
    queued = [(d.batch.seq, d.batch.nbytes, d.batch.wire_bytes, d.nbytes,
               [a.tobytes() for a in d.batch.datapoint]) for d in shared.queue._items]
    return (credit, side.dirty, dict(side.gaps._last), shared.queued_bytes,
            {k: vars(v) for k, v in shared.io.stats.items()}, queued, _samples(registry),
            _samples(shared.setup.registry))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 9), st.integers(0, 3), st.booleans(),
                          st.integers(1, 300)), min_size=1, max_size=8))
def test_a_bundle_is_taken_at_once_as_its_batches_one_by_one(steps) -> None:
    """``steps``: (batches in the bundle, batches lost before it, credit one batch short,
    bytes per batch). Each side gets the same credit and the same bundles."""
    ident = b"i1"
    sides = [_direct_side(), _direct_side()]
    hello = m.encode(m.ProducerHello(producer="p", session=7, max_batch_bytes=400))
    for side, _, _ in sides:
        side.on_message(ident, [zmq.Frame(hello)], -1, 0.0)
    seq, now = 0, 0.0
    for count, lost, short, nbytes in steps:
        now += 0.25
        seq += lost
        prepared = [prepare_batch([np.full(nbytes, seq + i, np.uint8)], DEFAULT_LIMITS, 2)
                    for i in range(count)]
        frames = bundle_frames(prepared, producer=packb("p"), session=7, seq=seq, epoch=0)
        seq += count
        outcomes: list[str | None] = []
        for (side, _, _), take in zip(sides, (_on_message, _one_by_one), strict=True):
            c = side.planner.producers.get(ident)
            if c is not None:  # the credit its plans gave: enough, or one batch short
                c.granted = c.received + count - short
                c.granted_bytes = c.received_bytes + count * (nbytes + 400)
            try:
                take(side, ident, [zmq.Frame(f) for f in frames], now)
                outcomes.append(None)
            except Refusal as e:
                outcomes.append(e.reason)
        assert outcomes[0] == outcomes[1]
        assert _state(*sides[0], ident) == _state(*sides[1], ident)
