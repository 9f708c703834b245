"""LocallyShuffleData: shuffle within a bounded buffer (for sequential sources such as LMDB)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from feedline.errors import ConfigError
from feedline.producer.dataflow.base import DataFlow, ProxyDataFlow
from feedline.producer.dataflow.worker import make_rng


class LocallyShuffleData(ProxyDataFlow):
    """Yield the input's datapoints in a shuffled order, holding at most ``buffer_size``.

    Each datapoint goes into a random slot of a full buffer, and the one there comes out;
    the buffer is drained in random order at the end of a pass, so every input datapoint is
    yielded exactly once per pass. The order is a function of ``(seed, epoch, worker)``.
    """

    def __init__(self, ds: DataFlow, buffer_size: int, seed: int = 0) -> None:
        super().__init__(ds)
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ConfigError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        self.buffer_size, self.seed = buffer_size, seed
        self._epoch = 0

    def reset_state(self) -> None:
        super().reset_state()
        self._epoch = 0

    def __iter__(self) -> Iterator[Any]:
        rng = make_rng(self.seed, self._epoch)
        self._epoch += 1
        buf: list[Any] = []
        for dp in self.ds:
            if len(buf) < self.buffer_size:
                buf.append(dp)
                continue
            i = int(rng.integers(self.buffer_size))
            out, buf[i] = buf[i], dp
            yield out
        rng.shuffle(buf)  # type: ignore[arg-type]
        yield from buf
