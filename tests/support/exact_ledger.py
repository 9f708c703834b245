"""Exact delivery's ledger: the pipeline the fault harness runs, what a clean run yields, and
the audit of what the consumers took.

The dataset is sample ids ``0..n-1`` (a ``list`` source); one map step,
:func:`paced_sample`, turns an id into ``[payload, meta [id, crc32]]`` exactly as
:class:`tests.support.ledger_data.ExactSample` does (payload XOR an "augmentation" drawn from the
sample's own generator, a pure function of (seed, epoch, sample)), paced at ``rate`` samples
per second per producer against a schedule, so that the offered load is known and faults land
in the middle of units. Pacing changes no byte: :func:`clean_run` builds the same pipeline
unpaced, in-process, with :func:`feedline.producer.exact.build_exact`.

Consumers (:mod:`tests.support.exact_ledger_consumer`) log each batch as :func:`format_entry` writes
it; :func:`audit` checks, per epoch, that the union of the ledgers is the dataset exactly once
and that every sample's digest equals the clean run's.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.fault_cluster import Entry
from tests.support.ledger_data import ExactSample

STREAM = "val"


class PacedSample(ExactSample):
    """:class:`ExactSample` at most ``rate`` samples/s (paced against a schedule: time spent
    waiting for a unit or for credit is not made up later in a burst); the same bytes."""

    def __init__(self, nbytes: int = 4096, seed: int = 0, rate: float = 0.0) -> None:
        super().__init__(nbytes, seed)
        self.rate = rate
        self._due = 0.0

    def __call__(self, i: object) -> list:
        if self.rate:
            self._due = max(self._due + 1 / self.rate, time.monotonic())
            time.sleep(max(0.0, self._due - time.monotonic()))
        return self.sample(int(i))  # type: ignore[call-overload]


def paced_sample(nbytes: int = 4096, seed: int = 0, rate: float = 0.0) -> PacedSample:
    return PacedSample(nbytes, seed, rate)


def exact_config(n: int, unit_size: int, batch_size: int, epochs: int, *, nbytes: int = 4096,
                 rate: float = 0.0, seed: int = 3, stream: str = STREAM) -> dict[str, Any]:
    """The pipeline map every producer of the harness runs (``delivery: exact``)."""
    return {"stream": stream, "delivery": "exact", "exact": {"unit_size": unit_size},
            "seed": seed, "epochs": epochs, "source": {"list": {"items": list(range(n))}},
            "steps": [{"map": {"function": "tests.support.exact_ledger:paced_sample",
                               "args": {"nbytes": nbytes, "rate": rate}, "component": None}},
                      {"batch": {"batch_size": batch_size}}]}


def digest(data: np.ndarray) -> str:
    """A sample's content hash (its payload bytes)."""
    return hashlib.blake2b(data.tobytes(), digest_size=12).hexdigest()


def clean_run(cfg: dict[str, Any]) -> dict[int, dict[int, str]]:
    """What a run without faults yields: epoch -> sample id -> digest (computed in-process,
    unpaced)."""
    from feedline.producer.exact import build_exact

    steps = [dict(s) for s in cfg["steps"]]
    steps[0] = {"map": {**steps[0]["map"], "args": {**steps[0]["map"]["args"], "rate": 0.0}}}
    pipe = build_exact({**cfg, "steps": steps})
    out: dict[int, dict[int, str]] = {}
    for epoch in range(int(cfg["epochs"])):
        got = out[epoch] = {}
        for unit in range(-(-pipe.source.samples() // pipe.unit_size)):
            for _, batch in pipe.batches(epoch, unit):
                assert batch is not None
                data, meta = batch
                got.update({int(meta[k][0]): digest(data[k]) for k in range(len(meta))})
    return out


# -------------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class ExactEntry(Entry):
    """One batch a consumer took: :class:`Entry` (``index``: the batch's place in its unit)
    plus its epoch, unit and samples (id, digest)."""

    epoch: int = 0
    unit: int = 0
    samples: tuple[tuple[int, str], ...] = ()

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.epoch, self.unit, self.index)


def format_entry(t: float, b: Any, samples: list[tuple[int, str]], ok: bool) -> str:
    """A ledger line for batch ``b`` (a :class:`feedline.protocol.wire.Batch`)."""
    ids = ",".join(f"{i}:{h}" for i, h in samples)
    return (f"{t:.6f} {b.producer} {b.session} {b.seq} {b.epoch} {b.unit} {b.index} "
            f"{int(ok)} {ids}\n")


@dataclass
class ExactLedger:
    entries: list[ExactEntry] = field(default_factory=list)
    ends: list[tuple[float, list[int]]] = field(default_factory=list)  # each epoch() that ended
    ckpt: int | None = None  # entries before its last checkpoint ("#ckpt"), if it saved one


def read_exact_ledger(path: Path, tail: int | None = None) -> ExactLedger:
    """A consumer's ledger (``tail``: only its last that many bytes); a line cut by kill -9 is
    not a batch taken."""
    if not path.exists():
        return ExactLedger()
    if tail is None:
        return parse_ledger(path.read_text())
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - tail))
        text = f.read().decode(errors="replace")
    return parse_ledger(text if size <= tail else text.split("\n", 1)[-1])


