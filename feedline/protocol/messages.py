"""Control messages as types: one frozen dataclass per kind, one encoder, one decoder.

A control message is one frame: a msgpack map ``{"v": PROTOCOL_VERSION, "k": kind, ...}``
whose other keys are the message's fields. Each field's wire key and check live next to it
(``field(metadata=wire_key(...))``), so call sites never spell a key: they build a message
object and :func:`encode` it, and :func:`decode` gives them an object back or raises
:class:`DecodeError` with reason ``bad_<kind>`` (a metric label) naming the field. Unknown keys
are ignored (a newer peer may add fields); a missing or ill-typed field is refused.

Directions and meaning (P producer, C consumer, B broker or a direct-mode trainer):

============== ====== ====================================================================
message        dir    meaning
============== ====== ====================================================================
ProducerHello  P->B   register: id, session, next sequence number, largest batch it
                      expects to send (0: unknown), stream, previous broker instance,
                      registration number (a repeated HELLO of one registration is a no-op),
                      the supervisor that started it (``feedline fleet``), if any, and how
                      long ago it started
ConsumerHello  C->B   register: id, session, window (batches), byte budget, stream,
                      registration number, the most batches it takes in one delivery
                      (feedline.protocol.bundle; 0 none: a broker splits bundles for it)
Welcome        B->P,C registration accepted (echoes its number); the largest batch the
                      broker can ever take (its memory budget); the most batches it takes
                      in one message (feedline.protocol.bundle; 0 none) and the largest it takes
                      joined (0: the producer's default)
Grant          B->P   credit, absolute since the HELLO: may have sent ``batches`` batches
                      totalling ``nbytes`` bytes
Want           P->B   "my next batch is ``size`` bytes and my credit does not cover it"
Revoke         B->P   "stop using the credit you hold; tell me what you sent"
Returned       P->B   answer to Revoke: totals sent; the rest of the grant is given back
Taken          C->B   batches taken by the model since the HELLO (absolute), and the time
                      the model waited for data (absolute: the demand estimate's input)
Deliver        B->C   envelope in front of a forwarded batch or bundle: sequence gap seen
                      upstream
Eos, Error     P->B->C end of a producer's dataflow; a pipeline failure with traceback
UnitRequest    P->B   exact delivery: "give me a work unit" (``first``: this producer was
                      never given one: on a finished stream it starts the next run)
Unit           B->P   produce unit ``unit`` of epoch ``epoch``, from batch ``start`` on
                      (the answer to request ``ask``; after a ``busy``, sent when there is one)
UnitWait       B->P   no unit now (``busy``: the epoch's last units are in progress;
                      ``finished``: every epoch is done)
UnitDone       P->B   a unit's batches were all sent: there were ``batches`` of them
EpochEnd       B->C   every batch of ``epoch`` was taken, by some consumer of the stream
Refused        B->P,C a message was refused: reason, the refused batch's sequence number,
                      the limit it broke, a detail for the log
Reset          B->P,C "I do not know you (I restarted, or dropped you): say hello again"
Heartbeat      both   sent on a link idle for one interval
Bye            P,C->B leaving: drop my state now
               B->P   the answer to a producer's BYE: everything sent before it arrived,
                      and nothing follows it on this connection
============== ====== ====================================================================

Every message the broker sends but BYE's answer carries its instance id ``broker`` (a random
62-bit number per broker process), so a peer can tell a restarted broker, and a late message
of a replaced one, from the one it registered with. Credit messages (Grant, Want, Revoke,
Returned, Taken, Deliver) carry the registration number they belong to: one that arrives
after its peer registered again is about a registration neither side counts any more, and is
ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from feedline.errors import ConfigError
from feedline.protocol.codec import DEFAULT_LIMITS, DecodeError, Limits, packb
from feedline.protocol.fields import (
    EXACT,
    STREAM_NAME,
    TRAINING,
    U63,
    BadField,
    Check,
    blob,
    count,
    delivery_mode,
    flag,
    fleet_id,
    ident,
    index_list,
    integer,
    reason,
    stream,
    text,
    traceback_text,
    window,
    wire_key,
)
from feedline.protocol.refusals import Reason
from feedline.protocol.wire import PROTOCOL_VERSION, Kind, header_map

__all__ = [
    "BROKER_SENT", "EXACT", "TRAINING", "WAIT_OLD_PRODUCERS", "Bye", "ConsumerHello", "Deliver",
    "EpochEnd", "Eos", "Error", "Grant", "Heartbeat", "Message", "ProducerHello", "Refused",
    "Reset", "Returned", "Revoke", "Taken", "Unit", "UnitDone", "UnitRequest", "UnitWait",
    "Want", "Welcome", "broker_of", "check_stream", "decode", "encode",
]

M = TypeVar("M")
_CLASSES: dict[Kind, type] = {}


def message(kind: Kind) -> Callable[[type[M]], type[M]]:
    """Register a message class for ``kind`` (one class per kind)."""
    def register(cls: type[M]) -> type[M]:
        if kind in _CLASSES:
            raise TypeError(f"{kind!r} has a class already")
        cls.KIND = kind  # type: ignore[attr-defined]
        _CLASSES[kind] = cls
        return cls
    return register


DEFAULT_STREAM = "default"


def check_stream(name: str, limits: Limits = DEFAULT_LIMITS) -> str:
    """``name`` if the wire carries it as a stream name; else :class:`ConfigError`, one line
    naming the stream and the rule (a producer or a consumer with such a name would only ever
    see its HELLO refused, which looks like a broker that does not answer)."""
    if not isinstance(name, str) or not 1 <= len(name) <= limits.max_stream_len \
            or not STREAM_NAME.fullmatch(name):
        raise ConfigError(f"stream {name!r} is not a stream name: 1 to {limits.max_stream_len} "
                         "ASCII letters, digits, '.', '_' or '-', starting with a letter or a "
                         "digit (e.g. 'val-0', not 'val/0'); rename it")
    return name


@message(Kind.PRODUCER_HELLO)
@dataclass(frozen=True)
class ProducerHello:
    producer: str = field(metadata=wire_key("p", ident))
    session: int = field(metadata=wire_key("q", count))
    next_seq: int = field(default=0, metadata=wire_key("n", count))
    max_batch_bytes: int = field(default=0, metadata=wire_key("m", count))
    stream: str = field(default=DEFAULT_STREAM, metadata=wire_key("st", stream))
    last_broker: int = field(default=0, metadata=wire_key("lb", count))
    registration: int = field(default=0, metadata=wire_key("r", count))
    # Exact delivery: the dataset's size in samples, a unit's size, the epochs to serve
    # (0: forever). Every producer of an exact stream must say the same.
    delivery: str = field(default=TRAINING, metadata=wire_key("dm", delivery_mode))
    dataset_size: int = field(default=0, metadata=wire_key("dz", count))
    unit_size: int = field(default=0, metadata=wire_key("uz", count))
    epochs: int = field(default=0, metadata=wire_key("ep", count))
    # Started by a supervisor (`feedline fleet`): its id and the most producers it runs (0:
    # no limit), so that the broker can give each supervisor its share of the stream's number.
    fleet: str = field(default="", metadata=wire_key("f", fleet_id))
    fleet_max: int = field(default=0, metadata=wire_key("fm", count))
    # The pipeline's fingerprint (what decides the sample order and the units): the cursors
    # of the stream carry it, and a resume from another pipeline's cursor is refused.
    pipeline: int = field(default=0, metadata=wire_key("fp", count))
    # Milliseconds since this producer started (its process, for `feedline producer`), at
    # least 1; 0: not said (an older producer). An exact stream's late producer of a run just
    # served (started before the run was served, registered after) is told from the next
    # job's by it; a duration, not a time of day, so the hosts' clocks need not agree.
    age_ms: int = field(default=0, metadata=wire_key("ag", count))


@message(Kind.CONSUMER_HELLO)
@dataclass(frozen=True)
class ConsumerHello:
    consumer: str = field(metadata=wire_key("p", ident))
    session: int = field(metadata=wire_key("q", count))
    window: int = field(metadata=wire_key("w", window))
    max_bytes: int = field(metadata=wire_key("y", integer(1, U63)))
    stream: str = field(default=DEFAULT_STREAM, metadata=wire_key("st", stream))
    registration: int = field(default=0, metadata=wire_key("r", count))
    cursor: bytes = field(default=b"", metadata=wire_key("cr", blob))  # exact: resume here
    # The most batches it takes in one delivery (feedline.protocol.bundle); 0 or 1: one each.
    bundle: int = field(default=0, metadata=wire_key("bn", count))


@message(Kind.WELCOME)
@dataclass(frozen=True)
class Welcome:
    broker: int = field(metadata=wire_key("b", count))
    registration: int = field(default=0, metadata=wire_key("r", count))
    max_batch_bytes: int = field(default=0, metadata=wire_key("mb", count))  # 0: no limit
    # The most batches this host takes in one message (feedline.protocol.bundle); 0 or 1: one each.
    bundle: int = field(default=0, metadata=wire_key("bn", count))
    # The largest batch (bytes of arrays) it takes joined in a bundle (feedline.protocol.bundle);
    # 0: the producer's default, JOIN_BYTES.
    join: int = field(default=0, metadata=wire_key("jn", count))


@message(Kind.GRANT)
@dataclass(frozen=True)
class Grant:
    broker: int = field(metadata=wire_key("b", count))
    batches: int = field(metadata=wire_key("t", count))
    nbytes: int = field(metadata=wire_key("y", count))
    registration: int = field(default=0, metadata=wire_key("r", count))


@message(Kind.WANT)
@dataclass(frozen=True)
class Want:
    sent: int = field(metadata=wire_key("n", count))
    sent_bytes: int = field(metadata=wire_key("y", count))
    size: int = field(metadata=wire_key("z", count))
    registration: int = field(default=0, metadata=wire_key("r", count))


@message(Kind.REVOKE)
@dataclass(frozen=True)
class Revoke:
    broker: int = field(metadata=wire_key("b", count))
    registration: int = field(default=0, metadata=wire_key("r", count))


@message(Kind.RETURNED)
@dataclass(frozen=True)
class Returned:
    sent: int = field(metadata=wire_key("n", count))
    sent_bytes: int = field(metadata=wire_key("y", count))
    registration: int = field(default=0, metadata=wire_key("r", count))


@message(Kind.TAKEN)
@dataclass(frozen=True)
class Taken:
    taken: int = field(metadata=wire_key("t", count))
    registration: int = field(default=0, metadata=wire_key("r", count))
    # Microseconds the consumer's loop has waited for data since it started: with the count
    # taken, the broker tells what it would take if it never waited (its demand).
    waited: int = field(default=0, metadata=wire_key("w", count))


@message(Kind.DELIVER)
@dataclass(frozen=True)
class Deliver:
    broker: int = field(metadata=wire_key("b", count))
    gap: int = field(default=0, metadata=wire_key("g", count))
    registration: int = field(default=0, metadata=wire_key("r", count))


@message(Kind.EOS)
@dataclass(frozen=True)
class Eos:
    producer: str = field(metadata=wire_key("p", ident))
    seq: int = field(default=0, metadata=wire_key("s", count))
    epochs: int = field(default=0, metadata=wire_key("e", count))


@message(Kind.ERROR)
@dataclass(frozen=True)
class Error:
    producer: str = field(metadata=wire_key("p", ident))
    message: str = field(default="", metadata=wire_key("m", text))
    traceback: str = field(default="", metadata=wire_key("tb", traceback_text))


@message(Kind.REFUSED)
@dataclass(frozen=True)
class Refused:
    broker: int = field(metadata=wire_key("b", count))
    reason: str = field(metadata=wire_key("r", reason))
    seq: int = field(default=-1, metadata=wire_key("s", integer(-1, U63)))
    limit: int = field(default=0, metadata=wire_key("l", count))
    detail: str = field(default="", metadata=wire_key("d", text))


# A registration refused for this reason is not refused for good: the broker has the producer
# wait (a stream's old dataset's producers are being dropped: feedline.exact.succession);
# it says HELLO again, as after any refused registration, and logs it as a wait.
WAIT_OLD_PRODUCERS = Reason.WAIT_OLD_PRODUCERS.value


@message(Kind.RESET)
@dataclass(frozen=True)
class Reset:
    broker: int = field(metadata=wire_key("b", count))


@message(Kind.HEARTBEAT)
@dataclass(frozen=True)
class Heartbeat:
    broker: int = field(default=0, metadata=wire_key("b", count))


@message(Kind.UNIT_REQUEST)
@dataclass(frozen=True)
class UnitRequest:
    registration: int = field(default=0, metadata=wire_key("r", count))
    first: bool = field(default=False, metadata=wire_key("f", flag))
    ask: int = field(default=0, metadata=wire_key("a", count))  # echoed by the answer


@message(Kind.UNIT)
@dataclass(frozen=True)
class Unit:
    broker: int = field(metadata=wire_key("b", count))
    epoch: int = field(metadata=wire_key("e", count))
    unit: int = field(metadata=wire_key("u", count))
    start: int = field(default=0, metadata=wire_key("i", count))
    registration: int = field(default=0, metadata=wire_key("r", count))
    ask: int = field(default=0, metadata=wire_key("a", count))  # the request it answers


@message(Kind.UNIT_WAIT)
@dataclass(frozen=True)
class UnitWait:
    broker: int = field(metadata=wire_key("b", count))
    reason: str = field(metadata=wire_key("w", reason))
    registration: int = field(default=0, metadata=wire_key("r", count))
    ask: int = field(default=0, metadata=wire_key("a", count))


@message(Kind.UNIT_DONE)
@dataclass(frozen=True)
class UnitDone:
    epoch: int = field(metadata=wire_key("e", count))
    unit: int = field(metadata=wire_key("u", count))
    batches: int = field(metadata=wire_key("n", count))
    registration: int = field(default=0, metadata=wire_key("r", count))
    # batch indices below ``batches`` that were never sent: every sample of them was skipped
    empty: list[int] = field(default_factory=list, metadata=wire_key("x", index_list))


@message(Kind.EPOCH_END)
@dataclass(frozen=True)
class EpochEnd:
    broker: int = field(metadata=wire_key("b", count))
    epoch: int = field(metadata=wire_key("e", count))


@message(Kind.BYE)
@dataclass(frozen=True)
class Bye:
    pass


Message = (ProducerHello | ConsumerHello | Welcome | Grant | Want | Revoke | Returned | Taken
           | Deliver | Eos | Error | Refused | Reset | Heartbeat | Bye | UnitRequest | Unit
           | UnitWait | UnitDone | EpochEnd)
# What only a broker sends, each with its instance id in ``broker``.
BROKER_SENT = (Welcome, Grant, Revoke, Deliver, Refused, Reset, Heartbeat, Unit, UnitWait,
               EpochEnd)


def broker_of(msg: Message) -> int | None:
    """The sending broker's instance id, or None (a message a broker only forwards, or one
    from a peer; a heartbeat from a peer carries 0)."""
    if isinstance(msg, BROKER_SENT):
        return msg.broker or None
    return None


# attribute, wire key, check, default (MISSING: required), default factory (or MISSING)
_Spec = tuple[str, str, Check, Any, Any]
_SPECS: dict[type, tuple[_Spec, ...]] = {}
_MISSING = dataclasses.MISSING


def _specs(cls: type) -> tuple[_Spec, ...]:
    """A class's fields, read once (dataclasses.fields costs more than a whole encode)."""
    specs = _SPECS.get(cls)
    if specs is None:
        specs = _SPECS[cls] = tuple(
            (f.name, f.metadata["key"], f.metadata["check"], f.default, f.default_factory)
            for f in dataclasses.fields(cls))
    return specs


