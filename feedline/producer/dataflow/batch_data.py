"""BatchData: group datapoints into batches, component by component.

A batch stacks each component of its datapoints into one array, so every datapoint must
agree with the others on each component: the same structure (list length, dict keys), and
per component the same kind (an array of one shape and dtype; a bool, an int that fits int64,
a float, a str...). A datapoint that does not is *odd*: the batch's kind of a component is the
one at least half of its datapoints have (a tie is broken by the kind of this stage's last
batch), and the others are named (where they were read: :func:`~feedline.producer.dataflow.
base.name_of`) and, under ``on_error="skip"``, skipped and counted (``skipped``), the batch
filled from the next datapoints; under ``"raise"``, a :class:`DataError` naming the first. A
component on which no kind holds half the batch is ragged data, whatever ``on_error`` says:
a :class:`DataError` saying to batch it with ``use_list`` (or to map it to one shape).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

from feedline.errors import ConfigError, DataError
from feedline.producer.dataflow.base import DataFlow, ProxyDataFlow, name_of
from feedline.producer.dataflow.errors import check_policy

log = logging.getLogger(__name__)
Kind = tuple[Any, ...]
_INT64 = (-(2**63), 2**63)
_COMPOSITE = (list, tuple, dict)  # datapoints of components; anything else is one
_STRUCTURE = "structure"  # the key of a datapoint's structure among the last batch's kinds


class BatchData(ProxyDataFlow):
    """Yield batches of ``batch_size`` datapoints.

    Each component is stacked into one array of shape ``(batch_size, *shape)`` (scalars
    become a 1-D array); with ``use_list=True`` components are plain lists instead (for
    ragged data: nothing is stacked, nothing is odd). With ``remainder=True`` the last,
    smaller batch of a pass is yielded too, else dropped. Datapoints may be lists/tuples (a
    list of components comes out) or dicts; anything else is a datapoint of one component
    (a batch of plain numbers is ``[array]``). A datapoint that does not stack with the others
    (the module docstring) raises a DataError naming it, or with ``on_error="skip"`` is
    skipped, logged with its name and why, and counted in ``skipped``.
    """

    def __init__(self, ds: DataFlow, batch_size: int, remainder: bool = False,
                 use_list: bool = False, on_error: str = "raise") -> None:
        super().__init__(ds)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.batch_size, self.remainder, self.use_list = batch_size, remainder, use_list
        self.on_error = check_policy(on_error)
        # the last pass's datapoints, and how many of them ended in no batch (fewer than
        # batch_size left over with remainder=False): what an epoch without a batch says
        self.taken = self.dropped = 0
        self.skipped = 0  # odd datapoints skipped, over all passes (a Counted stage)
        self._last: dict[Any, Kind] = {}  # per component, the kind of the last batch made

    def __len__(self) -> int:
        n = len(self.ds)
        return -(-n // self.batch_size) if self.remainder else n // self.batch_size

    def __iter__(self) -> Iterator[Any]:
        holder: list[Any] = []
        self.taken = self.dropped = 0
        for dp in self.ds:
            holder.append(dp)
            self.taken += 1
            if len(holder) == self.batch_size:
                batch, holder = self._make(holder)
                if batch is not None:
                    yield batch
        while self.remainder and holder:
            batch, holder = self._make(holder)
            if batch is not None:
                yield batch
        self.dropped = len(holder)

    def _make(self, holder: list[Any]) -> tuple[Any, list[Any]]:
        """(the batch of ``holder``, []); or, where some of them are odd and skipped,
        (None, the others: to fill up again)."""
        holder = _components(holder)
        if self.use_list:
            return _aggregate(holder, True), []
        odd = odd_samples(holder, self._last)
        if not odd:
            return _aggregate(holder, False), []
        first = self.taken - len(holder)  # the pass's index of holder[0]
        if self.on_error != "skip":
            i, why = odd[0]
            raise DataError(f"BatchData: {_named(holder[i], first + i)} {why}: it does not "
                            "stack with them; fix it, or set on_error: skip to skip such "
                            "samples (use_list: true batches ragged data)")
        for i, why in odd:
            log.warning("skipped a datapoint: %s %s: it does not stack with them",
                        _named(holder[i], first + i), why)
        self.skipped += len(odd)
        gone = {i for i, _ in odd}
        return None, [dp for i, dp in enumerate(holder) if i not in gone]

    def why_empty(self) -> str | None:
        """Why the last pass yielded no batch, when this stage is why: it was given samples
        and dropped them as a remainder; else None."""
        if self.taken and self.dropped == self.taken:
            return (f"the source gave {self.taken} samples and batch (batch_size "
                    f"{self.batch_size}, remainder: false) dropped them: lower batch_size "
                    "or set remainder: true")
        return None

    @staticmethod
    def aggregate(dps: list[Any], use_list: bool = False) -> Any:
        """Stack a list of datapoints component-wise (DataError naming a datapoint that does
        not stack with the others: :func:`odd_samples` says which)."""
        dps = _components(dps)
        if not use_list and len(dps) > 1:
            odd = odd_samples(dps)
            if odd:
                i, why = odd[0]
                raise DataError(f"BatchData: {_named(dps[i], i)} {why}: it does not stack "
                                "with them")
        return _aggregate(dps, use_list)


def _components(dps: list[Any]) -> list[Any]:
    """A datapoint that is neither a list/tuple nor a dict (a bare label, an image) is one
    component: batched as ``[x]`` (a source of plain numbers batches into one array)."""
    if all(isinstance(dp, _COMPOSITE) for dp in dps):
        return dps
    return [dp if isinstance(dp, _COMPOSITE) else [dp] for dp in dps]


def _aggregate(dps: list[Any], use_list: bool) -> Any:
    first = dps[0]
    if isinstance(first, dict):
        return {k: _stack([dp[k] for dp in dps], use_list, k) for k in first}
    return [_stack([dp[i] for dp in dps], use_list, i) for i in range(len(first))]


def odd_samples(dps: list[Any], last: dict[Any, Kind] | None = None) -> list[tuple[int, str]]:
    """The datapoints of ``dps`` that do not stack with the others: ``(index, why)``, in
    order. ``last``: per component, the kind of the previous batch (breaks a tie; updated
    with this batch's kinds). DataError where a component is ragged (no kind holds half
    of ``dps``)."""
    last = {} if last is None else last
    odd: dict[int, str] = {}
    structs = [_structure(dp) for dp in dps]
    ref = _reference(structs, last.get(_STRUCTURE), "the datapoints' structure")
    for i, s in enumerate(structs):
        if s != ref:
            odd[i] = f"has {_describe(s)} where the others in its batch have {_describe(ref)}"
    # a dict's keys in the order of the first datapoint that has them (any order agrees)
    keys = list(dps[structs.index(ref)]) if ref[0] == "keys" else \
        range(ref[1]) if ref[0] == "length" else ()
    made: dict[Any, Kind] = {_STRUCTURE: ref}
    # Each component's kind is the one most of the well-structured datapoints have, all of
    # them, those odd on another component too: a datapoint is odd where it differs from
    # the majority, not from what is left once others were set aside (which can leave a tie).
    at = [i for i in range(len(dps)) if i not in odd]
    for k in keys:
        values = [dps[i][k] for i in at]
        kinds = [_kind(v) for v in values]
        kref = _reference(kinds, last.get(k), f"component {k!r}")
        made[k] = kref
        every = kinds.count(kref) == len(kinds)  # the usual batch: nothing odd to look for
        if every and (kref != ("int",) or _INT64[0] <= min(values) and max(values) < _INT64[1]):
            continue
        for i, v, kind in zip(at, values, kinds, strict=True):
            if i in odd:
                continue  # said already, of an earlier component
            if kind != kref:
                odd[i] = (f"component {k!r} is {_describe(kind)} where the others in its "
                          f"batch have {_describe(kref)}")
            elif kind == ("int",) and not _INT64[0] <= int(v) < _INT64[1]:
                odd[i] = f"component {k!r} is {int(v)}, which does not fit int64"
    if len(odd) < len(dps):
        last.update(made)
    return sorted(odd.items())


def _structure(dp: Any) -> Kind:
    if isinstance(dp, dict):
        return ("keys", frozenset(dp))
    if isinstance(dp, (list, tuple)):
        return ("length", len(dp))
    return ("whole", type(dp).__name__)  # an array as a datapoint: stacked by its rows


_SCALARS: dict[type, Kind] = {int: ("int",), float: ("float",), bool: ("bool",)}


def _kind(x: Any) -> Kind:
    kind = _SCALARS.get(type(x))  # the usual labels first: a dict lookup, not isinstance
    if kind is not None:
        return kind
    if isinstance(x, np.ndarray):
        return ("array", x.dtype, x.shape)
    if isinstance(x, (bool, np.bool_)):
        return ("bool",)
    if isinstance(x, (int, np.integer)):
        return ("int",)
    if isinstance(x, (float, np.floating)):
        return ("float",)
    if isinstance(x, list):
        # a list (of JSON numbers, say: a box) stacks with those of its length only
        return ("list", len(x))
    return (type(x).__name__,)


def _reference(kinds: list[Kind], last: Kind | None, what: str) -> Kind:
    """The kind at least half of ``kinds`` have (of two halves, ``last``); DataError if
    none: ragged data."""
    n = len(kinds)
    if kinds.count(kinds[0]) == n:
        return kinds[0]
    held = [k for k, c in Counter(kinds).most_common(2) if 2 * c >= n]
    if len(held) == 2 and last in held:
        return last
    if len(held) == 1:
        return held[0]
    if len(held) == 2:
        a, b = held
        raise DataError(f"BatchData: cannot stack {what}: half of its {n} values are "
                        f"{_describe(a)} and half {_describe(b)}, and no earlier batch says "
                        "which is the odd one (a batch of 2, or the first batch): fix the "
                        "odd samples, use a batch_size of 3 or more, or use_list=True "
                        "(batch: {use_list: true}) if the data is ragged")
    seen = ", ".join(_describe(k) for k, _ in Counter(kinds).most_common(3))
    raise DataError(f"BatchData: cannot stack {what}: its {n} values agree on no shape "
                    f"(e.g. {seen}); use use_list=True (batch: {{use_list: true}}) for ragged "
                    "data, or a map step that gives every sample one shape")


def _describe(kind: Kind) -> str:
    if kind[0] == "array":
        return f"{_a(np.dtype(kind[1]).name)} array of shape {kind[2]}"
    if kind[0] == "keys":
        return f"the keys {sorted(map(str, kind[1]))}"
    if kind[0] == "length":
        return f"{kind[1]} components"
    if kind[0] == "whole":
        return _a(str(kind[1]))
    if kind[0] == "NoneType":
        return "None (a missing value)"
    if kind[0] == "list":
        return f"a list of {kind[1]} values"
    return _a(kind[0])


def _a(word: str) -> str:
    return f"an {word}" if word[:1] in ("a", "e", "i", "o") else f"a {word}"  # a uint8


def sample_name(dp: Any, otherwise: str) -> str:
    """How a message names datapoint ``dp``: where it was read, else ``otherwise``."""
    where = name_of(dp)
    return f"sample {where}" if where else otherwise


def _named(dp: Any, index: int) -> str:
    return sample_name(dp, f"datapoint {index} of the pass (unnamed)")


def _stack(items: list[Any], use_list: bool, which: Any) -> Any:
    if use_list:
        return items
    first = items[0]
    try:
        if isinstance(first, np.ndarray):
            return np.stack(items)
        if isinstance(first, (bool, np.bool_)):
            return np.asarray(items, dtype=bool)
        if isinstance(first, (int, np.integer)):
            return np.asarray(items, dtype=np.int32 if -2**31 <= min(items) and
                              max(items) < 2**31 else np.int64)
        if isinstance(first, (float, np.floating)):
            return np.asarray(items, dtype=np.float32)
        return np.asarray(items)
    except (ValueError, TypeError, OverflowError) as e:
        raise DataError(f"BatchData: cannot stack component {which!r} ({e}); "
                        "use use_list=True for ragged data") from None
