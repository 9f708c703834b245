"""Shards across a fleet: the broker's claim table (feedline/serving/handout.py) as a model,
checked after every step, and real producers on one stream that split the shards among
themselves with no list per machine."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import yaml
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.errors import Refusal
from feedline.exact.coordinator import Assignment
from feedline.procs import wait_for
from feedline.serving.handout import Claims, ClaimStreams
from feedline.transport.link import LinkConfig
from tests.support.shard_server import file_server
from tests.support.shard_support import make_wds

LIVENESS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")
FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


def test_each_unit_once_per_epoch_and_epochs_move_on():
    c = Claims(units=3, epochs=2)
    got = [c.request(b"a"), c.request(b"a")]
    assert got[0] == got[1] == Assignment(0, 0, 0)  # asked again, unacknowledged: the same
    c.ack(b"a", 0, 0)
    for owner, unit in ((b"b", 1), (b"a", 2)):
        a = c.request(owner)
        assert a == Assignment(0, unit, 0)
        c.ack(owner, a.epoch, a.unit)
    assert c.epoch == 1  # every unit of epoch 0 handed out: nobody waits for the last reader
    for _ in range(3):
        a = c.request(b"a")
        c.ack(b"a", a.epoch, a.unit)
    assert c.request(b"b") == "finished"


def test_a_gone_producers_unacknowledged_unit_goes_to_the_next():
    c = Claims(units=4)
    a = c.request(b"dead")
    c.ack(b"dead", a.epoch, a.unit)  # started: its unit is gone with it (at most once)
    lost = c.request(b"dead")  # answered, never acknowledged (the answer was lost)
    c.release(b"dead")
    assert c.request(b"live") == lost


def test_streams_refuse_a_producer_with_other_shards():
    s = ClaimStreams()
    assert isinstance(s.join("train", 8, 0, b"a"), Claims)
    with pytest.raises(Refusal, match="reads 8 shards"):
        s.join("train", 9, 0, b"b")
    s.leave("train", b"a")
    assert not s.get("train").members  # type: ignore[union-attr]


class ClaimModel(RuleBasedStateMachine):
    """Producers ask, start (acknowledge) and vanish in any order; every unit handed out is
    started by at most one producer per epoch, and an epoch moves on only once every unit of
    it was handed out."""

    UNITS = 5

    def __init__(self) -> None:
        super().__init__()
        self.c = Claims(units=self.UNITS)
        self.answer: dict[bytes, tuple[int, int]] = {}  # what each producer was told
        self.started: Counter = Counter()  # (epoch, unit) -> producers that started it
        self.told: set[tuple[int, int]] = set()
        self.alive = {b"p0", b"p1", b"p2"}
        self.gen = 3

    @rule(k=st.integers(0, 9))
    def ask(self, k: int) -> None:
        owner = sorted(self.alive)[k % len(self.alive)]
        a = self.c.request(owner)
        assert isinstance(a, Assignment)
        if owner in self.answer and owner not in self.started_by:
            assert (a.epoch, a.unit) == self.answer[owner]  # asked again: the same answer
        self.answer[owner] = (a.epoch, a.unit)
        self.told.add((a.epoch, a.unit))

    @property
    def started_by(self) -> set[bytes]:
        return getattr(self, "_started_by", set())

    @rule(k=st.integers(0, 9))
    def start(self, k: int) -> None:
        owner = sorted(self.alive)[k % len(self.alive)]
        if owner in self.answer:
            key = self.answer.pop(owner)
            self.c.ack(owner, *key)
            self.started[key] += 1

    @rule(k=st.integers(0, 9))
    def vanish(self, k: int) -> None:
        owner = sorted(self.alive)[k % len(self.alive)]
        self.c.release(owner)
        self.answer.pop(owner, None)
        self.alive.discard(owner)
        self.alive.add(b"p%d" % self.gen)  # a new producer takes its place
        self.gen += 1

    @invariant()
    def at_most_once(self) -> None:
        assert all(n == 1 for n in self.started.values()), self.started

    @invariant()
    def epochs_move_on_only_when_handed_out(self) -> None:
        for e in range(self.c.epoch):
            assert all((e, u) in self.told for u in range(self.UNITS))

    @invariant()
    def memory_is_bounded(self) -> None:
        assert len(self.c.handed) <= len(self.alive)
        assert len(self.c.returned) <= self.gen


TestClaimModel = ClaimModel.TestCase
TestClaimModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_producers_of_a_stream_split_the_shards_each_once_per_epoch(broker_proc, daemons,
                                                                      endpoints, tmp_path):
    """Three producers, one pipeline file, twelve shards over HTTP, two epochs: every sample
    arrives exactly twice (once per epoch), and each producer read some of the shards."""
    make_wds(tmp_path / "shards", shards=12, per_shard=5, nbytes=500)
    broker_proc()
    with file_server(str(tmp_path / "shards")) as url:
        cfg = {"stream": "train", "seed": 1, "epochs": 2,
               "source": {"webdataset": {"urls": f"{url}/train-{{000000..000011}}.tar",
                                         "fields": ["bin", "cls"]}},
               "steps": [{"map": {"function": "tests.support.shard_support:id_and_digest",
                                  "component": None}},
                         {"batch": {"batch_size": 5, "remainder": True}}]}
        path = tmp_path / "train.yaml"
        path.write_text(yaml.safe_dump(cfg))
        procs = [daemons("feedline.producer", "--config", path, "--broker", endpoints.ingress,
                         "--id", f"p{k}", *LIVENESS, name=f"p{k}") for k in range(3)]
        seen: Counter = Counter()
        by_producer: Counter = Counter()
        with RemoteDataZMQ(endpoints.egress, stream="train", timeout=30, return_meta=True,
                           options=ConsumerOptions(link=FAST)) as src:
            it = iter(src)
            while sum(seen.values()) < 120:
                b = next(it)
                ids, _ = b.datapoint
                seen.update(int(i) for i in np.asarray(ids))
                by_producer[b.producer] += len(ids)
        wait_for(lambda: not any(p.alive() for p in procs), 30, what="producers to finish")
    assert seen == Counter({i: 2 for i in range(60)})
    assert len(by_producer) == 3, by_producer  # the shards were split, not read by one


class ListFeed:
    """Claims from a list, as the broker would hand them out (then None: finished)."""

    def __init__(self, claims: list[tuple[int, int]]) -> None:
        self.claims = list(claims)

    def claim(self) -> tuple[int, int] | None:
        return self.claims.pop(0) if self.claims else None


def test_a_pass_is_one_epochs_claims_and_the_next_claim_waits_for_the_next_pass(tmp_path):
    from feedline.producer.dataflow.webdataset import WebDataset

    make_wds(tmp_path, shards=4, per_shard=3, nbytes=50)
    ds = WebDataset(str(tmp_path / "*.tar"), fields=["bin", "cls"], shuffle=False)
    ds.reset_state()
    ds.attach(ListFeed([(0, 1), (0, 3), (1, 0), (1, 2)]))
    first = sorted(int(i) for _, i in ds)
    assert first == [3, 4, 5, 9, 10, 11] and not ds.finished
    second = sorted(int(i) for _, i in ds)
    assert second == [0, 1, 2, 6, 7, 8] and ds.finished
    assert list(ds) == []
    # shuffled: unit u of epoch e is shard order(e)[u], the same on every producer
    ds2 = WebDataset(str(tmp_path / "*.tar"), fields=["bin", "cls"], seed=9)
    ds2.reset_state()
    ds2.attach(ListFeed([(2, 0)]))
    assert sorted(int(i) // 3 for _, i in ds2) == [ds2.order(2)[0]] * 3


def test_runner_mode_needs_a_static_shard_and_a_shard_turns_claims_off(tmp_path):
    import pytest

    from feedline.producer.claims import claiming_source
    from feedline.producer.pipeline import ConfigError, build_pipeline

    make_wds(tmp_path, shards=2, per_shard=2, nbytes=50)
    src = {"webdataset": {"urls": str(tmp_path / "*.tar"), "fields": ["bin", "cls"]}}
    with pytest.raises(ConfigError, match="parallel.mode: runner"):
        build_pipeline({"source": src, "parallel": {"mode": "runner", "workers": 2},
                        "steps": [{"batch": {"batch_size": 2}}]})
    with build_pipeline({"source": src}) as df:
        assert claiming_source(df) is not None
    with build_pipeline({"source": src, "shard": {"index": 1, "count": 2}}) as df:
        assert claiming_source(df) is None
    with pytest.raises(ConfigError, match=r"source.webdataset.urls: required"):
        build_pipeline({"source": {"webdataset": {"fields": ["bin"]}}})
    with pytest.raises(ConfigError, match=r"source.webdataset.chunk: unknown key"):
        build_pipeline({"source": {"webdataset": {**src["webdataset"], "chunk": 1}}})


def test_runner_mode_over_url_shards_as_its_error_advises_serves_each_sample_once_per_epoch(
        broker_proc, daemons, endpoints, tmp_path):
    """Issue 53, finding 12: ``parallel: {mode: runner}`` over ``urls`` shards (no manifest),
    fixed as the refusal says: ``claim: false`` on one producer, or a static ``shard:`` on
    each of two. Before: both producers ended at once with "the sample count needs a
    manifest" and the trainer timed out. Now the runner's workers split the producer's
    shards among themselves: every sample arrives once per epoch."""
    make_wds(tmp_path / "shards", shards=6, per_shard=4, nbytes=300)
    broker_proc()
    with file_server(str(tmp_path / "shards")) as url:
        base = {"epochs": 2, "seed": 4, "parallel": {"mode": "runner", "workers": 2},
                "source": {"webdataset": {"urls": f"{url}/train-{{000000..000005}}.tar",
                                          "fields": ["bin", "cls"]}},
                "steps": [{"map": {"function": "tests.support.shard_support:id_and_digest",
                                   "component": None}},
                          {"batch": {"batch_size": 4, "remainder": True}}]}
        one = {**base, "stream": "one",
               "source": {"webdataset": {**base["source"]["webdataset"], "claim": False}}}
        two = [{**base, "stream": "two", "shard": {"index": k, "count": 2}} for k in range(2)]
        for name, cfgs in (("one", [one]), ("two", two)):
            procs = []
            for k, cfg in enumerate(cfgs):
                path = tmp_path / f"{name}-{k}.yaml"
                path.write_text(yaml.safe_dump(cfg))
                procs.append(daemons("feedline.producer", "--config", path, "--broker",
                                     endpoints.ingress, "--id", f"{name}{k}", *LIVENESS,
                                     name=f"{name}{k}"))
            seen: Counter = Counter()
            with RemoteDataZMQ(endpoints.egress, stream=name, timeout=30,
                               options=ConsumerOptions(link=FAST)) as src:
                it = iter(src)
                while sum(seen.values()) < 48:
                    ids, _ = next(it)
                    seen.update(int(i) for i in np.asarray(ids))
            wait_for(lambda: not any(p.alive() for p in procs), 30,  # noqa: B023
                     what="producers to finish")
            assert seen == Counter({i: 2 for i in range(24)}), (name, seen)
            assert all(p.proc.returncode == 0 for p in procs), [p.log_text() for p in procs]
