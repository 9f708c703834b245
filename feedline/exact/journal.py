"""An exact stream's journal: its progress in a file, fsync'd, read back after a restart.

One record per line, ``CRC32 (8 hex digits) + " " + compact JSON``: a record is believed only
if its checksum holds. Reading back (:meth:`Journal.read`):

- a last line that is cut short or fails its checksum is a write the broker died in the middle
  of: it is left out with a warning (what the consumers report when they register again
  covers it), and what was fsync'd before it stands;
- any other line that fails is a corrupt journal: :class:`JournalCorrupt`, one line naming
  the file and what to do, and the stream is refused until someone decides.

Writing (:meth:`Journal.commit`, :meth:`Journal.rewrite`) never raises. A write that fails
(the disk is full, the directory went away) leaves :attr:`Journal.error` saying why and renames
the file to ``NAME.stale``: what is on disk no longer holds the stream's progress, and a broker
that starts with only a stale journal refuses the stream (one line saying what to do) instead
of serving again what was already taken. The owner writes the whole state again later
(:meth:`Journal.rewrite`); once that works the journal is whole again and the stale file goes.

Records (:data:`Record`): a frozen dataclass per kind, each written as a JSON object of one
key (its ``encode()``) and read back by :func:`decode`. The coordinator's whole state (a
rewrite) is :class:`Planned`, :class:`EpochBegun`, :class:`RunEnds`, :class:`RunFinished` once
the run is served, :class:`UnitDone` for each unit done, and :class:`Settled` and
:class:`UnitTotal` for each unit begun (on a host of a job, :class:`HostLaunch` after the
plan); appended after it: the batches settled since, a unit's
total, a unit done. A line whose checksum holds but whose object is of no kind here, or not
as its kind writes it, is read as a line that fails its checksum.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from feedline.errors import FeedlineError
from feedline.exact.cursor import from_runs, runs
from feedline.exact.plan import ExactPlan

log = logging.getLogger(__name__)


class JournalCorrupt(FeedlineError):
    """A journal line that is not the last fails its checksum, does not parse or is no
    record (:func:`decode`)."""


class JournalStale(FeedlineError):
    """Only a stale journal is there: writes to it failed, it lacks the latest progress."""


# -- records --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    """``{"plan": [dataset_size, unit_size, epochs, fingerprint]}``: the stream's plan, the
    first record (a journal written before plans had runs or fingerprints holds the first two
    or three)."""

    key: ClassVar[str] = "plan"
    plan: ExactPlan

    def encode(self) -> dict[str, Any]:
        p = self.plan
        return {self.key: [p.dataset_size, p.unit_size, p.epochs, p.fingerprint]}

    @staticmethod
    def _of(value: Any) -> Planned:
        if not isinstance(value, list) or not 2 <= len(value) <= 4:
            raise JournalCorrupt("not 2 to 4 numbers")
        plan = ExactPlan(*(_count(x) for x in value))
        if plan.dataset_size < 1 or plan.unit_size < 1:
            raise JournalCorrupt("no samples, or units of none")
        return Planned(plan)


@dataclass(frozen=True)
class EpochBegun:
    """``{"epoch": n}``: epoch ``n`` is served; the units of the records before it are void."""

    key: ClassVar[str] = "epoch"
    epoch: int

    def encode(self) -> dict[str, Any]:
        return {self.key: self.epoch}

    @staticmethod
    def _of(value: Any) -> EpochBegun:
        return EpochBegun(_count(value))


@dataclass(frozen=True)
class RunEnds:
    """``{"end": n}``: the run being served ends before epoch ``n`` (0: never)."""

    key: ClassVar[str] = "end"
    end: int

    def encode(self) -> dict[str, Any]:
        return {self.key: self.end}

    @staticmethod
    def _of(value: Any) -> RunEnds:
        return RunEnds(_count(value))


@dataclass(frozen=True)
class RunFinished:
    """``{"finished": true}``: every epoch of the run was served."""

    key: ClassVar[str] = "finished"

    def encode(self) -> dict[str, Any]:
        return {self.key: True}

    @staticmethod
    def _of(value: Any) -> RunFinished:
        if value is not True:
            raise JournalCorrupt("not true")
        return RunFinished()


@dataclass(frozen=True)
class UnitDone:
    """``{"done": [unit, batches]}``: every batch of ``unit`` (``total`` of them) of the epoch
    was taken."""

    key: ClassVar[str] = "done"
    unit: int
    total: int

    def encode(self) -> dict[str, Any]:
        return {self.key: [self.unit, self.total]}

    @staticmethod
    def _of(value: Any) -> UnitDone:
        return UnitDone(*_pair(value))


@dataclass(frozen=True)
class Settled:
    """``{"settled": [unit, [[start, length], ...]]}``: those batches of ``unit`` were taken
    (``batches``: their bitmask; a journal written before runs lists their indices)."""

    key: ClassVar[str] = "settled"
    unit: int
    batches: int

    def encode(self) -> dict[str, Any]:
        return {self.key: [self.unit, [[s, n] for s, n in runs(self.batches)]]}

    @staticmethod
    def _of(value: Any) -> Settled:
        if not isinstance(value, list) or len(value) != 2 or not isinstance(value[1], list):
            raise JournalCorrupt("not a unit and its batches")
        u, idx = value
        if idx and not isinstance(idx[0], list):  # indices, as journals before runs hold
            return Settled(_count(u), from_runs([_count(i), 1] for i in idx))
        return Settled(_count(u), from_runs(_pair(r) for r in idx))


@dataclass(frozen=True)
class UnitTotal:
    """``{"total": [unit, batches]}``: ``unit``'s producer sent all of it, ``total`` batches."""

    key: ClassVar[str] = "total"
    unit: int
    total: int

    def encode(self) -> dict[str, Any]:
        return {self.key: [self.unit, self.total]}

    @staticmethod
    def _of(value: Any) -> UnitTotal:
        return UnitTotal(*_pair(value))


