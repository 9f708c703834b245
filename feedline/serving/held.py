"""What an ingress hands its sink: a message as it arrived, weighed, with its batch decoded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from feedline.wire import Batch


@dataclass(slots=True)  # one per batch: slots make it 0.2 us cheaper
class Held:
    frames: list[Any]  # [header, arrays...] as received
    nbytes: int  # wire bytes: what the memory budget counts
    array_bytes: int
    session: int
    gap: int  # batches of its session lost upstream since the previous one
    broadcast: bool = False  # EOS / ERROR: to every consumer of the stream, in order
    batch: Batch | None = None  # decoded (views on the frames), for a sink that wants it