def parse_ledger(text: str) -> ExactLedger:
    led = ExactLedger()
    for line in text.splitlines():
        if line.startswith("#ckpt "):
            led.ckpt = len(led.entries)
            continue
        if line.startswith("#end "):
            _, when, epochs = (line + " ").split(" ", 2)
            led.ends.append((float(when), [int(x) for x in epochs.split(",") if x.strip()]))
            continue
        parts = line.split(" ")
        if len(parts) != 9 or not parts[8]:
            continue
        try:
            t, p, s, q, ep, u, i, ok = (float(parts[0]), parts[1], *map(int, parts[2:8]))
            samples = tuple((int(a), h) for a, h in (x.split(":") for x in parts[8].split(",")))
        except ValueError:
            continue
        if any(len(h) != 24 for _, h in samples):
            continue
        led.entries.append(ExactEntry(t, p, s, q, i, ok == 1, ep, u, samples))
    return led


@dataclass
class EpochVerdict:
    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    foreign: list[int] = field(default_factory=list)
    mismatched: list[int] = field(default_factory=list)  # bytes differ from the clean run

    def clean(self) -> bool:
        return not (self.lost or self.duplicated or self.foreign or self.mismatched)


@dataclass
class ExactAudit:
    epochs: dict[int, EpochVerdict] = field(default_factory=dict)
    corrupt: int = 0  # batches whose payload did not match its crc
    taken: int = 0  # samples counted
    # The killed consumers' last batches: served again to another consumer (not counted for
    # the dead one), or confirmed (its TAKEN arrived: counted for it).
    served_again: list[tuple[int, int, int]] = field(default_factory=list)
    confirmed_last: list[tuple[int, int, int]] = field(default_factory=list)

    def clean(self) -> bool:
        return not self.corrupt and all(v.clean() for v in self.epochs.values())

    def summary(self) -> dict[str, int]:
        return {k: sum(len(getattr(v, k)) for v in self.epochs.values())
                for k in ("lost", "duplicated", "foreign", "mismatched")}


def audit(ledgers: dict[str, list[ExactEntry]], expected: dict[int, dict[int, str]],
          killed: frozenset[str] = frozenset(),
          crashed: dict[str, int] | None = None) -> ExactAudit:
    """Per epoch, the union of what the consumers took against the dataset and the clean run.

    The killed-consumer rule: a consumer's last batch before a kill -9 is unconfirmed until
    its TAKEN reaches the broker. If it never did, the broker serves that batch again to
    another consumer, and it is not counted for the dead one; if it did, nobody else gets it
    and it counts. Only the *last* batch of a killed consumer gets this allowance: any other
    batch found in two ledgers is a duplicate.

    ``crashed``: a job's process that crashed after a checkpoint (name -> the entries before
    it): what it took after the checkpoint is not the job's (the job resumed from the
    checkpoint), so only those entries count."""
    a = ExactAudit()
    samples: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for name, entries in ledgers.items():
        use = entries[:crashed[name]] if crashed and name in crashed else entries
        if name in killed and use:
            last = use[-1].key
            elsewhere = {e.key for n, es in ledgers.items() if n != name for e in es}
            if last in elsewhere:
                use = use[:-1]
                a.served_again.append(last)
            else:
                a.confirmed_last.append(last)
        for e in use:
            a.corrupt += not e.ok
            samples[e.epoch].extend(e.samples)
    for epoch in sorted(set(expected) | set(samples)):
        v = a.epochs[epoch] = EpochVerdict()
        want = expected.get(epoch, {})
        got = samples.get(epoch, [])
        a.taken += len(got)
        counts = Counter(i for i, _ in got)
        v.lost = sorted(set(want) - set(counts))
        v.duplicated = sorted(i for i, c in counts.items() if c > 1 and i in want)
        v.foreign = sorted(i for i in counts if i not in want)
        v.mismatched = sorted({i for i, h in got if i in want and want[i] != h})
    return a


__all__ = ["STREAM", "EpochVerdict", "ExactAudit", "ExactEntry", "ExactLedger", "PacedSample",
           "audit", "clean_run", "digest", "exact_config", "format_entry", "paced_sample",
           "parse_ledger", "read_exact_ledger"]
