"""Resuming an exact stream from a checkpoint's cursor, as users do it (issue 22, findings
1-6): twice from the same checkpoint, from every rank with the merged cursor, from another
pipeline's cursor, from a cursor of a large dataset, in direct mode, and what a broker without
``--state-dir`` does with an exact stream. Real broker and producer processes; the consumers
are this process's ``RemoteDataZMQ`` (a job "crashes" when it closes without having saved
what it took after its checkpoint)."""

from __future__ import annotations

import random
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from feedline.consumer import RemoteDataZMQ
from feedline.errors import FeedlineError
from feedline.exact.cursor import Cursor
from feedline.procs import free_port, stop_all, wait_for
from feedline.producer.exact import build_exact
from tests.support.exact_run import (
    Seen,
    assert_exactly_once,
    pipeline,
    producer,
    remote,
    rest,
    samples,
    take,
)
from tests.support.netns import metric_sum


def start(broker_proc, daemons, endpoints, tmp_path: Path, **kw: Any) -> Path:
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = pipeline(tmp_path, **kw)
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}")
    return cfg


def test_two_resumes_from_the_same_checkpoint_lose_nothing(broker_proc, daemons, endpoints,
                                                           tmp_path):
    """Finding 1: a job that crashes twice resumes twice from the same checkpoint. Before:
    the broker ignored a resume whose token it had seen, so what the second run took after
    the checkpoint was lost (60 of 256 samples in the audit)."""
    cfg = start(broker_proc, daemons, endpoints, tmp_path, epochs=1)
    with remote(endpoints.egress) as src:
        it = src.epoch()
        before = take(it, 7)
        saved = src.state().to_dict()  # the checkpoint (plain data, as a framework keeps it)
        take(it, 5)  # taken after the checkpoint: gone with the crash
    with remote(endpoints.egress, resume=saved) as src:
        take(src.epoch(), 3)  # the first restart crashes too
    with remote(endpoints.egress, resume=saved) as src:
        after = rest(src)
    assert_exactly_once(before + after, cfg, 0)


def test_every_rank_resuming_from_the_merged_cursor_rolls_back_once(broker_proc, daemons,
                                                                     endpoints, tmp_path):
    """Finding 2: every rank merges the ranks' saved cursors (as docs/tensorflow.md says) and
    resumes from its own merged copy, the second a little after the first. Before: each merge
    made a new token, each rank rolled the epoch back (16-20 samples duplicated)."""
    cfg = start(broker_proc, daemons, endpoints, tmp_path, epochs=1)
    with remote(endpoints.egress, window=2) as a, remote(endpoints.egress, window=2) as b:
        ia, ib = a.epoch(), b.epoch()
        before = take(ia, 4) + take(ib, 4)
        saved = [a.state().encode(), b.state().encode()]  # each rank's checkpoint
        take(ia, 2)
        take(ib, 2)
    merged = [Cursor.merge(Cursor.decode(s) for s in saved) for _ in range(2)]  # per rank
    after: dict[int, Seen] = {0: [], 1: []}
    with remote(endpoints.egress, window=2, resume=merged[0]) as a:
        ia = a.epoch()
        after[0] += take(ia, 3)  # rank 0 is under way when rank 1 starts
        with remote(endpoints.egress, window=2, resume=merged[1]) as b:
            t = threading.Thread(target=lambda: after[1].extend(rest(b)))
            t.start()
            after[0] += [s for batch in ia for s in samples(batch)]
            t.join(60)
    assert_exactly_once(before + after[0] + after[1], cfg, 0)


