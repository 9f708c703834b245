"""Why a host refuses a peer's registration or message, one enum, and what each means to
the peer that is told. A message that does not decode is refused by the codec with a reason
of its own (``empty``, ``bad_msgpack``, ``bad_header``, ``bad_<kind>``: what failed to
decode, :class:`~feedline.errors.DecodeError`), counted under the same metric and never
sent back; a producer counts a message of a kind it never expects as ``unexpected_kind``.

A reason is a metric label (``feedline_*_rejected_messages_total{reason=...}``), the
``reason`` of a :class:`~feedline.errors.Refusal` and, where the peer is told, of a REFUSED
message. On the wire it is the value's string (a :class:`Reason` is a ``str``: the strings of
a peer of another version compare equal); here each says whether a retry can change it:

- ``producer_fatal``: any producer's registration refused for this is not retried (it
  connected to a broker's egress): it stops with one line;
- ``consumer_fatal``: a consumer's registration refused for this is not retried; the
  iterator raises it in one line instead of waiting for batches that will not come (the
  cursor it carries, the stream's mode, the broker's state);
- ``exact_producer_fatal``: the same for an exact producer (the stream's mode or pipeline,
  the broker's state directory, its limits): raised, not retried. A training producer that
  claims its shards asks for units too, and waits instead.

Every other reason is a peer's transient state or a malformed message: it is counted, and the
peer, if told, tries again.
"""

from __future__ import annotations

from enum import Enum


class Reason(str, Enum):
    """A refusal's reason, as counted and as sent (the value)."""

    # What the peer sent, or where: counted; the peer is told where it helps.
    WRONG_PORT = "wrong_port"  # a producer at the egress, a consumer at the ingress
    UNKNOWN_PEER = "unknown_peer"  # a message from a peer that never registered
    BAD_KIND = "bad_kind"  # a kind this role never sends
    BAD_HEADER = "bad_header"
    HELLO_FLOOD = "hello_flood"  # registrations faster than the host takes them
    TOO_MANY_PEERS = "too_many_peers"
    WRONG_STREAM = "wrong_stream"  # a stream name beyond the host's limits
    BATCH_TOO_LARGE = "batch_too_large"
    BUFFER_FULL = "buffer_full"  # a batch beyond its credit
    # Exact delivery and shard claims.
    NOT_EXACT = "not_exact"  # an exact request on a training stream, or the reverse
    DELIVERY_MISMATCH = "delivery_mismatch"  # another pipeline, mode or shard list
    NO_STATE_DIR = "no_state_dir"  # an exact stream on a broker without --state-dir
    TOO_MANY_STREAMS = "too_many_streams"
    TOO_MANY_UNITS = "too_many_units"
    TOO_MANY_PENDING = "too_many_pending"  # consumers waiting for their stream's coordinator
    JOURNAL_CORRUPT = "journal_corrupt"
    JOURNAL_STALE = "journal_stale"
    BAD_CURSOR = "bad_cursor"  # not a cursor, or another stream's
    CURSOR_MISMATCH = "cursor_mismatch"  # a cursor of another pipeline
    POSITION_LOST = "position_lost"  # a cursor older than what the journal keeps
    # A consumer of a job served by several hosts (--coordinator) admitted under a launch
    # before the job's current one: the job was restarted from a checkpoint elsewhere.
    RELAUNCHED = "relaunched"
    # A stream's dataset changed while its old producers are still registered, none heard
    # from since: wait (say HELLO again) until they are dropped (feedline.exact.succession).
    WAIT_OLD_PRODUCERS = "wait_old_producers"

    def __str__(self) -> str:
        return self.value

    @property
    def producer_fatal(self) -> bool:
        return self in _PRODUCER_FATAL

    @property
    def consumer_fatal(self) -> bool:
        return self in _CONSUMER_FATAL

    @property
    def exact_producer_fatal(self) -> bool:
        return self in _EXACT_PRODUCER_FATAL


_PRODUCER_FATAL = frozenset({Reason.WRONG_PORT})
_CONSUMER_FATAL = frozenset({
    Reason.WRONG_PORT, Reason.NOT_EXACT, Reason.TOO_MANY_STREAMS, Reason.TOO_MANY_PENDING,
    Reason.JOURNAL_CORRUPT, Reason.JOURNAL_STALE, Reason.BAD_CURSOR, Reason.CURSOR_MISMATCH,
    Reason.POSITION_LOST, Reason.RELAUNCHED})
_EXACT_PRODUCER_FATAL = frozenset({
    Reason.DELIVERY_MISMATCH, Reason.NO_STATE_DIR, Reason.JOURNAL_CORRUPT,
    Reason.JOURNAL_STALE, Reason.TOO_MANY_STREAMS, Reason.TOO_MANY_UNITS})

# As the peers compare a REFUSED message's reason (a plain string from the wire).
PRODUCER_FATAL = frozenset(r.value for r in _PRODUCER_FATAL)
CONSUMER_FATAL = frozenset(r.value for r in _CONSUMER_FATAL)
EXACT_PRODUCER_FATAL = frozenset(r.value for r in _EXACT_PRODUCER_FATAL)