@dataclass(frozen=True)
class HostLaunch:
    """``{"launch": [job, launch]}``: a host of a job served by several hosts
    (feedline.exact.scope): the records after it are of that job's launch. A host restarted on
    its journal knows from it whether what it holds is of the launch the job is at now (a
    journal without it, written before hosts kept it: not known)."""

    key: ClassVar[str] = "launch"
    job: int
    launch: int

    def encode(self) -> dict[str, Any]:
        return {self.key: [self.job, self.launch]}

    @staticmethod
    def _of(value: Any) -> HostLaunch:
        return HostLaunch(*_pair(value))


# -- a job coordinator's records (feedline.exact.job): its journal holds only these and Planned
@dataclass(frozen=True)
class JobBegun:
    """``{"job": [job, launch, epoch, finished, boot, resumed]}``: the job's id, its launch,
    the epoch served (and whether the run is), the coordinator's restarts, and the ident (hex)
    of the cursor the launch began with; the units of the records before it are void."""

    key: ClassVar[str] = "job"
    job: int
    launch: int
    epoch: int
    finished: bool
    boot: int
    resumed: str

    def encode(self) -> dict[str, Any]:
        return {self.key: [self.job, self.launch, self.epoch, int(self.finished), self.boot,
                           self.resumed]}

    @staticmethod
    def _of(value: Any) -> JobBegun:
        if not isinstance(value, list) or len(value) != 6 or not isinstance(value[5], str):
            raise JournalCorrupt("not a job's six fields")
        bytes.fromhex(value[5])
        return JobBegun(_count(value[0]), _count(value[1]), _count(value[2]),
                        bool(_count(value[3])), _count(value[4]), value[5])


@dataclass(frozen=True)
class JobUnit:
    """``{"junit": [unit, state, host, generation, [[start, length], ...], batches]}``: a unit
    of the job's epoch as it is now (free, open at ``host``, or done), what was taken of it and
    its batch count (None: not known)."""

    key: ClassVar[str] = "junit"
    unit: int
    state: str
    host: str | None
    gen: int
    taken: int
    batches: int | None

    def encode(self) -> dict[str, Any]:
        return {self.key: [self.unit, self.state, self.host, self.gen,
                           [[s, n] for s, n in runs(self.taken)], self.batches]}

    @staticmethod
    def _of(value: Any) -> JobUnit:
        if not isinstance(value, list) or len(value) != 6 or value[1] not in (
                "free", "open", "done") or not (value[2] is None or isinstance(value[2], str)) \
                or not isinstance(value[4], list):
            raise JournalCorrupt("not a unit's six fields")
        return JobUnit(_count(value[0]), value[1], value[2], _count(value[3]),
                       from_runs(_pair(r) for r in value[4]),
                       None if value[5] is None else _count(value[5]))


Record = (Planned | EpochBegun | RunEnds | RunFinished | UnitDone | Settled | UnitTotal
          | HostLaunch | JobBegun | JobUnit)
_KINDS: dict[str, Callable[[Any], Record]] = {
    k.key: k._of for k in (Planned, EpochBegun, RunEnds, RunFinished, UnitDone, Settled,
                           UnitTotal, HostLaunch, JobBegun, JobUnit)}


def decode(raw: Any) -> Record:
    """The record of a line's JSON object (what :meth:`encode` gave); :class:`JournalCorrupt`
    if it is of no kind above, or not as that kind writes it."""
    if not isinstance(raw, dict) or len(raw) != 1:
        raise JournalCorrupt("a journal record is a JSON object of one key")
    (key, value), = raw.items()
    kind = _KINDS.get(key)
    if kind is None:
        raise JournalCorrupt(f"no journal record is of the kind {key[:40]!r}")
    try:
        return kind(value)
    except (TypeError, ValueError, JournalCorrupt) as e:
        raise JournalCorrupt(f"a journal record {key!r} is malformed: {e}") from None


