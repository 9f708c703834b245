"""FakeData: synthetic datapoints of given shapes, for tests and speed ceilings."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np

from feedline.errors import ConfigError
from feedline.producer.dataflow.base import DataFlow


class FakeData(DataFlow):
    """``size`` datapoints, each a list of arrays of ``shapes`` and ``dtypes``.

    With ``random=False`` the same constant arrays are yielded every time (no generation
    cost: measures everything but the pipeline). With ``random=True`` values are drawn
    uniformly from ``domain`` by a generator seeded with ``seed`` at ``reset_state``.
    Yielded arrays are never modified afterwards, so they can be sent zero-copy.

    ``delay`` seconds are slept before each datapoint (in ``__iter__`` and ``sample``): a
    source with a fixed rate per reader whatever the CPU, like a slow disk or a remote store
    (load tests of a fleet: its supply then grows with the number of producers, not cores).
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        size: int = 1000,
        random: bool = True,
        dtype: str | Sequence[str] = "float32",
        domain: tuple[float, float] = (0, 1),
        seed: int = 0,
        delay: float = 0.0,
    ) -> None:
        if size < 0:
            raise ConfigError("size must be >= 0")
        if not delay >= 0:
            raise ConfigError("delay must be >= 0")
        self.delay = float(delay)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        dtypes = [dtype] * len(self.shapes) if isinstance(dtype, str) else list(dtype)
        if len(dtypes) != len(self.shapes):
            raise ConfigError(f"{len(dtypes)} dtypes for {len(self.shapes)} shapes")
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.size, self.random, self.domain, self.seed = size, random, domain, seed
        self._rng: np.random.Generator | None = None
        self._const: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.size

    def reset_state(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self._const = None

    def _make(self, rng: np.random.Generator) -> list[np.ndarray]:
        lo, hi = self.domain
        out = []
        for shape, dt in zip(self.shapes, self.dtypes, strict=True):
            if dt.kind in "iu":
                out.append(rng.integers(int(lo), max(int(hi), int(lo) + 1), shape, dtype=dt))
            elif dt.kind == "b":
                out.append(rng.random(shape) < 0.5)
            else:
                out.append((rng.random(shape) * (hi - lo) + lo).astype(dt))
        return out

    def sample(self, i: int) -> list[np.ndarray]:
        """Datapoint ``i``: a pure function of (seed, i), for exact delivery."""
        if self.delay:
            time.sleep(self.delay)
        if not self.random:
            if self._const is None:
                self._const = self._make(np.random.default_rng(self.seed))
            return list(self._const)
        return self._make(np.random.default_rng([self.seed, i]))

    def samples(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[list[np.ndarray]]:
        if self._rng is None:
            self.reset_state()
        assert self._rng is not None
        if not self.random:
            if self._const is None:
                self._const = self._make(np.random.default_rng(self.seed))
            for _ in range(self.size):
                if self.delay:
                    time.sleep(self.delay)
                yield list(self._const)
            return
        for _ in range(self.size):
            if self.delay:
                time.sleep(self.delay)
            yield self._make(self._rng)
