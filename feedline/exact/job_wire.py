"""The job coordinator's messages on the wire: one msgpack map per frame.

``{"v": JOB_WIRE_VERSION, "s": stream, "k": kind, ...}`` whose other keys are the fields of
one of :mod:`feedline.exact.job`'s message classes (host -> coordinator), of its
:class:`~feedline.exact.job.View` (coordinator -> host), or a refusal (``"refused"``: a
reason and a line saying what to do, a :class:`~feedline.exact.job.JobRefused`). A unit's
bitmask of taken batches is bytes (a unit may have more batches than an int on the wire has
bits); a plan is its four numbers, a cursor its own encoding
(:meth:`~feedline.exact.cursor.Cursor.encode`).

Everything received is checked before it is used: a frame that is not such a map, of another
version, with a field missing, of the wrong type or out of its bounds raises
:class:`~feedline.errors.DecodeError` (reason ``bad_job_<kind>``, a metric label) and is
counted and dropped by the daemon; nothing received is ever executed or unpickled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

from feedline.errors import DecodeError, FeedlineError
from feedline.exact.cursor import MAX_CURSOR_BYTES, MAX_UNITS, Cursor
from feedline.exact.job import (
    MAX_OPEN,
    Ask,
    Back,
    Beat,
    Done,
    JobRefused,
    Join,
    Leave,
    Message,
    Resume,
    View,
)
from feedline.exact.plan import ExactPlan, NoUnit
from feedline.protocol.codec import packb, unpackb

JOB_WIRE_VERSION = 1
MAX_FRAME = 1 << 20  # a Join's done list of MAX_UNITS units fits with room
MAX_MASK_BYTES = 1 << 13  # a unit's taken bitmask: 65,536 batches
U63 = (1 << 63) - 1

KINDS: dict[str, type] = {"join": Join, "ask": Ask, "done": Done, "back": Back,
                          "resume": Resume, "beat": Beat, "leave": Leave, "view": View}
_NAMES = {cls: name for name, cls in KINDS.items()}


class _Bad(FeedlineError):
    """A field's value does not fit (turned into a DecodeError naming the field)."""


# -- field checks: the received value -> the value, or _Bad ---------------------------------
def _count(v: Any) -> int:
    if type(v) is not int or not 0 <= v <= U63:  # type(): a bool is no count
        raise _Bad
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str) or not 1 <= len(v) <= 256:
        raise _Bad
    return v


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad
    return v


def _mask(v: Any) -> int:
    if not isinstance(v, bytes) or len(v) > MAX_MASK_BYTES:
        raise _Bad
    return int.from_bytes(v, "little")


def _unit(v: Any) -> int:
    u = _count(v)
    if u >= MAX_UNITS:
        raise _Bad
    return u


def _open_unit(v: Any) -> tuple[int, int, int]:
    if not isinstance(v, list) or len(v) != 3:
        raise _Bad
    return _unit(v[0]), _count(v[1]), _mask(v[2])


def _open_list(v: Any) -> tuple[tuple[int, int, int], ...]:
    if not isinstance(v, list) or len(v) > MAX_OPEN:
        raise _Bad
    return tuple(_open_unit(x) for x in v)


def _done_list(v: Any) -> tuple[tuple[int, int, int], ...]:
    if not isinstance(v, list) or len(v) > MAX_UNITS:
        raise _Bad
    out = []
    for x in v:
        if not isinstance(x, list) or len(x) != 3:
            raise _Bad
        out.append((_unit(x[0]), _count(x[1]), _count(x[2])))
    return tuple(out)


def _plan(v: Any) -> ExactPlan:
    if not isinstance(v, list) or len(v) != 4:
        raise _Bad
    plan = ExactPlan(*(_count(x) for x in v))
    if plan.dataset_size < 1 or plan.unit_size < 1 or plan.units > MAX_UNITS:
        raise _Bad
    return plan


def _cursor(v: Any) -> Cursor:
    if not isinstance(v, bytes) or len(v) > MAX_CURSOR_BYTES:
        raise _Bad
    try:
        return Cursor.decode(v)
    except (DecodeError, ValueError):
        raise _Bad from None


