"""ShardedSource: the base of the sources that read shards (WebDataset, TFRecord, Parquet).

A sharded source reads a list of shards (:func:`~feedline.producer.shards.locations.expand`:
a list, a glob, braces, or the shards a manifest lists) from wherever they live, one shard
front to back at a time per open slot, ``read_ahead`` shards open at once and their samples
interleaved. What a subclass adds is :meth:`ShardedSource._read`: one shard's samples in
order, each a datapoint or, in its place, the
:class:`~feedline.producer.shards.records.CorruptRecord` that stood there; or, for a format
whose records start at known bytes (tar, TFRecord), :meth:`ShardedSource._read_from`: the
same from a given byte to another, each with the byte where its record starts.

Which shards a pass reads (training, :meth:`__iter__`):

- given a :class:`ClaimFeed` (:meth:`attach`; ``send_dataflow`` attaches the broker's when it
  serves a stream), the shards the broker hands this producer: each shard goes to one
  producer per epoch, across all producers of the stream. A pass is one epoch's claims;
- otherwise every shard of this source's ``shard`` (``(index, count)`` over the shard list,
  as any Shardable source), in an order shuffled per pass by ``(seed, epoch)``.

Exact delivery reads it by units instead (:meth:`units`, :meth:`read_unit`): a unit is a
shard, or a slice of at most ``unit_size`` samples of one; it needs each shard's sample count
(a manifest, or the Parquet footers), and a shard that holds another number of records is a
:class:`~feedline.producer.shards.manifest.ManifestError`. A slice reads only its own bytes
where it can: from its first record, at the byte an earlier read of that shard found it at
(kept per shard: one offset per unit), to the next slice's first byte.

Failures never stop the others: a corrupt record is counted and named
(``stats.corrupt_records``, logged) and its place skipped; a shard that keeps failing after
the retries is counted and named (``stats.failed_shards``) and skipped in training, and
raised (a :class:`~feedline.producer.shards.retry.ShardError`) under exact delivery. But
when every shard this source reads has failed since the last one read to its end (none of
them can be read: a wrong name, an emptied bucket, a server that does not answer byte
ranges), training stops with :class:`ShardsFailed`, one line naming them and what to check:
there is nothing left to train on, and with claims the producer would otherwise go through
epoch after epoch of failing shards for ever.

Memory: each open shard holds at most ``(prefetch + 2) * chunk_size`` bytes
(:class:`~feedline.producer.shards.stream.ChunkStream`) plus the sample being cut out of it,
so the source holds at most ``read_ahead * ((prefetch + 2) * chunk_size + max_sample_bytes)``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import closing
from functools import partial
from typing import Any, Protocol, runtime_checkable

import numpy as np

from feedline.errors import ConfigError, DataError
from feedline.exact import MAX_UNITS
from feedline.logs import RateLimitedLog
from feedline.producer.dataflow.base import DataFlow, UnknownLength
from feedline.producer.dataflow.shard import check_shard, shard_positions
from feedline.producer.shards import manifest as mf
from feedline.producer.shards.locations import Location, basename, expand, protocol_of
from feedline.producer.shards.records import CorruptRecord
from feedline.producer.shards.retry import RetryPolicy, ShardError
from feedline.producer.shards.stats import ShardStats
from feedline.producer.shards.stream import ChunkStream

log = logging.getLogger(__name__)
_UNIT_ORDER = 0xC1A1  # the per-epoch shard order's stream, apart from other draws


class ShardsFailed(DataError):
    """Every shard a training source reads failed, none read to its end since the last one
    that was: the message names them, why the first failed, and what to check."""


@runtime_checkable
class ClaimFeed(Protocol):
    """Hands out this producer's shards: ``claim()`` -> ``(epoch, unit)`` (unit: an index of
    the shard list, before the per-epoch shuffle), or None once every epoch is served."""

    def claim(self) -> tuple[int, int] | None: ...


class ShardedSource(DataFlow):
    format = ""

    def __init__(self, urls: str | Sequence[str] | None = None, *, manifest: str | None = None,
                 fields: Sequence[str] = (), shuffle: bool = True, seed: int = 0,
                 shard: tuple[int, int] = (0, 1), read_ahead: int = 2,
                 chunk_size: int = 2 << 20, prefetch: int = 2,
                 retry: RetryPolicy | None = None, timeout: float = 30.0,
                 storage_options: dict[str, Any] | None = None,
                 max_sample_bytes: int = 16 << 20, shuffle_buffer: int = 256,
                 claim: bool = True) -> None:
        if urls is None and manifest is None:
            raise ConfigError("needs urls (a list, a glob or a brace pattern) or a manifest")
        for name, v in (("read_ahead", read_ahead), ("chunk_size", chunk_size),
                        ("prefetch", prefetch), ("max_sample_bytes", max_sample_bytes),
                        ("shuffle_buffer", shuffle_buffer)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
        self.options = dict(storage_options or {})
        self.manifest_url = manifest
        self.manifest = mf.read(manifest, self.options) if manifest else None
        self.urls = expand(urls, self.options) if urls is not None else \
            mf.shard_urls(manifest, self.manifest)  # type: ignore[arg-type]
        self.fields = list(fields)
        self.shuffle, self.seed = shuffle, seed
        self.read_ahead, self.chunk_size, self.prefetch = read_ahead, chunk_size, prefetch
        self.retry = retry or RetryPolicy()
        self.timeout, self.max_sample_bytes = timeout, max_sample_bytes
        self.shuffle_buffer = shuffle_buffer
        self.stats = ShardStats()
        self.claims = claim  # read the shards a broker hands out, when sent to one
        self._locs: dict[str, Location] = {}
        self._feed: ClaimFeed | None = None
        self._held: tuple[int, int] | None = None
        self._finished = False
        self._epoch = 0
        self._table: list[tuple[int, int, int]] | None = None  # exact: (shard, start, count)
        self._offsets: list[int] = []
        self._shard_counts: list[int] = []
        self._unit_size: int | None = None
        # exact: per shard, where its units start: record position -> byte offset, as reads
        # found them (so a unit starts reading at its own first record, not at byte 0)
        self._starts: dict[int, dict[int, int]] = {}
        # exact: per shard, its size in bytes when those starts were found; and per url, the
        # size its last opened stream found (both bounded by the shard list)
        self._sizes: dict[int, int] = {}
        self._opened: dict[str, int] = {}
        self._order: tuple[int, list[int]] | None = None  # exact: (epoch, its unit order)
        # shard index -> why, for the shards that failed since one was last read to its end
        self._failing: dict[int, str] = {}
        # A shard that fails every epoch (a stale urls list) is named once at WARNING; its
        # later failures go through a rate limit that counts them: they are all counted in
        # stats.failed_shards, but an epoch every second must not write a line each.
        self._named: set[int] = set()  # bounded by the shard list
        self._repeats = RateLimitedLog(log, interval=60.0)
        self.set_shard(*shard)

    # -- what a subclass implements (one of _read and _read_from) -----------------------
    def _read(self, url: str) -> Iterator[Any]:
        """The shard's samples in order: datapoints, or a CorruptRecord in the place of one
        that cannot be read. Raises ShardError when the shard cannot be read at all."""
        for _, item in self._read_from(url):
            yield item

    def _read_from(self, url: str, start: int = 0, end: int | None = None,
                   chunk: int | None = None) -> Iterator[tuple[int | None, Any]]:
        """``_read``'s samples from byte ``start`` (where an earlier read said a record
        starts) up to byte ``end`` (None: the shard's end), each with the byte where its
        record starts; None for a format without such places (read from its start only).
        ``chunk``: bytes per request, if not ``chunk_size``."""
        if start:
            raise NotImplementedError(f"{type(self).__name__} reads a shard from its start")
        for item in self._read(url):
            yield None, item

    def _count(self, url: str) -> int | None:
        """The shard's sample count without reading it, where the format says (else None)."""
        return None

    # -- helpers for subclasses -------------------------------------------------------
    def location(self, url: str) -> Location:
        p = protocol_of(url)
        loc = self._locs.get(p)
        if loc is None:
            loc = self._locs[p] = Location(p, self.options, self.timeout)
        return loc

    def stream(self, url: str, start: int = 0, end: int | None = None,
               chunk: int | None = None) -> ChunkStream:
        return ChunkStream(self.location(url), url, chunk_size=chunk or self.chunk_size,
                           prefetch=self.prefetch, retry=self.retry, stats=self.stats,
                           start=start, end=end, on_size=partial(self._opened.__setitem__, url))

    def memory_bound(self) -> int:
        """The bytes this source's reads hold at most (the module docstring's formula)."""
        return self.read_ahead * ((self.prefetch + 2) * self.chunk_size + self.max_sample_bytes)

    # -- DataFlow ----------------------------------------------------------------------
    def set_shard(self, index: int, count: int) -> None:
        """A static share of the shard list (a producer's ``shard:``): no claims then."""
        self.shard = check_shard(index, count)
        if count > 1:
            self.claims = False

    def attach(self, feed: ClaimFeed | None) -> None:
        """Read the shards ``feed`` hands out (None: this source's own ``shard`` again)."""
        self._feed, self._held, self._finished = feed, None, False
        self._failing = {}

    @property
    def finished(self) -> bool:
        """The feed said every epoch is served (a pass now yields nothing)."""
        return self._finished

    def __len__(self) -> int:
        counts = self._counts(required=False)
        if counts is None or self._feed is not None:
            raise UnknownLength(f"{type(self).__name__}: the sample count needs a manifest "
                                "(and is unknown when the broker hands out the shards)")
        return sum(counts[i] for i in shard_positions(len(self.urls), self.shard))

    def reset_state(self) -> None:
        self._epoch = 0
        self._failing = {}
        self._locs = {}  # a fresh client in this process

    def order(self, epoch: int) -> list[int]:
        """Shard indices in their order for ``epoch``: unit ``u`` is shard ``order[u]``."""
        idx = list(range(len(self.urls)))
        if self.shuffle:
            np.random.default_rng([self.seed & 0xFFFFFFFF, epoch, _UNIT_ORDER]).shuffle(idx)
        return idx

    def _pass_shards(self) -> Iterator[int]:
        if self._feed is None:
            epoch, self._epoch = self._epoch, self._epoch + 1
            order = self.order(epoch)
            yield from (order[p] for p in shard_positions(len(self.urls), self.shard))
            return
        got = self._held if self._held is not None else self._feed.claim()
        epoch = got[0] if got is not None else -1
        while got is not None and got[0] == epoch:
            if not 0 <= got[1] < len(self.urls):
                raise ShardError(f"unit {got[1]}", f"the broker handed out a unit outside the "
                                 f"{len(self.urls)} shards: do all producers of the stream "
                                 "read the same shards?")
            yield self.order(epoch)[got[1]]
            got = self._feed.claim()
        self._held = got
        self._finished = got is None

    def _guarded(self, index: int) -> Iterator[Any]:
        """Shard ``index``'s samples with corrupt records counted and a failed shard skipped;
        :class:`ShardsFailed` once every shard this source reads has failed in a row."""
        url = self.urls[index]
        n = 0
        try:
            for item in self._read(url):
                if isinstance(item, CorruptRecord):
                    self._corrupt(item)
                else:
                    n += 1
                    yield item
            self.stats.add(shards_read=1)
            self._failing = {}
        except ShardError as e:
            self.stats.shard_failed(url)
            self._shard_lost(index, e, n)
            self._failing[index] = e.why
            mine = self._reachable()
            if len(self._failing) >= len(mine) and set(self._failing) >= set(mine):
                raise ShardsFailed(self._all_failed(mine)) from None

    def _shard_lost(self, index: int, e: ShardError, n: int) -> None:
        """Log shard ``index``'s failure after ``n`` samples: the first time at WARNING with
        what to check; later (the same shard next epoch) through the rate limit."""
        args: tuple[object, ...]
        if n:
            msg, args = "skipped the rest of shard %s after %d samples: %s", (e.name, n, e.why)
        else:
            # a shard that is not there (a 404, a removed file or key) is most often one a
            # re-conversion (``feedline convert --overwrite``) renamed or removed
            stale = e.why.startswith("FileNotFoundError")
            msg, args = "could not read shard %s: %s" + (
                "; is the urls list (or the manifest) stale?" if stale else ""), (e.name, e.why)
        if index in self._named:
            self._repeats.warning(msg + " (again)", *args)
        else:
            self._named.add(index)
            log.warning(msg, *args)

    def _reachable(self) -> range:
        """The shards a pass of this source may read: any, with claims or where its static
        share is drawn from a shuffled order (another set each epoch); else its share."""
        n = len(self.urls)
        if self._feed is not None or self.shuffle or self.shard[1] == 1:
            return range(n)
        return shard_positions(n, self.shard)

    def _all_failed(self, mine: range | None) -> str:
        """The one line of a ShardsFailed: every shard of ``mine`` failed (None: every
        shard this producer was handed in its run)."""
        first, why = next(iter(self._failing.items()))
        others = [basename(self.urls[i]) for i in self._failing if i != first]
        names = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3
                                         else "")
        hint = ("check that the shards are where urls (or the manifest) say and that the "
                "store serves them to this machine (storage_options: credentials, "
                "endpoint_url)")
        if mine is None:
            every = (f"every shard this producer was handed ({len(self._failing)} of "
                     f"{len(self.urls)}) failed, none read to its end in its run")
        else:
            every = ("the one shard" if len(mine) == 1 else
                     f"every one of the {len(mine)} shards") + \
                " this producer reads failed, none read to its end since"
        return (f"{every}: shard "
                f"{self.urls[first]}: {why}" + (f" (and {names})" if others else "") +
                f"; {hint}")

    def _corrupt(self, e: CorruptRecord) -> None:
        self.stats.record_corrupt(e.where)
        log.warning("corrupt record %s%s", e, "" if e.resumable else
                    "; the rest of the shard cannot be found")

    def __iter__(self) -> Iterator[Any]:
        shards = self._pass_shards()
        open_: deque[Iterator[Any]] = deque()
        try:
            while True:
                while len(open_) < self.read_ahead:
                    nxt = next(shards, None)
                    if nxt is None:
                        break
                    it = self._guarded(nxt)
                    open_.append(it)
                if not open_:
                    if self._finished and self._failing and not self.stats.shards_read:
                        # The run is over (the broker handed out every epoch's shards) and
                        # no shard this producer was handed could be read: its epochs ended
                        # before its claims covered the list.
                        raise ShardsFailed(self._all_failed(None))
                    return
                it = open_.popleft()
                dp = next(it, _END)
                if dp is _END:
                    continue
                open_.append(it)
                yield dp
        finally:
            for it in open_:
                it.close()  # type: ignore[attr-defined]
            shards.close()  # type: ignore[attr-defined]

    # -- exact delivery: units --------------------------------------------------------
    def _counts(self, required: bool = True) -> list[int] | None:
        if self.manifest is not None:
            return self.manifest.counts(self.urls)
        counts = []
        for u in self.urls:
            c = self._count(u)
            if c is None:
                break
            counts.append(c)
        if len(counts) < len(self.urls):
            if not required:
                return None
            raise mf.ManifestError(
                f"the sample count of each shard is needed (exact delivery numbers samples by "
                f"it): give the manifest `feedline convert` wrote beside the shards, or write "
                f"one with `feedline info {self.urls[0]} ... --manifest manifest.json`")
        return counts

    def set_units(self, unit_size: int | None) -> None:
        """Cut units for exact delivery: whole shards (None), or slices of at most
        ``unit_size`` samples of each."""
        counts = self._counts()
        assert counts is not None
        # The units are counted before they are cut: the table is one entry per unit, and a
        # count of 10**15 (a hostile manifest) must not become 10**12 of them.
        units = sum(-(-max(n, 1) // (unit_size or max(n, 1))) for n in counts)
        if units > MAX_UNITS:
            total = sum(counts)
            fit = -(-total // max(MAX_UNITS - len(counts), 1))
            raise ConfigError(
                f"exact.unit_size: {unit_size} cuts the {total} samples of {len(counts)} "
                f"shards into {units} units, more than the {MAX_UNITS} an exact stream "
                f"takes: " + (f"use a unit_size of at least {fit}" if unit_size and
                              len(counts) < MAX_UNITS else "use fewer, larger shards"))
        self._shard_counts, self._unit_size, self._starts = counts, unit_size, {}
        self._sizes, self._order = {}, None
        self._offsets = [int(x) for x in np.cumsum([0, *counts[:-1]])] if counts else []
        table = []
        for s, n in enumerate(counts):
            step = unit_size or max(n, 1)
            table += [(s, a, min(step, n - a)) for a in range(0, max(n, 1), step)]
        self._table = table

    def samples(self) -> int:
        return sum(c for _, _, c in self._table or [])

    def units(self) -> int:
        if self._table is None:
            self.set_units(None)
        return len(self._table or [])

    def _slice(self, epoch: int, unit: int) -> tuple[int, int, int]:
        """Unit ``unit`` of ``epoch``: (shard, first sample, samples); units are read in an
        order shuffled per epoch (the coordinator numbers them the same every epoch)."""
        self.units()
        assert self._table is not None
        if self._order is None or self._order[0] != epoch:  # one shuffle per epoch, not unit
            order = list(range(len(self._table)))
            if self.shuffle:
                np.random.default_rng([self.seed & 0xFFFFFFFF, epoch, _UNIT_ORDER]).shuffle(order)
            self._order = (epoch, order)
        return self._table[self._order[1][unit]]

    def unit_length(self, epoch: int, unit: int) -> int:
        return self._slice(epoch, unit)[2]

    def read_unit(self, epoch: int, unit: int, skip: int = 0,
                  shuffle: bool = True) -> Iterator[tuple[int, Any]]:
        """``(sample id, datapoint or None)`` for the unit's samples in their order for
        ``epoch`` (a pure function of (seed, epoch, unit)), from its ``skip``-th on. A
        sample's id is its place in the dataset (shards in list order); None stands for a
        corrupt record. ShardError if the shard cannot be read."""
        s, start, count = self._slice(epoch, unit)
        base = int(self._offsets[s])
        url, total = self.urls[s], self._shard_counts[s]

        # Read from the nearest unit start found so far at or before this one, up to the
        # next unit's first byte where known (the shard's last unit reads to the end: one
        # record more there is a miscount).
        starts = self._starts.setdefault(s, {0: 0})
        first = max(p for p in starts if p <= start)
        stop = starts.get(start + count) if start + count < total else None
        step = self._unit_size or max(total, 1)
        # Where the unit's end is not known yet, requests of a few of its records each: a
        # full chunk (and the chunks fetched ahead) would mostly be past its end.
        chunk = None if stop is not None else self._guess_chunk(s, count)

        # Read from where earlier reads found records: a rewritten shard's records are
        # elsewhere, and its miscount says so (not that the manifest is wrong).
        learnt = first > 0 or stop is not None

        def in_place() -> Iterator[tuple[int, Any]]:
            n, lost = first, False  # records up to here; lost: one the reader cannot pass
            self._opened.pop(url, None)
            reads = self._read_from(url, starts[first], stop, chunk)
            with closing(reads) as records:  # type: ignore[type-var]
                for pos, (at, item) in enumerate(records, first):
                    if pos == first:  # the stream is open: its size is known (if it says)
                        self._check_size(s, url, total)
                    if at is not None and pos % step == 0 and not lost:
                        starts[pos] = at
                    if pos >= start + count:
                        if stop is not None:  # a record past the byte the next unit starts at
                            raise self._stale(s, url, f"a record at byte {at}, past the "
                                              f"{stop} where the next slice started")
                        if start + count < total:
                            return  # the next unit's first record: its start is known now
                        # One record more than the count, in the shard's last unit: samples
                        # no unit would ever serve.
                        raise self._miscounted(url, f"more than the {total} records", learnt)
                    n = pos + 1
                    if isinstance(item, CorruptRecord):
                        lost = lost or not item.resumable
                        if lost and stop is not None:
                            # An earlier read passed this slice whole (it found the next
                            # one's start): a record it cannot pass now was rewritten.
                            raise self._stale(s, url, f"a record it cannot pass ({item.why})")
                        if pos >= start:
                            self._corrupt(item)
                    if pos >= start:
                        yield base + pos, None if isinstance(item, CorruptRecord) else item
            if n == first:  # not a record read: the size is checked now
                self._check_size(s, url, total)
            if n < start + count and not lost:
                # The shard ended before its count without a corrupt record that cut it
                # short (that one is logged, and the places after it left empty).
                if stop is not None:
                    raise self._stale(s, url, f"{n - first} records between the bytes "
                                      f"{starts[first]} and {stop}, not the "
                                      f"{start + count - first}")
                raise self._miscounted(url, f"{n} records, not the {total}", learnt)
        items = in_place()
        if shuffle:
            rng = np.random.default_rng([self.seed & 0xFFFFFFFF, epoch, unit])
            items = _buffer_shuffle(items, self.shuffle_buffer, rng)
        for k, item in enumerate(items):
            if k >= skip:
                yield item

    def _guess_chunk(self, s: int, count: int) -> int | None:
        """Bytes per request for a unit of ``count`` records of shard ``s`` whose end is not
        known: a quarter of what the unit likely holds (the record size from the unit
        starts found so far, else from the manifest's bytes), at least 64 KiB; None (the
        chunk size) where nothing says."""
        starts = self._starts.get(s, {})
        far = max(starts)
        per: float | None = starts[far] / far if far else None
        if per is None and self.manifest is not None and self._shard_counts[s]:
            name = basename(self.urls[s])
            size = next((i.bytes for i in self.manifest.shards if basename(i.name) == name), 0)
            per = size / self._shard_counts[s] if size else None
        if per is None:
            return None
        return max(64 << 10, min(self.chunk_size, int(per * count / 4)))

    def _miscounted(self, url: str, holds: str, learnt: bool = False) -> mf.ManifestError:
        """A shard whose records are not its count: exact delivery would lose or never
        serve samples, silently; the error says what to rebuild. ``learnt``: the read began
        at a record an earlier read found (the shard may have changed since, instead)."""
        since = (" (or it changed since this producer learnt where its slices start: "
                 "restart the producers)") if learnt else ""
        if self.manifest is None:
            return mf.ManifestError(f"shard {url} holds {holds} it had when the producer "
                                    "started: it changed; restart the producers")
        return mf.ManifestError(
            f"shard {url} holds {holds} that {self.manifest_url} says: it changed since the "
            f"manifest was written{since}; rebuild it (feedline info URLS --manifest "
            f"OUT.json) and point manifest: at it")

    def _stale(self, s: int, url: str, found: str) -> mf.ManifestError:
        """Shard ``s`` is not where this producer learnt its slices start: it was rewritten
        while the producer ran. What was learnt of it is dropped (a restarted producer
        learns it again); the error says so, and what to do."""
        self._starts[s] = {0: 0}
        self._sizes.pop(s, None)
        return mf.ManifestError(
            f"shard {url} changed since this producer learnt where its slices start (it "
            f"found {found}): a shard must not be rewritten while exact delivery reads it; "
            f"restart the producers, and if its sample count changed, rebuild the manifest "
            f"(feedline info URLS --manifest OUT.json)")

    def _check_size(self, s: int, url: str, total: int) -> None:
        """ManifestError where shard ``s`` (``url``, just opened) changed size since its
        slices' starts were learnt, or is too small for its ``total`` records."""
        size = self._opened.get(url)
        if size is None:
            return  # the store did not say (a stream without a length)
        known = self._sizes.setdefault(s, size)
        if known != size and len(self._starts.get(s, {})) > 1:
            raise self._stale(s, url, f"{size} bytes, not the {known} it had then")
        self._sizes[s] = size
        least = mf.MIN_RECORD_BYTES.get(self.format, 0)
        if least and total > mf.most_records(size, least):
            where = self.manifest_url or "the count"
            raise mf.ManifestError(
                f"shard {url}: {total} samples ({where}) in its {size} bytes: a {self.format} "
                f"record takes at least {least}; the manifest does not describe this shard: "
                f"rebuild it (feedline info URLS --manifest OUT.json)")

    def identity(self) -> list[str]:
        """What identifies the dataset for exact delivery: the shard names, in order."""
        return list(self.urls)


_END = object()


def _buffer_shuffle(items: Iterator[Any], size: int, rng: np.random.Generator,
                    ) -> Iterator[Any]:
    """Items in an order drawn from ``rng`` through a buffer of ``size``: a pure function of
    the input order and the generator's seed."""
    buf: list[Any] = []
    for x in items:
        if len(buf) < size:
            buf.append(x)
            continue
        j = int(rng.integers(size))
        buf[j], x = x, buf[j]
        yield x
    rng.shuffle(buf)  # type: ignore[arg-type]
    yield from buf
