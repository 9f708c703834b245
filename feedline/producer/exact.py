"""Exact delivery, the producer's side: work units made of a pipeline file, byte for byte.

A pipeline file with ``delivery: exact`` is run unit by unit instead of as one endless
stream. The source must be indexable (``image_folder``, ``lmdb``, ``list``, ``fake``: any
source with ``samples()`` and ``sample(i)``). The broker hands out units; a unit
``u`` is the samples ``[u * unit_size, (u + 1) * unit_size)`` of the dataset, in an order that
is a pure function of ``(seed, epoch, unit)``, and each sample's augmentation randomness is a
pure function of ``(seed, epoch, sample)``: a unit run again, by this producer or another,
yields the same bytes, which is how the broker can drop what it already has. Batches never
straddle units: batch ``j`` of a unit holds the ``j``-th ``batch_size`` of its samples (the
last batch of a unit may be short); a unit started at batch ``j`` reads nothing before it.

Map steps run in ``parallel.workers`` threads, whatever ``parallel.mode`` says (each thread
has its own copy of the functions: per-sample reseeding must not be shared; decoding releases
the GIL); ``mode: runner`` is refused (it runs whole pipelines in workers). Samples
an ``on_error: skip`` policy drops leave their batch smaller; a batch with none left is not
sent, and its index is reported with the unit's end so that the epoch still completes.

    stream: val
    delivery: exact
    exact: {unit_size: 1024}
    source: {image_folder: {root: /data/val}}
    steps: [{imagenet_val: {size: 224}}, {batch: {batch_size: 64}}]
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from feedline.errors import DataError
from feedline.producer.dataflow import BatchData
from feedline.producer.dataflow.autotune import cpu_budget
from feedline.producer.dataflow.base import Indexable, UnitSource
from feedline.producer.dataflow.batch_data import odd_samples, sample_name
from feedline.producer.dataflow.map_data import ComponentFunc, apply, reseed
from feedline.producer.dataflow.worker import WorkerInfo, set_worker
from feedline.producer.outbox import ExactSpec
from feedline.producer.pipeline import exact_file_fingerprint
from feedline.producer.pipeline_spec import (
    MAP_STEPS,
    SOURCES,
    Args,
    ConfigError,
    guarded,
    one_key,
)
from feedline.producer.sender import Sender, SendStats
from feedline.protocol import wire
from feedline.protocol.messages import DEFAULT_STREAM
from feedline.version import code_version

log = logging.getLogger(__name__)
DEFAULT_UNIT = 1024
_LOAD = object()  # a sample an Indexable source reads by index, in the worker thread


def sample_key(epoch: int, index: int) -> int:
    """The ``epoch`` argument of a random stage's ``reseed`` for one sample: randomness is a
    pure function of (seed, epoch, sample), whichever worker runs it."""
    return (int(epoch) << 32) | int(index)


@dataclass
class ExactPipeline:
    source: Indexable | UnitSource  # a UnitSource (shards) cuts its own units
    funcs: list[Callable[[Any], Any]]
    batch_size: int
    seed: int = 0
    on_error: str = "raise"
    threads: int = 1
    unit_size: int = DEFAULT_UNIT
    epochs: int = 0
    shuffle: bool = True
    stream: str = DEFAULT_STREAM
    skipped: int = 0  # samples the batch step left out (on_error: skip), over the run
    # The pipeline file's fingerprint (exact_file_fingerprint of the map it was built from:
    # what a batch's lineage names, with the code version; 0: not built from one).
    file_fingerprint: int = 0

    @property
    def spec(self) -> ExactSpec:
        if isinstance(self.source, UnitSource):  # the coordinator counts units: one each
            return ExactSpec(self.source.units(), 1, self.epochs, fingerprint=self.fingerprint)
        return ExactSpec(self.source.samples(), self.unit_size, self.epochs,
                         fingerprint=self.fingerprint)

    @property
    def fingerprint(self) -> int:
        """What decides the sample order and the units, as one number (1 .. 2**63 - 1): the
        seed, the unit and batch sizes, shuffling, and the dataset (its source's kind, length
        and units, and its ``identity()`` where the source has one). Every producer of a
        stream must have the same; a cursor saved under another is refused on resume."""
        identity = getattr(self.source, "identity", None)
        units = self.source.units() if isinstance(self.source, UnitSource) else None
        what = [self.seed, self.unit_size, self.batch_size, self.shuffle,
                self.source.samples(), units, type(self.source).__name__,
                identity() if callable(identity) else None]
        digest = hashlib.blake2b(json.dumps(what).encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "big") >> 1) or 1

    def unit_samples(self, epoch: int, unit: int) -> list[int]:
        """The unit's sample indices in their order for ``epoch``."""
        n = self.source.samples()
        order = list(range(unit * self.unit_size, min((unit + 1) * self.unit_size, n)))
        if self.shuffle:
            np.random.default_rng([self.seed & 0xFFFFFFFF, epoch, unit]).shuffle(order)
        return order

    def batch_samples(self, epoch: int, unit: int, index: int) -> list[int]:
        """The sample ids of the unit's batch ``index`` for ``epoch``, in their order (a
        shard source reads the unit up to that batch to know them); what a batch's lineage
        holds without carrying it (:mod:`feedline.exact.lineage`)."""
        bs = self.batch_size
        if isinstance(self.source, UnitSource):
            ids = []
            for i, _ in self.source.read_unit(epoch, unit, index * bs, self.shuffle):
                ids.append(i)
                if len(ids) == bs:
                    break
            return ids
        return self.unit_samples(epoch, unit)[index * bs:(index + 1) * bs]

    def slots(self, epoch: int, unit: int) -> int:
        n = self.source.unit_length(epoch, unit) if isinstance(self.source, UnitSource) else \
            len(self.unit_samples(epoch, unit))
        return -(-n // self.batch_size)

    def batches(self, epoch: int, unit: int, start: int = 0
                ) -> Iterator[tuple[int, Any | None]]:
        """``(index, batch)`` for the unit's batches from ``start`` on; ``batch`` is None for
        a batch every sample of which was skipped."""
        local = threading.local()
        parts = self._parts(epoch, unit, start)

        def one(item: tuple[int, Any]) -> tuple[Any, bool]:
            funcs = getattr(local, "funcs", None)
            if funcs is None:
                set_worker(WorkerInfo(0, 1))
                funcs = local.funcs = copy.deepcopy(self.funcs)
            i, dp = item
            if dp is _LOAD:
                dp = self.source.sample(i)  # type: ignore[union-attr]
            elif dp is None:  # a corrupt record (counted by the source): a place left empty
                return None, False
            for f in funcs:
                reseed(f, sample_key(epoch, i))
                dp, skipped = apply(f, dp, self.on_error)
                if skipped or dp is None:
                    return None, skipped
            return dp, False

        pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        nxt = start
        try:
            for j, part in enumerate(parts, start):
                # One thread: no pool (a future per sample costs ~30 us).
                done = list(pool.map(one, part)) if pool is not None else [one(i) for i in part]
                kept = [(i, dp) for (i, _), (dp, _) in zip(part, done, strict=True)
                        if dp is not None]
                yield j, self._batch(kept)
                nxt = j + 1
        finally:
            if pool is not None:
                pool.shutdown()
        for k in range(nxt, self.slots(epoch, unit)):  # a shard that ended early: empty
            yield k, None

    def _batch(self, kept: list[tuple[int, Any]]) -> Any | None:
        """The batch of ``kept`` (``(sample id, datapoint)``); a datapoint that does not
        stack with the others (:func:`~feedline.producer.dataflow.batch_data.odd_samples`,
        with no tie-break by an earlier batch: a unit's batches are a function of the unit
        alone) is a DataError naming it, or under ``on_error: skip`` left out and logged;
        None when none is left."""
        dps = [dp for _, dp in kept]
        odd = odd_samples(dps) if len(dps) > 1 else []
        if odd:
            def name(k: int) -> str:
                return sample_name(dps[k], f"sample {kept[k][0]}")

            if self.on_error != "skip":
                k, why = odd[0]
                raise DataError(f"batch: {name(k)} {why}: it does not stack with them; fix "
                                "it, or set on_error: skip to skip such samples")
            for k, why in odd:
                log.warning("skipped a datapoint: %s %s: it does not stack with them",
                            name(k), why)
            self.skipped += len(odd)
            gone = {k for k, _ in odd}
            dps = [dp for k, dp in enumerate(dps) if k not in gone]
        return BatchData.aggregate(dps) if dps else None

    def _parts(self, epoch: int, unit: int, start: int) -> Iterator[list[tuple[int, Any]]]:
        """The unit's batches from ``start`` on, as ``(sample id, datapoint or _LOAD)``."""
        bs = self.batch_size
        if isinstance(self.source, UnitSource):
            part: list[tuple[int, Any]] = []
            for item in self.source.read_unit(epoch, unit, start * bs, self.shuffle):
                part.append(item)
                if len(part) == bs:
                    yield part
                    part = []
            if part:
                yield part
            return
        order = self.unit_samples(epoch, unit)
        for j in range(start, -(-len(order) // bs)):
            yield [(i, _LOAD) for i in order[j * bs:(j + 1) * bs]]

    def run(self, sender: Sender, stop: threading.Event | None = None,
            stats: SendStats | None = None) -> int:
        """Produce the units the broker hands out until every epoch is served; returns the
        batches handed to ``sender`` (counted in ``stats`` as they go, ``batches`` and
        ``bytes``, so that a run that is stopped still says what it made)."""
        sent = 0
        stats = stats if stats is not None else SendStats()
        fingerprint = self.fingerprint
        # What a batch's lineage holds that its place does not give: packed once.
        lineage = wire.lineage_fields(self.file_fingerprint, code_version())
        while True:
            got = sender.next_unit(stop)
            if got is None:
                return sent
            total = self.slots(got.epoch, got.unit)
            empty = []
            for j, batch in self.batches(got.epoch, got.unit, got.start):
                if batch is None:
                    empty.append(j)
                    continue
                stats.bytes += sender.send(batch, epoch=got.epoch, stop=stop, unit=got.unit,
                                           index=j, last=j == total - 1, pipeline=fingerprint,
                                           lineage=lineage)
                sent += 1
                stats.batches += 1
            sender.unit_done(got.epoch, got.unit, total, tuple(empty), stop)


def is_exact(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("delivery", "training") == "exact"


def build_exact(cfg: Mapping[str, Any]) -> ExactPipeline:
    """The exact form of a pipeline map (``delivery: exact``); ConfigError names the field."""
    if "factory" in cfg:
        raise ConfigError("factory: exact delivery builds the pipeline from source and steps "
                          "(it needs to read samples by index)")
    if "shard" in cfg:
        raise ConfigError("shard: not with delivery: exact (the broker hands out units: every "
                          "producer of the stream reads the whole dataset by units)")
    top = Args(cfg, "pipeline")
    seed = top.integer("seed", 0)
    on_error = top.text("on_error", "raise", choices=("raise", "skip"))
    x = Args(cfg.get("exact") or {}, "exact")
    unit_size = x.integer("unit_size", None, lo=1, allow_none=True)
    shuffle = x.flag("shuffle", True)
    x.done()
    par = Args({"workers": "auto"} if cfg.get("parallel") == "auto" else
               cfg.get("parallel") or {}, "parallel")
    # auto: a thread per CPU this process may use (units run threads of a fixed count).
    workers = cpu_budget().workers if par.get("workers") == "auto" else \
        par.integer("workers", 1, lo=1)
    if par.text("mode", "none", choices=("none", "thread", "process", "runner",
                                         "auto")) == "runner":
        raise ConfigError("parallel.mode: runner runs whole pipelines in workers; with "
                          "delivery: exact use thread or process (map steps in threads)")
    par.get("strict")
    par.get("buffer_size")
    par.done()
    source = top.get("source", required=True)
    name, args = one_key(source, "source", SOURCES)
    a = Args(args, f"source.{name}")
    src = SOURCES[name](a, seed)
    a.done()
    if isinstance(src, UnitSource):  # shards: a unit is a shard, or a slice of unit_size
        guarded(f"source.{name}", lambda: src.set_units(unit_size))
    elif not isinstance(src, Indexable):
        raise ConfigError(f"source.{name}: exact delivery needs a source it can read by index "
                          "(image_folder, lmdb, list, fake) or by shards (webdataset, "
                          "tfrecord, parquet)")
    else:
        unit_size = unit_size or DEFAULT_UNIT
    funcs: list[Callable[[Any], Any]] = []
    batch_size = None
    steps = cfg.get("steps") or []
    for i, item in enumerate(steps):
        where = f"steps[{i}]"
        step, sargs = one_key(item, where, {**MAP_STEPS, "batch": None})
        sa = Args(sargs, f"{where}.{step}")
        if step == "batch":
            if i != len(steps) - 1:
                raise ConfigError(f"{where}: with delivery: exact, batch is the last step")
            batch_size = sa.integer("batch_size", required=True, lo=1)
            sa.get("remainder")  # always: a unit's last batch may be short
            sa.done()
            continue
        component = sa.get("component", 0)
        f = MAP_STEPS[step](sa, seed * 1000 + i)
        funcs.append(f if component is None else ComponentFunc(f, component))
        sa.done()
    if batch_size is None:
        raise ConfigError("steps: delivery: exact needs a batch step, last")
    epochs = cfg.get("epochs")
    return ExactPipeline(src, funcs, batch_size, seed, on_error, workers, unit_size or 0,
                         int(epochs or 0), shuffle, str(cfg.get("stream", DEFAULT_STREAM)),
                         file_fingerprint=exact_file_fingerprint(cfg))


def send_exact(pipe: ExactPipeline, addr: str | list[str], *, producer_id: str | None = None,
               link: Any = None, curve: Any = None, stop: threading.Event | None = None,
               registry: Any = None, stream: str | None = None,
               fleet: tuple[str, int] | tuple[str, int, bool] = ("", 0),
               started: float | None = None) -> SendStats:
    """Serve ``pipe``'s units to the broker at ``addr`` until every epoch is served (or
    forever, ``epochs: null``, until ``stop``). Returns what it did as
    :func:`~feedline.producer.sender.send_dataflow` does: ``sent``/``sent_bytes`` are the
    batches a broker took (sent under its credit), ``batches`` those made, stopped or not.
    ``started``: when this producer started, as :class:`~feedline.producer.sender.Sender`
    takes it."""
    from feedline.errors import Stopped

    stats = SendStats()
    t0 = time.monotonic()
    with Sender(addr, producer_id=producer_id, link=link, registry=registry, curve=curve,
                stream=stream or pipe.stream, exact=pipe.spec, fleet=fleet,
                started=started) as sender:
        try:
            pipe.run(sender, stop, stats)
            sender.end(pipe.epochs, stop)
        except Stopped:
            sender.stopped = True
        except Exception as e:
            sender.error(e)
            raise
        finally:
            stats.seconds = time.monotonic() - t0
            stats.credit_wait_seconds = sender.credit_wait_seconds
    # After the close: what the I/O thread sent under a broker's credit, and why not.
    stats.sent, stats.sent_bytes = sender.sent
    stats.unreached = list(sender._out.unreached)
    stats.bye_unanswered = sender._out.bye_unanswered
    return stats
