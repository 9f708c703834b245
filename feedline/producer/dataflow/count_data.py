"""CountData: pass datapoints through unchanged, counting them (stage rates for metrics)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from feedline.producer.dataflow.base import Counted, DataFlow, ProxyDataFlow


class CountData(ProxyDataFlow):
    """Yield ``ds``'s datapoints unchanged; ``count`` is how many came out, over all passes.

    ``name`` says which stage ``ds`` is (e.g. ``"0:imagenet_train"``) and ``skips`` are the
    :class:`~feedline.producer.dataflow.base.Counted` stages whose ``skipped`` counts belong to it
    (``skipped`` sums them; anything else is refused here with a TypeError, not at the
    first scrape). Both are plain
    ints, read by whoever reports them (a Prometheus collector reads them at scrape time
    from another thread): the stage itself knows nothing of metrics, and costs one
    increment per datapoint. ``len``, ``reset_state`` and ``close`` are ``ds``'s.

    Inside a :class:`~feedline.producer.dataflow.MultiProcessRunner` the copies count in their own
    processes; the runner adds what they counted to the stages of this process (``count``
    and ``skipped`` attributes), so the numbers read the same as without it.
    """

    def __init__(self, ds: DataFlow, name: str, skips: Iterable[Counted] = ()) -> None:
        super().__init__(ds)
        self.name = name
        self.skips = tuple(skips)
        for s in self.skips:
            if not isinstance(s, Counted):
                raise TypeError(f"CountData {name!r}: skips must be stages that count what "
                                f"they skip (have 'skipped'), not {type(s).__name__}")
        self.count = 0

    @property
    def skipped(self) -> int:
        """Datapoints the ``skips`` stages dropped under the skip error policy."""
        return sum(int(s.skipped) for s in self.skips)

    def __iter__(self) -> Iterator[Any]:
        for dp in self.ds:
            self.count += 1
            yield dp