def producers_of(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    return metric_sum(text.decode(), "feedline_broker_stream_peers", stream="val",
                      role="producer")


def test_a_cursor_of_another_pipeline_is_refused_in_one_line(broker_proc, daemons, endpoints,
                                                             tmp_path):
    """Finding 3: the pipeline changed (seed 3 -> 4, then batch size 4 -> 8) between the
    checkpoint and the restart. Before: the old cursor was applied to the new pipeline's
    units without a word (6 samples lost)."""
    port = free_port()
    broker_proc("--state-dir", str(tmp_path / "state"), "--metrics-port", str(port))
    old = pipeline(tmp_path, epochs=1)
    procs = [producer(daemons, old, endpoints.ingress, f"p{i}") for i in range(2)]
    with remote(endpoints.egress) as src:
        take(src.epoch(), 5)
        saved = src.state().encode()
    for k, change in enumerate(({"seed": 4}, {"batch": 8})):
        for p in procs:
            p.stop()
        wait_for(lambda: producers_of(port) == 0, 20, what="the producers gone")
        cfg = pipeline(tmp_path / f"changed-{k}", epochs=1, **change)
        procs = [producer(daemons, cfg, endpoints.ingress, f"q{k}{i}") for i in range(2)]
        wait_for(lambda: producers_of(port) == 2, 30, what="the new pipeline's producers")
        with remote(endpoints.egress, resume=saved) as src, \
                pytest.raises(FeedlineError, match="another pipeline") as e:
            next(iter(src.epoch()))
        assert "\n" not in str(e.value)
    # Their batches wait for credit nobody gives, and the end of a unit waits behind them:
    # SIGTERM still stops them (before, that wait ignored it until the SIGKILL).
    stop_all(procs, timeout=8)  # one SIGTERM each, then SIGKILL after 8 s
    for p in procs:
        assert p.proc.returncode == 0, p.log_text()[-2000:]


N_LARGE, UNIT_LARGE, BATCH_LARGE = 586 * 4096, 4096, 4  # 600,064 batches an epoch


def large_pipeline(tmp_path: Path) -> dict:
    return {"stream": "val", "delivery": "exact", "exact": {"unit_size": UNIT_LARGE},
            "epochs": 1, "seed": 0,
            "source": {"fake": {"shapes": [[4]], "dtypes": ["uint8"], "random": False,
                                "size": N_LARGE}},
            "steps": [{"batch": {"batch_size": BATCH_LARGE}}]}


def test_a_cursor_of_a_large_dataset_stays_small(broker_proc, daemons, endpoints, tmp_path):
    """Finding 4: a job resumes near the end of an epoch of 600,064 batches. Before: its
    cursor (a bitmap of everything taken, 73 KiB) rode in a HELLO over the 64 KiB limit: 0 of
    the 250 remaining batches, and a timeout blaming the address."""
    broker_proc("--state-dir", str(tmp_path / "state"))
    cfg = large_pipeline(tmp_path)
    path = tmp_path / "large.yaml"
    path.write_text(yaml.safe_dump(cfg))
    per_unit = UNIT_LARGE // BATCH_LARGE
    units = N_LARGE // UNIT_LARGE
    taken = {str(u): list(range(per_unit)) for u in range(units - 1)}
    taken[str(units - 1)] = list(range(per_unit - 250))
    ckpt = {"stream": "val", "epoch": 0, "taken": taken,
            "pipeline": getattr(build_exact(cfg), "fingerprint", 0)}
    producer(daemons, path, endpoints.ingress, "p0")
    with remote(endpoints.egress, resume=ckpt, timeout=60) as src:
        got = [(b.unit, b.index) for b in src.epoch()]
    assert sorted(got) == [(units - 1, i) for i in range(per_unit - 250, per_unit)]
    assert len(Cursor.from_dict(ckpt).encode()) < 64, "whole units and one run: a few bytes"


def test_a_cursor_that_cannot_fit_says_what_to_do():
    """Finding 4's other half: a cursor no registration can carry (one rank's of many: every
    batch of 600,000 at random) is refused where it is given, in one line that says to merge."""
    rng = random.Random(0)
    scattered = Cursor.from_dict({"stream": "val", "epoch": 0, "taken": {
        str(u): [i for i in range(1024) if rng.random() < 0.5] for u in range(586)}})
    assert len(scattered.encode()) > 64 * 1024  # more than a HELLO frame carries
    with pytest.raises(ValueError, match=r"Cursor\.merge") as e:
        RemoteDataZMQ("ipc:///nonexistent", stream="val", resume=scattered)
    assert "\n" not in str(e.value)


def test_direct_mode_resumes_from_its_cursor(daemons, tmp_path):
    """Finding 5: a direct-mode trainer restarted from its checkpoint. Before: ``resume=`` was
    ignored, the new trainer started the epoch again (80 samples given to the model twice)."""
    cfg = pipeline(tmp_path, epochs=1)
    addr = f"tcp://127.0.0.1:{free_port()}"
    with remote(addr, bind=True) as src:
        for i in range(2):
            producer(daemons, cfg, addr, f"p{i}")
        it = src.epoch()
        before = take(it, 7)
        saved = src.state().encode()
        take(it, 5)
    with remote(addr, bind=True, resume=saved) as src:
        after = rest(src)
    assert_exactly_once(before + after, cfg, 0)


def test_an_exact_stream_without_state_dir_is_refused_in_one_line(daemons, endpoints,
                                                                  tmp_path):
    """Finding 6: without ``--state-dir`` a broker restart silently served epoch 0 again
    (every sample twice, labelled epoch 0 both times). Now an exact producer is refused by
    such a broker, and exits with one line that names the flag."""
    b = daemons("feedline.broker", "--ingress", endpoints.ingress, "--egress", endpoints.egress,
                "--metrics-port", "0", "--heartbeat-interval", "0.2", "--heartbeat-timeout",
                "1.5", name="broker")
    cfg = pipeline(tmp_path, epochs=1)
    p = producer(daemons, cfg, endpoints.ingress, "p0")
    wait_for(lambda: not p.alive(), 30, what="the producer to give up")
    assert p.proc.returncode == 1
    last = p.log_text().strip().splitlines()[-1]
    assert "--state-dir" in last and "no_state_dir" in last, last
    assert b.alive()


def test_an_ephemeral_broker_restart_tells_the_consumer(broker_proc, daemons, endpoints,
                                                        tmp_path):
    """Finding 6, ``--exact-ephemeral``: a broker that keeps exact streams in memory only
    restarts mid-epoch. The consumer is told, in one line, that the position was lost,
    instead of being served epoch 0 again."""
    broker = broker_proc("--exact-ephemeral")
    cfg = pipeline(tmp_path, epochs=1, delay=0.01)
    for i in range(2):
        producer(daemons, cfg, endpoints.ingress, f"p{i}")
    with remote(endpoints.egress) as src, \
            pytest.raises(FeedlineError, match="lost stream 'val'.s position") as e:
        for n, _ in enumerate(src.epoch()):
            if n == 6:
                broker.kill9()
                broker = broker_proc("--exact-ephemeral")
    assert "--state-dir" in str(e.value) and "\n" not in str(e.value)
