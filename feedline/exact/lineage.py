"""Lineage: where each batch a consumer took came from, a ledger of them, and a diff of two.

A batch of an exact stream is named by its place, ``(epoch, unit, index)``, and the pipeline
that made it: its sample ids (the unit's samples in the order ``(seed, epoch, unit)`` gives,
the ``index``-th ``batch_size`` of them) and the seed of every sample's augmentation (a pure
function of ``(seed, epoch, sample)``) follow from the pipeline file, so they are recomputed
(``feedline replay``), never sent. What the place cannot give travels with the batch, two
optional header entries (:func:`feedline.protocol.wire.lineage_fields`): the fingerprint of
the pipeline file and the producer's code version (docs/tensorflow.md, "Which samples were
in step N").

The ledger (``ConsumerOptions(ledger=PATH)``) is one JSON line per batch the model took, in
the order it took them, appended (a resumed run goes on in the same file)::

    {"step": 0, "stream": "val", "epoch": 0, "unit": 3, "index": 1, "producer": "h-12",
     "pipeline": 811..., "file": 402..., "code": "0.1.0+3e36a2020aae"}

Bounds: its writes are buffered (64 KiB), flushed at each epoch's end and at close; a process
killed between two flushes loses at most the lines of that buffer. A line is ~170 bytes.

Diff (:func:`diff`): two ledgers hold the same data when every epoch holds the same batches
(by place) with the same pipeline, file and code fingerprints (the stream's and the
producers' names are not compared: they do not change a byte). Within an epoch the order is
not compared: which producer finishes which unit first, and so the order a consumer takes
them in, differs from run to run (and a resumed run re-takes what its checkpoint did not
hold), while the batches are the same bytes. A batch taken again after a resume (the
ledger's steps counting from 0 again) with the same lineage is one batch (counted, and
said); taken again with another lineage, or twice without a resume between, is a
difference: the model saw other data, or the same batch twice. A ledger with training-mode
batches (no place, no fingerprints) cannot be compared: a DataError that says so.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from feedline.errors import ConfigError, DataError
from feedline.protocol.wire import Batch

log = logging.getLogger(__name__)

BUFFER = 64 * 1024  # bytes a ledger holds before it writes


@dataclass(frozen=True)
class Lineage:
    """Where one batch came from. ``unit`` and ``index`` are -1 for a training-mode batch;
    ``pipeline`` (what decides the sample order: seed, sizes, dataset), ``pipeline_file``
    (the pipeline file's) and ``code`` (the producer's code version) are 0 / "" where its
    producer did not say them (an older producer)."""

    stream: str
    epoch: int
    unit: int
    index: int
    producer: str
    pipeline: int
    pipeline_file: int
    code: str
    step: int = field(default=-1, compare=False)  # its ledger line's (-1: not from one)

    @classmethod
    def of(cls, batch: Batch, stream: str) -> Lineage:
        return cls(stream, batch.epoch, batch.unit, batch.index, batch.producer,
                   batch.pipeline, batch.pipeline_file, batch.code)

    def to_dict(self, step: int = 0) -> dict[str, Any]:
        return {"step": step, "stream": self.stream, "epoch": self.epoch, "unit": self.unit,
                "index": self.index, "producer": self.producer, "pipeline": self.pipeline,
                "file": self.pipeline_file, "code": self.code}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Lineage:
        """A ledger line's lineage; a value of another type (1.7, "1", true, null) is a
        DataError, not coerced into another batch's place."""
        if not isinstance(d, dict):
            raise DataError(f"not a ledger line: a JSON {type(d).__name__}, not an object")
        try:
            ints = [d[k] for k in ("epoch", "unit", "index", "pipeline", "file")]
            strs = [d[k] for k in ("stream", "producer", "code")]
        except KeyError as e:
            raise DataError(f"not a ledger line: it has no {e.args[0]!r}") from None
        step = d.get("step", -1)
        for k, v in zip(("epoch", "unit", "index", "pipeline", "file", "step"),
                        (*ints, step), strict=True):
            if type(v) is not int or v < -1 or (k in ("pipeline", "file", "epoch") and v < 0):
                raise DataError(f"not a ledger line: {k} is {v!r}, not a count")
        for k, v in zip(("stream", "producer", "code"), strs, strict=True):
            if not isinstance(v, str):
                raise DataError(f"not a ledger line: {k} is {v!r}, not a string")
        return cls(strs[0], ints[0], ints[1], ints[2], strs[1], ints[3], ints[4], strs[2],
                   step)

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.epoch, self.unit, self.index)