def _maybe(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


def _wait(v: Any) -> NoUnit:
    try:
        return NoUnit(v)
    except ValueError:
        raise _Bad from None


def _version(v: Any) -> tuple[int, int]:
    if not isinstance(v, list) or len(v) != 2:
        raise _Bad
    return _count(v[0]), _count(v[1])


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "host": _text, "session": _count, "seq": _count, "job": _count, "launch": _count,
    "epoch": _count, "unit": _unit, "gen": _count, "batches": _count, "taken": _mask,
    "readers": _count, "alive": _count, "plan": _plan, "cursor": _cursor, "open": _open_list,
    "done": _done_list, "finished": _flag, "opened": _maybe(_open_unit),
    "wait": _maybe(_wait), "probe": _flag, "resumed": _count, "version": _version,
}


# -- encoding -------------------------------------------------------------------------------
def _bits(b: int) -> bytes:
    return b.to_bytes((b.bit_length() + 7) // 8, "little")


def _out(name: str, v: Any) -> Any:
    if name == "taken":
        return _bits(v)
    if name in ("open", "opened"):
        if v is None:
            return None
        if name == "opened":
            return [v[0], v[1], _bits(v[2])]
        return [[u, g, _bits(t)] for u, g, t in v]
    if name == "done":
        return [list(x) for x in v]
    if name == "plan":
        return [v.dataset_size, v.unit_size, v.epochs, v.fingerprint]
    if name == "cursor":
        return v.encode()
    if name == "wait":
        return None if v is None else v.value
    if name == "version":
        return list(v)
    return v


def encode(stream: str, msg: Message | View) -> bytes:
    """The frame of ``msg`` about ``stream``."""
    out: dict[str, Any] = {"v": JOB_WIRE_VERSION, "s": stream, "k": _NAMES[type(msg)]}
    for f in fields(msg):  # type: ignore[arg-type]
        out[f.name] = _out(f.name, getattr(msg, f.name))
    return packb(out)


def encode_refusal(stream: str, refused: JobRefused) -> bytes:
    return packb({"v": JOB_WIRE_VERSION, "s": stream, "k": "refused",
                  "reason": refused.reason, "text": refused.text})


def decode(frame: bytes) -> tuple[str, Message | View | JobRefused]:
    """(stream, the message) of a received frame; :class:`DecodeError` for anything else."""
    if not isinstance(frame, bytes) or len(frame) > MAX_FRAME:
        raise DecodeError("bad_job_frame", "not a job frame, or larger than 1 MiB")
    try:
        d = unpackb(frame, raw=False, strict_map_key=True,
                    max_array_len=MAX_UNITS, max_map_len=64, max_str_len=4096,
                    max_bin_len=MAX_CURSOR_BYTES)
    except Exception:  # msgpack's errors: anything it cannot take is not a frame of ours
        raise DecodeError("bad_job_frame", "not msgpack") from None
    if not isinstance(d, dict) or d.get("v") != JOB_WIRE_VERSION:
        raise DecodeError("bad_job_version", f"not a job frame of version {JOB_WIRE_VERSION}")
    kind, stream = d.get("k"), d.get("s")
    if not isinstance(stream, str) or not 1 <= len(stream) <= 64:
        raise DecodeError("bad_job_frame", "no stream")
    if kind == "refused":
        reason, text = d.get("reason"), d.get("text")
        if not isinstance(reason, str) or not isinstance(text, str) or len(reason) > 64:
            raise DecodeError("bad_job_refused", "reason and text")
        return stream, JobRefused(reason, text[:4096])
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise DecodeError("bad_job_kind", f"{str(kind)[:32]!r} is no job message")
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in d:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue  # the class's default
            raise DecodeError(f"bad_job_{kind}", f"missing field {f.name!r}")
        try:
            values[f.name] = _CHECKS[f.name](d[f.name])
        except _Bad:
            raise DecodeError(f"bad_job_{kind}", f"field {f.name!r}") from None
    try:
        return stream, cls(**values)
    except TypeError:
        raise DecodeError(f"bad_job_{kind}", "missing fields") from None
