"""An exact stream's run as the exact tests play it: a pipeline file of a known dataset, its
producers, a consumer, and the check that every sample came once."""


from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import yaml

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.producer.exact import build_exact
from feedline.transport.link import LinkConfig
from tests.support.ledger_data import check

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


LIVENESS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")


N, UNIT, BATCH = 96, 16, 4


def pipeline(tmp_path: Path, epochs: int | None = 2, delay: float = 0.0, n: int = N,
             seed: int = 3, batch: int = BATCH) -> Path:
    cfg = {"stream": "val", "delivery": "exact", "exact": {"unit_size": UNIT}, "seed": seed,
           "epochs": epochs, "source": {"list": {"items": list(range(n))}},
           "steps": [{"map": {"function": "tests.support.ledger_data:exact_sample",
                              "args": {"nbytes": 512, "delay": delay}, "component": None}},
                     {"batch": {"batch_size": batch}}]}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "exact.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def producer(daemons, cfg: Path, broker: str, name: str):
    return daemons("feedline.producer", "--config", cfg, "--broker", broker, "--id", name,
                   *LIVENESS,
                   name=name)


def samples(batch) -> list[tuple[int, bytes]]:
    """(id, payload bytes) of every sample of a batch, each checked against its crc."""
    data, meta = batch.datapoint
    return [(check([data[k], meta[k]]), data[k].tobytes()) for k in range(len(meta))]


def clean_run(cfg: Path, epoch: int) -> dict[int, bytes]:
    """What a run without faults produces for ``epoch``: id -> payload bytes."""
    pipe = build_exact(yaml.safe_load(cfg.read_text()))
    out: dict[int, bytes] = {}
    for unit in range(-(-pipe.source.samples() // pipe.unit_size)):
        for _, batch in pipe.batches(epoch, unit):
            assert batch is not None, "the test pipeline skips no sample"
            data, meta = batch
            out.update({int(meta[k][0]): data[k].tobytes() for k in range(len(meta))})
    return out


def assert_exactly_once(seen: list[tuple[int, bytes]], cfg: Path, epoch: int) -> None:
    expected = clean_run(cfg, epoch)
    n = len(expected)
    ids = sorted(i for i, _ in seen)
    assert ids == list(range(n)), f"lost {set(range(n)) - set(ids)}, " \
        f"duplicated {[i for i in set(ids) if ids.count(i) > 1]}"
    # Every sample's bytes differ from every other's, so a swap would show below.
    assert len(set(expected.values())) == len(expected), "samples with the same bytes"
    assert all(expected[i] == b for i, b in seen), "contents differ from a clean run"


Seen = list[tuple[int, bytes]]


def remote(addr: str, timeout: float = 30, window: int = ConsumerOptions.window,
           **kw: Any) -> RemoteDataZMQ:
    return RemoteDataZMQ(addr, stream="val", timeout=timeout, return_meta=True,
                         options=ConsumerOptions(window=window, link=FAST), **kw)


def take(it: Any, n: int) -> Seen:
    return [s for b in itertools.islice(it, n) for s in samples(b)]


def rest(src: RemoteDataZMQ) -> Seen:
    return [s for b in src.epoch() for s in samples(b)]