def _count(x: Any) -> int:
    if type(x) is not int or not 0 <= x < 1 << 63:  # what a cursor and the wire can carry
        raise JournalCorrupt("not a count")
    return x


def _pair(x: Any) -> tuple[int, int]:
    if not isinstance(x, list) or len(x) != 2:
        raise JournalCorrupt("not two numbers")
    return _count(x[0]), _count(x[1])


# -- lines ----------------------------------------------------------------------------------
def _line(record: Record) -> bytes:
    body = json.dumps(record.encode(), separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> Record | None:
    """The record of one line, or None if it fails its checksum, does not parse or is no
    record (:func:`decode`)."""
    try:
        if line.startswith(b"{"):  # written before records had checksums
            raw = json.loads(line)
        else:
            crc, body = line.split(b" ", 1)
            if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
                return None
            raw = json.loads(body)
        return decode(raw)
    except (ValueError, UnicodeDecodeError, JournalCorrupt):
        return None


class Journal:
    """The file ``path`` (``NAME.exact.jsonl`` in the broker's ``--state-dir``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stale_path = path.with_name(path.name + ".stale")
        self.error: str | None = None  # why the last write failed; None: the file is whole
        self._pending: list[Record] = []

    def exists(self) -> bool:
        return self.path.exists() or self.stale_path.exists()

    def read(self, stream: str) -> list[Record]:
        """The records, in order (none if there is no file); raises :class:`JournalCorrupt`
        or :class:`JournalStale` with a one-line message naming the file and what to do."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            if self.stale_path.exists():
                raise JournalStale(
                    f"stream {stream!r}: its journal {self.stale_path} stopped being written "
                    "(a write failed: see the broker's log) and lacks its latest progress: "
                    f"delete it to serve the stream from epoch 0, or rename it to "
                    f"{self.path.name} to go on from it (batches taken after it stopped are "
                    "served again)") from None
            return []
        except OSError as e:
            raise JournalCorrupt(f"stream {stream!r}: cannot read its journal {self.path}: "
                                 f"{e.strerror}") from None
        lines = data.split(b"\n")
        tail = lines.pop()  # after the last newline: b"" unless the last write was cut short
        keep = len(data) - len(tail)  # bytes up to the end of the last whole line
        out: list[Record] = []
        for n, line in enumerate(lines, start=1):
            rec = _parse(line)
            if rec is not None:
                out.append(rec)
            elif n == len(lines) and not tail:
                tail, keep = line, keep - len(line) - 1  # the last line: cut short, as below
            else:
                raise JournalCorrupt(
                    f"stream {stream!r}: its journal {self.path} is corrupt at line {n}: "
                    "delete the file to serve the stream from epoch 0 (or put back a copy), "
                    "then start the broker again")
        if tail:
            log.warning("stream %s: the last record of %s was cut short (the broker stopped "
                        "while writing it): left out; what consumers report covers it",
                        stream, self.path)
            try:  # so that the next record starts a line of its own
                os.truncate(self.path, keep)
            except OSError:
                pass
        return out

    def add(self, record: Record) -> None:
        self._pending.append(record)

    def commit(self) -> bool:
        """Append what was added, fsync'd. False if that failed (:attr:`error`)."""
        if not self._pending or self.error is not None:
            self._pending.clear()  # a failed journal is written whole again, not appended
            return self.error is None
        try:
            with open(self.path, "ab") as f:
                f.write(b"".join(_line(r) for r in self._pending))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            self._fail(e)
            return False
        finally:
            self._pending.clear()
        return True

    def rewrite(self, records: list[Record], *, state_change: bool = True) -> bool:
        """Replace the file with ``records`` (write a temporary file, fsync, rename). False if
        that failed. ``state_change`` False: the records say what the file says already (a
        compaction), so a failure leaves a file that is still whole."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(b"".join(_line(r) for r in records))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            _remove(tmp)
            if state_change or self.error is not None:
                self._fail(e)
            else:
                log.warning("could not compact the journal %s (%s): it stays as it is",
                            self.path, e.strerror)
            self._pending.clear()
            return False
        self._pending.clear()
        if self.error is not None:
            log.warning("the journal %s is written again: the stream's progress survives a "
                        "restart again", self.path)
            self.error = None
        _remove(self.stale_path)
        return True

    def remove(self) -> None:
        """Delete the journal (a stream reclaimed with no progress to keep)."""
        _remove(self.path)
        _remove(self.stale_path)

    def _fail(self, e: OSError) -> None:
        first = self.error is None
        self.error = f"cannot write {self.path}: {e.strerror or e}"
        if not first:
            return
        try:
            if self.path.exists():
                os.replace(self.path, self.stale_path)
            else:  # never written: the mark alone (an empty file needs no data block)
                self.stale_path.touch()
        except OSError:
            pass  # that failed too: a restart reads a journal behind the truth, or none


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
