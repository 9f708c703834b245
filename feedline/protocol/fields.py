"""The checks of control-message fields: what a received value must be to be taken.

Each check takes the received value and the receiver's :class:`feedline.protocol.codec.Limits` and
gives the value back, or raises :class:`BadField`; :mod:`feedline.protocol.messages` names the field
in the :class:`feedline.protocol.codec.DecodeError` it turns that into. A message class declares a
field's wire key and check together (``field(metadata=wire_key(...))``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from feedline.errors import FeedlineError
from feedline.protocol.codec import Limits

U63 = (1 << 63) - 1
STREAM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
REASON_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class BadField(FeedlineError):
    """A field's value does not fit; the decoder turns it into a DecodeError."""


Check = Callable[[Any, Limits], Any]


def integer(lo: int, hi: int | Callable[[Limits], int]) -> Check:
    if callable(hi):
        top = hi

        def check_limit(v: Any, lim: Limits) -> int:
            if type(v) is not int or not lo <= v <= top(lim):  # a bool is no count
                raise BadField
            return v
        return check_limit

    def check(v: Any, lim: Limits) -> int:
        if type(v) is not int or not lo <= v <= hi:  # type(): a bool is no count
            raise BadField
        return v
    return check


def text_of(limit: Callable[[Limits], int], min_len: int = 0,
          pattern: re.Pattern[str] | None = None) -> Check:
    def check(v: Any, lim: Limits) -> str:
        if not isinstance(v, str) or not min_len <= len(v) <= limit(lim):
            raise BadField
        if pattern is not None and not pattern.match(v):
            raise BadField
        return v
    return check


count = integer(0, U63)  # sessions, sequence numbers, totals, byte counts
ident = text_of(lambda lim: lim.max_id_len, 1)
fleet_id = text_of(lambda lim: lim.max_id_len)  # empty: not started by a supervisor
stream = text_of(lambda lim: lim.max_stream_len, 1, STREAM_NAME)
text = text_of(lambda lim: lim.max_text_len)
traceback_text = text_of(lambda lim: lim.max_traceback_len)
reason = text_of(lambda lim: 64, 1, REASON_NAME)
window = integer(1, lambda lim: lim.max_window)
TRAINING, EXACT = "training", "exact"


def delivery_mode(v: Any, lim: Limits) -> str:
    if v not in (TRAINING, EXACT):
        raise BadField
    return str(v)


def flag(v: Any, lim: Limits) -> bool:
    if not isinstance(v, bool):
        raise BadField
    return v


def index_list(v: Any, lim: Limits) -> list[int]:
    if not isinstance(v, list) or len(v) > lim.max_container_len or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= U63 for i in v):
        raise BadField
    return v


def blob(v: Any, lim: Limits) -> bytes:
    if not isinstance(v, bytes) or len(v) > lim.max_header_bytes:
        raise BadField
    return v


def wire_key(key: str, check: Check) -> dict[str, Any]:
    """Field metadata: the field's key in the message map and the check of received values."""
    return {"key": key, "check": check}