def check_ledger_path(path: str | Path) -> None:
    """A ledger path a consumer can append lines to, or a ConfigError saying what it is:
    a directory, a FIFO or a device (a FIFO would block the consumer), no such directory."""
    p = Path(path)
    if str(path) == "":
        raise ConfigError("ledger: an empty path; give a file name (run-a.jsonl)")
    if p.exists() and not p.is_file():
        raise ConfigError(f"ledger {p}: not a regular file (a directory, FIFO or device); "
                          "give a file name")
    if not p.parent.is_dir():
        raise ConfigError(f"ledger {p}: its directory {p.parent} does not exist")


class Ledger:
    """One JSON line per batch taken, appended to ``path``; written by the iterating thread,
    closed from any (a lock: a write and a close never interleave)."""

    def __init__(self, path: str | Path, stream: str) -> None:
        self.path = Path(path)
        self._stream = json.dumps(stream)
        check_ledger_path(self.path)
        held = self.path.stat().st_size if self.path.exists() else 0
        torn = False
        if held:
            with open(self.path, "rb") as f:
                f.seek(held - 1)
                torn = f.read(1) != b"\n"
        try:
            self._file: TextIO | None = open(self.path, "a", buffering=BUFFER,  # noqa: SIM115
                                             encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"ledger {self.path}: cannot write it: {e.strerror}") from None
        if torn:  # a killed writer's or a full disk's part line: end it, keep it apart
            self._file.write("\n")
        if held:  # a resumed run continues its file; a new one may have meant a new file
            log.info("ledger %s: appending to its %d bytes (steps count from 0 again; give "
                     "another path to start a new ledger)", self.path, held)
        self._lock = threading.Lock()
        self._quoted: dict[str, str] = {}  # producer ids and code versions, JSON-quoted
        self.step = 0

    def _q(self, s: str) -> str:
        q = self._quoted.get(s)
        if q is None:
            if len(self._quoted) >= 4096:
                self._quoted.clear()
            q = self._quoted[s] = json.dumps(s)
        return q

    def write(self, b: Batch) -> None:
        """The line of ``b`` (about 1.5 us: no json.dumps of a dict)."""
        line = (f'{{"step": {self.step}, "stream": {self._stream}, "epoch": {b.epoch}, '
                f'"unit": {b.unit}, "index": {b.index}, "producer": {self._q(b.producer)}, '
                f'"pipeline": {b.pipeline}, "file": {b.pipeline_file}, '
                f'"code": {self._q(b.code)}}}\n')
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self.step += 1

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            f, self._file = self._file, None
        if f is not None:
            f.close()


# ----------------------------------------------------------------------------------- reading


