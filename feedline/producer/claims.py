"""Training producers claim their shards from the broker: the producer's side.

A pipeline whose source reads shards (:class:`~feedline.producer.dataflow.sharded.
ShardedSource`) and has no static ``shard`` of its own reads the shards the broker hands it:
:func:`claiming_source` finds that source, :func:`claim_spec` is what the producer declares
in its HELLO (the number of shards, the epochs), and :class:`SenderClaims` asks through the
producer's own connection (the broker's side: :mod:`feedline.serving.handout`). So every
shard is read by one producer per epoch across all producers of the stream, with no list
per machine, whatever producers join or leave.
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

from feedline.errors import ConfigError
from feedline.producer.dataflow.base import DataFlow, stages
from feedline.producer.dataflow.sharded import ShardedSource
from feedline.producer.outbox import ExactSpec
from feedline.protocol import messages as m


def claiming_source(df: DataFlow) -> ShardedSource | None:
    """The sharded source under ``df`` that claims its shards, if any (at most one)."""
    found = [s for s in stages(df) if isinstance(s, ShardedSource) and s.claims]
    if len(found) > 1:
        raise ConfigError("a pipeline can claim shards for one sharded source, not "
                         f"{len(found)}: give the others a static shard")
    return found[0] if found else None


def claim_spec(src: ShardedSource, epochs: int | None) -> ExactSpec:
    return ExactSpec(len(src.urls), 1, epochs or 0, m.TRAINING,
                     fingerprint=list_fingerprint(src.urls))


def list_fingerprint(urls: list[str]) -> int:
    """The shard list (its expanded names, in order) as one number, 1 .. 2**63 - 1: the
    broker keeps one claim table per list, and starts a fresh one when a stream's list
    changes (feedline.serving.handout)."""
    digest = hashlib.blake2b(json.dumps(list(urls)).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


class SenderClaims:
    """A :class:`~feedline.producer.dataflow.sharded.ClaimFeed` over a producer's Sender: a
    claim is a unit the broker hands out, acknowledged at once (the producer reads it from
    now on: at most once). Called from the thread that iterates the pipeline."""

    def __init__(self, sender: Any, stop: threading.Event | None) -> None:
        self.sender, self.stop = sender, stop

    def claim(self) -> tuple[int, int] | None:
        got = self.sender.next_unit(self.stop)
        if got is None:
            return None
        self.sender.unit_done(got.epoch, got.unit, 0, stop=self.stop)
        return got.epoch, got.unit