def encode(msg: Message) -> bytes:
    """The one frame of ``msg``."""
    out: dict[str, Any] = {"v": PROTOCOL_VERSION, "k": int(msg.KIND)}  # type: ignore[union-attr]
    d = msg.__dict__
    for name, key, _, _, _ in _specs(type(msg)):
        out[key] = d[name]
    return packb(out)


def decode(frame: Any, limits: Limits = DEFAULT_LIMITS) -> Message:
    """The control message in ``frame``; :class:`DecodeError` for anything else (a batch
    header included: reason ``bad_kind``)."""
    header = header_map(frame, limits)
    return from_map(header, limits)


def from_map(header: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """The control message of an already unpacked, version-checked header map."""
    kind = header["k"]
    cls = _CLASSES.get(kind)
    if cls is None:
        raise DecodeError("bad_kind", f"{kind.name} is not a control message")
    values: dict[str, Any] = {}
    for name, key, check, default, factory in _specs(cls):
        v = header.get(key, _MISSING)
        if v is _MISSING:
            if default is not _MISSING:
                values[name] = default
            elif factory is not _MISSING:
                values[name] = factory()
            else:
                raise DecodeError(f"bad_{kind.name.lower()}", f"missing field {key!r}")
            continue
        try:
            values[name] = check(v, limits)
        except BadField:
            raise DecodeError(f"bad_{kind.name.lower()}", f"field {key!r}") from None
    # Every field is in ``values``, checked: set them as the frozen class's __init__ would,
    # without its object.__setattr__ per field (a control message per batch arrives).
    msg: Any = object.__new__(cls)
    msg.__dict__.update(values)
    return msg