def read_ledger(path: str | Path) -> Iterator[tuple[int, Lineage]]:
    """``(line number from 1, lineage)`` of each line; a line that is not one (a torn last
    line of a killed process) is a DataError naming it."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            torn = "a torn line is what a killed consumer or a full disk leaves: delete it"
            try:
                d = json.loads(text)
            except (ValueError, RecursionError) as e:  # not JSON, ints of 5000 digits, [[[[...
                raise DataError(f"{path}:{n}: not a ledger line ({e}); {torn}") from None
            try:
                yield n, Lineage.from_dict(d)
            except DataError as e:  # Infinity, 1.7, "1", null
                raise DataError(f"{path}:{n}: {e}; {torn}") from None


def ledger_line(path: str | Path, line: int) -> Lineage:
    first = last = 0
    for n, lin in read_ledger(path):
        if n == line:
            return lin
        first, last = first or n, n
    held = f"its lines are {first}..{last}" if last else "it holds no ledger line"
    raise DataError(f"{path} has no line {line}: {held}")


@dataclass(frozen=True)
class Difference:
    """Where two ledgers first differ: the line in each (0: none there), and why."""

    line_a: int
    line_b: int
    why: str


@dataclass(frozen=True)
class Comparison:
    """What :func:`diff` found: ``first`` None when the ledgers hold the same data;
    ``batches`` the distinct batches compared, ``repeated`` the lines of each that were a
    batch taken again (a resume re-taking what its checkpoint did not hold)."""

    first: Difference | None
    batches: int
    repeated: tuple[int, int]


def _keyed(lines: Iterable[tuple[int, Lineage]]) -> tuple[dict[tuple, tuple[int, Lineage]],
                                                         list[tuple], int,
                                                         tuple[int, str] | None]:
    """Batches by their place (training batches by their order), the places in line order,
    the lines that repeated a batch after a resume (its first line is kept), and the first
    repeat that is a difference within the ledger: ``(line, why)`` of a batch taken again
    with another lineage, or twice in one run (no step 0 between: no resume)."""
    out: dict[tuple, tuple[int, Lineage, int]] = {}
    order: list[tuple] = []
    repeated, training, run, last_step = 0, 0, 0, None
    conflict: tuple[int, str] | None = None
    for n, lin in lines:
        if lin.step >= 0 and last_step is not None and lin.step <= last_step:
            run += 1  # steps counted from 0 again: a resumed run appends here
        last_step = lin.step if lin.step >= 0 else last_step
        if lin.unit < 0:
            key: tuple = ("training", training)
            training += 1
        else:
            key = lin.key
        if key in out:  # taken again: its first line is the one compared
            first_n, first, first_run = out[key]
            repeated += 1
            if conflict is None:
                reason = why(first, lin)
                if reason is not None:
                    conflict = (n, f"{reason}: taken again after line {first_n} with another "
                                "lineage (a resume onto a changed pipeline or code)")
                elif first_run == run and lin.step >= 0:
                    conflict = (n, f"epoch {lin.epoch} unit {lin.unit} batch {lin.index}: "
                                f"taken twice in one run (lines {first_n} and {n}, no resume "
                                "between): the model saw it twice")
            continue
        out[key] = (n, lin, run)
        order.append(key)
    return {k: (n, lin) for k, (n, lin, _) in out.items()}, order, repeated, conflict


def why(a: Lineage, b: Lineage) -> str | None:
    """Why two lineages of one place differ (None: they do not): the pipeline (sample
    order, sizes, dataset), the pipeline file, the code. Not the stream or the producer:
    names, which do not change the bytes."""
    where = f"epoch {a.epoch} unit {a.unit} batch {a.index}" if a.unit >= 0 else \
        f"training batch of epoch {a.epoch}"
    if a.pipeline != b.pipeline:
        return (f"{where}: another sample order or dataset (pipeline fingerprint "
                f"{a.pipeline} vs {b.pipeline}: the seed, unit or batch size, shuffling or "
                "the dataset differ), so other samples")
    if a.pipeline_file != b.pipeline_file:
        return (f"{where}: the same samples from another pipeline file (fingerprint "
                f"{a.pipeline_file} vs {b.pipeline_file}: an augmentation or other step "
                "setting differs), so other bytes")
    if a.code != b.code:
        return f"{where}: the same pipeline run by other code ({a.code} vs {b.code})"
    return None


def diff(a: Iterable[tuple[int, Lineage]], b: Iterable[tuple[int, Lineage]]) -> Comparison:
    """Compare two ledgers' lines (:func:`read_ledger`) as the module docstring says: per
    epoch as sets of places. The first difference is the first line of ``a`` (in its order)
    whose batch ``b`` lacks or has with another lineage, else the first line of ``b`` whose
    batch ``a`` lacks."""
    ka, order_a, rep_a, conflict_a = _keyed(a)
    kb, order_b, rep_b, conflict_b = _keyed(b)
    for keyed, which in ((ka, "first"), (kb, "second")):
        training = [n for k, (n, _) in keyed.items() if k[0] == "training"]
        if training:
            # No place, no fingerprints (the producer's own shuffle): equal lines say nothing
            # of the data, and two such runs would read as identical.
            raise DataError(f"line {min(training)} of the {which} ledger is a training-mode "
                            "batch (no delivery: exact): it has no place or fingerprints, so "
                            "two runs' data cannot be compared by their ledgers")
    if conflict_a is not None:
        return Comparison(Difference(conflict_a[0], 0, conflict_a[1]), len(ka), (rep_a, rep_b))
    if conflict_b is not None:
        return Comparison(Difference(0, conflict_b[0], conflict_b[1]), len(ka), (rep_a, rep_b))
    epochs_b = {k[0] for k in kb if k[0] != "training"}
    for key in order_a:
        na, la = ka[key]
        hit = kb.get(key)
        if hit is None:
            if la.unit < 0:
                return Comparison(Difference(na, 0, "a training batch the other ledger has "
                                             "no counterpart of (it holds fewer)"),
                                  len(ka), (rep_a, rep_b))
            what = "an epoch the other ledger never reached" if la.epoch not in epochs_b \
                else "a batch the other run never took (another sample set: other unit " \
                     "or batch sizes, another dataset, or an unfinished epoch)"
            return Comparison(Difference(na, 0, f"epoch {la.epoch} unit {la.unit} batch "
                                         f"{la.index}: {what}"), len(ka), (rep_a, rep_b))
        nb, lb = hit
        reason = why(la, lb)
        if reason is not None:
            return Comparison(Difference(na, nb, reason), len(ka), (rep_a, rep_b))
    epochs_a = {k[0] for k in ka if k[0] != "training"}
    for key in order_b:
        if key not in ka:
            nb, lb = kb[key]
            what = "an epoch the first ledger never reached" if lb.epoch not in epochs_a \
                else "a batch the first run never took"
            return Comparison(Difference(0, nb, f"epoch {lb.epoch} unit {lb.unit} batch "
                                         f"{lb.index}: {what}"), len(ka), (rep_a, rep_b))
    return Comparison(None, len(ka), (rep_a, rep_b))
