"""Exact delivery with real processes: every sample of every epoch exactly once, in spite of
producers killed mid-unit, a broker killed and restarted, a consumer killed, and a trainer
resuming from its cursor; sample contents equal a clean run's, byte for byte.

The dataset is sample ids 0..N-1; a map step (tests.support.ledger_data.exact_sample) turns each id
into a payload with a crc and an "augmentation" drawn from the sample's own generator, so a
unit produced twice must give the same bytes.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.procs import wait_for
from feedline.producer.exact import build_exact
from tests.support import ROOT
from tests.support.exact_run import (
    BATCH,
    FAST,
    N,
    assert_exactly_once,
    pipeline,
    producer,
    samples,
)


def test_two_producers_two_epochs_every_sample_exactly_once(broker_proc, daemons, endpoints,
                                                            tmp_path):
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path)
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}")
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        for epoch in range(2):
            seen = list(itertools.chain.from_iterable(samples(b) for b in src.epoch()))
            assert_exactly_once(seen, cfg, epoch)
        cursor = src.state()
    assert cursor.epoch == 1 and cursor.count() == -(-N // BATCH)


def test_a_producer_killed_mid_unit_loses_and_repeats_nothing(broker_proc, daemons, endpoints,
                                                              tmp_path):
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1, delay=0.01)
    victim = producer(daemons, cfg, endpoints.ingress, "victim")
    producer(daemons, cfg, endpoints.ingress, "survivor")
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        seen: list[tuple[int, bytes]] = []
        for batch in src.epoch():
            seen += samples(batch)
            if len(seen) == 5 * BATCH:
                victim.kill9()  # mid-unit: its unit goes to the survivor
        assert_exactly_once(seen, cfg, 0)


def test_a_broker_killed_and_restarted_loses_and_repeats_nothing(broker_proc, daemons,
                                                                 endpoints, tmp_path):
    state = tmp_path / "state"
    broker = broker_proc("--state-dir", str(state))
    cfg = pipeline(tmp_path, epochs=1, delay=0.005)
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}")
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        seen: list[tuple[int, bytes]] = []
        for batch in src.epoch():
            seen += samples(batch)
            if len(seen) == 6 * BATCH:
                broker.kill9()
                broker = broker_proc("--state-dir", str(state))
        assert_exactly_once(seen, cfg, 0)
    assert (state / "val.exact.jsonl").exists()


CONSUMER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    from feedline.consumer import ConsumerOptions, RemoteDataZMQ
    from feedline.transport.link import LinkConfig
    from tests.support.ledger_data import check
    options = ConsumerOptions(window=2, link=LinkConfig(heartbeat_interval=0.2,
                                                         heartbeat_timeout=1.5))
    with open(sys.argv[2], "a", buffering=1) as ledger, \\
            RemoteDataZMQ(sys.argv[1], stream="val", timeout=60, options=options) as src:
        for images, meta in src.epoch():
            ledger.write(" ".join(str(check([images[k], meta[k]])) for k in range(len(meta)))
                         + "\\n")
            time.sleep(0.02)  # a model step
        ledger.write("END\\n")
""")


def test_one_of_two_consumers_killed_the_other_gets_its_share(broker_proc, daemons, endpoints,
                                                               tmp_path):
    """The union of what the consumers took is the epoch exactly once. A killed consumer's
    last batch is unconfirmed until its TAKEN arrives: if it had not, the broker serves it
    again (then another consumer has it) and it is not counted for the dead one; if it had,
    nobody else gets it."""
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1, delay=0.002)
    ledgers = [tmp_path / f"ledger-{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", CONSUMER, endpoints.egress, str(led),
                               str(ROOT)], stderr=subprocess.DEVNULL) for led in ledgers]
    try:
        for i in range(2):
            producer(daemons, cfg, endpoints.ingress, f"p{i}")
        wait_for(lambda: ledgers[0].exists() and len(ledgers[0].read_text().split()) >= 12,
                 30, what="consumer 0 under way")
        procs[0].kill()
        procs[0].wait(10)
        wait_for(lambda: ledgers[1].exists() and "END" in ledgers[1].read_text(), 60,
                 what="consumer 1 to finish the epoch")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    dead = [ln.split() for ln in ledgers[0].read_text().splitlines() if ln != "END"]
    alive = [int(x) for ln in ledgers[1].read_text().splitlines() if ln != "END"
             for x in ln.split()]
    taken = [int(x) for batch in dead[:-1] for x in batch]
    last = [int(x) for x in dead[-1]] if dead else []
    if not set(last) & set(alive):
        taken += last  # its TAKEN arrived: nobody else was given it
    ids = sorted(taken + alive)
    assert ids == list(range(N)), (set(range(N)) - set(ids),
                                   [i for i in set(ids) if ids.count(i) > 1])


def test_a_trainer_resumes_from_its_cursor(broker_proc, daemons, endpoints, tmp_path):
    """Take some batches, save the cursor (a checkpoint), take more (lost with the process
    that took them), then a new consumer resumes from the saved cursor: what the checkpoint
    had and what the new one takes are the epoch exactly once."""
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, epochs=1)
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}")
    before: list[tuple[int, bytes]] = []
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as src:
        it = src.epoch()
        for batch in itertools.islice(it, 7):
            before += samples(batch)
        saved = src.state().encode()  # the checkpoint
        for _ in itertools.islice(it, 5):
            pass  # taken after the checkpoint: the process "dies" with them
    after: list[tuple[int, bytes]] = []
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=30, return_meta=True, resume=saved,
                       options=ConsumerOptions(link=FAST)) as src:
        for batch in src.epoch():
            after += samples(batch)
        assert src.state().count() == -(-N // BATCH)
    assert_exactly_once(before + after, cfg, 0)


def test_exact_pipelines_refuse_what_cannot_be_exact(tmp_path):
    from feedline.producer.pipeline import ConfigError

    base = yaml.safe_load(pipeline(tmp_path).read_text())
    bad = [({"shard": {"index": 0, "count": 2}}, "shard"),
           ({"steps": [{"batch": {"batch_size": 4}}, {"map": {"function": "builtins:id"}}]},
            "last step"),
           ({"steps": [{"local_shuffle": {"buffer_size": 4}}]}, "local_shuffle"),
           ({"source": {"generator": {"function": "builtins:iter"}}}, "generator")]
    for change, words in bad:
        with pytest.raises(ConfigError, match=words):
            build_exact({**base, **change})


def test_a_unit_started_in_the_middle_reads_nothing_before_it(tmp_path):
    pipe = build_exact(yaml.safe_load(pipeline(tmp_path).read_text()))
    read: list[int] = []
    real = pipe.source.sample
    pipe.source.sample = lambda i: (read.append(i), real(i))[1]  # type: ignore[method-assign]
    got = list(pipe.batches(0, 1, start=3))
    assert [j for j, _ in got] == [3]
    assert len(read) == BATCH, "only the samples of batch 3"
    whole = dict(pipe.batches(0, 1))
    assert np.array_equal(whole[3][0], got[0][1][0])
