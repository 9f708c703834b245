"""A new user's first hour, as the README and the docs have them run it: `feedline broker`,
`feedline producer --config FILE`, `feedline convert`, `python3 -m http.server`, a training
script with `RemoteDataZMQ`, each a process of its own on 127.0.0.1, and what each prints
checked as a user would read it.

The scenes are the first-use findings that made the README's promises fail (issue 53's
table in docs/reliability.md): a stream left behind by an earlier producer, shards behind a
server without byte ranges, an exact run of two producers (and the next run), a trainer
started before and after its producers, an address typed without its scheme. Each scene is
bounded by its own timeouts and stops every process it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from feedline.procs import Child, free_port, wait_for
from feedline.scrape import scrape
from tests.support import ROOT, tcp_ready

LIVENESS = ["--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5"]
ENV = {"PYTHONPATH": str(ROOT)}


class World:
    """The processes of one scene, in ``cwd``; :meth:`close` stops them all."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.children: list[Child] = []
        self.metrics = 0

    def feedline(self, name: str, *argv: str) -> Child:
        child = Child([sys.executable, "-m", "feedline.commands", *argv],
                      self.cwd / f"{name}.log", env=ENV, cwd=self.cwd)
        self.children.append(child)
        return child

    def broker(self, *extra: str) -> tuple[str, str]:
        """A broker as the README starts it (loopback, so no keys): (ingress, egress); its
        metrics on :attr:`metrics`."""
        port, self.metrics = free_port(), free_port()
        ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{self.cwd}/feedline.sock"
        b = self.feedline("broker", "broker", "--ingress", ingress, "--egress", egress,
                          "--metrics-port", str(self.metrics), *LIVENESS, *extra)
        wait_for(lambda: tcp_ready(port) or not b.alive(), 30, what="the broker")
        assert b.alive(), b.log_text()
        return ingress, egress

    def trainer(self, name: str, code: str) -> Child:
        """A training script (the docs' loop, given its address), run as `python3 SCRIPT`."""
        script = self.cwd / f"{name}.py"
        script.write_text(textwrap.dedent(code))
        child = Child([sys.executable, str(script)], self.cwd / f"{name}.log", env=ENV,
                      cwd=self.cwd)
        self.children.append(child)
        return child

    def close(self) -> None:
        for c in reversed(self.children):
            c.stop()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path)
    try:
        yield w
    finally:
        w.close()


def exited(child: Child, timeout: float) -> int:
    wait_for(lambda: not child.alive(), timeout, what=f"{child.argv[-1]} to exit")
    code = child.proc.poll()
    assert code is not None
    return code


def last_line(child: Child) -> str:
    lines = [ln for ln in child.log_text().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def noisy_photos(root: Path, count: int) -> None:
    """An image folder of two classes whose JPEGs hardly compress (noise), 640x480."""
    rng = np.random.default_rng(0)
    for i in range(count):
        d = root / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        img = rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)
        ok, enc = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        assert ok
        (d / f"{i:04d}.jpg").write_bytes(enc.tobytes())


def pipeline(path: Path, spec: dict) -> str:
    path.write_text(yaml.safe_dump(spec))
    return str(path)


FAKE = {"source": {"fake": {"shapes": [[4, 8]], "dtypes": ["uint8"], "random": False,
                            "size": 64}}}


def test_a_stream_left_behind_does_not_starve_the_one_a_user_reads(world: World) -> None:
    """Yesterday's producer served stream `idle`, nobody read it, it was stopped; today's
    producer of 2.4 MB batches serves `train` and the user's trainer reads it. Before: 0
    batches in 40 s, for as long as the broker ran."""
    ingress, egress = world.broker()
    idle = world.feedline("idle", "producer", "--config",
                          pipeline(world.cwd / "idle.yaml", {**FAKE, "stream": "idle"}),
                          "--broker", ingress, *LIVENESS)
    wait_for(lambda: scrape(world.metrics, timeout=2.0).total(
        "feedline_broker_stream_buffer_batches", stream="idle") >= 100 or not idle.alive(),
        60, what="the broker to hold 100 batches of stream idle")
    assert idle.alive(), idle.log_text()
    assert idle.stop() == 0  # Ctrl-C: it says goodbye, its batches stay with the broker
    big = {"stream": "train", "source": {"fake": {"shapes": [[800, 1000, 3]],
                                                   "dtypes": ["uint8"], "size": 8}}}
    world.feedline("train", "producer", "--config", pipeline(world.cwd / "train.yaml", big),
                   "--broker", ingress, *LIVENESS)
    trainer = world.trainer("trainer", f"""
        from feedline import RemoteDataZMQ
        n = 0
        for (images,) in RemoteDataZMQ({egress!r}, stream="train", timeout=60):
            assert images.shape == (800, 1000, 3), images.shape
            n += 1
            if n == 20:
                break
        print("took", n, "batches of stream train")
    """)
    assert exited(trainer, 120) == 0, trainer.log_text()
    assert "took 20 batches of stream train" in trainer.log_text()


def test_shards_behind_a_server_without_byte_ranges_are_served(world: World) -> None:
    """`feedline convert` an image folder to WebDataset shards over 2 MiB, serve them with
    `python3 -m http.server` (no byte ranges), train on them, shards claimed from the
    broker, for one epoch. Before: each shard failed at its second 2 MiB, the producer spun
    through epochs of claims, ~100 GETs and WARNING lines a second, for ever, serving the
    first chunks only. Now every sample comes, once, and the producer says once why it
    reads the shards as streams."""
    images = world.cwd / "images"
    noisy_photos(images, count=24)  # ~250 KB each
    out = world.cwd / "shards"
    r = subprocess.run([sys.executable, "-m", "feedline.commands", "convert", str(images),
                        str(out), "--shard-size", "3000000", "--no-progress"],
                       cwd=world.cwd, env={**os.environ, **ENV}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    tars = sorted(out.glob("shard-*.tar"))
    assert sum(t.stat().st_size > (2 << 20) for t in tars) >= 2, \
        [t.stat().st_size for t in tars]  # larger than a request (2 MiB): ranges needed
    port = free_port()
    server = Child([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                    "--directory", str(out)], world.cwd / "http.log", cwd=world.cwd)
    world.children.append(server)
    wait_for(lambda: tcp_ready(port), 30, what="http.server")
    ingress, egress = world.broker()
    spec = {"stream": "train", "epochs": 1,
            "source": {"webdataset": {
                "urls": f"http://127.0.0.1:{port}/shard-{{000000..{len(tars) - 1:06d}}}.tar",
                "fields": ["jpg", "cls"]}},
            "steps": [{"imagenet_train": {"size": 64}}, {"batch": {"batch_size": 4}}]}
    producer = world.feedline("producer", "producer", "--config",
                              pipeline(world.cwd / "shards.yaml", spec), "--broker", ingress,
                              *LIVENESS)
    trainer = world.trainer("trainer", f"""
        from feedline import RemoteDataZMQ
        n = 0
        for images, labels in RemoteDataZMQ({egress!r}, stream="train", timeout=60):
            assert images.shape == (4, 64, 64, 3), images.shape
            n += len(labels)
            if n == 24:
                break
        print("took", n, "images")
    """)
    assert exited(trainer, 120) == 0, trainer.log_text()
    assert "took 24 images" in trainer.log_text()
    assert exited(producer, 60) == 0, producer.log_text()[-2000:]
    said = producer.log_text()
    assert "answers no byte ranges" in said, said[-2000:]
    assert "skipped" not in said and "Traceback" not in said, said[-2000:]


EXACT = {"stream": "val", "delivery": "exact", "exact": {"unit_size": 8}, "seed": 0,
         "source": {"list": {"items": [[i] for i in range(80)]}},
         "steps": [{"batch": {"batch_size": 4}}], "epochs": 1}


def test_an_exact_run_of_two_producers_ends_and_the_next_run_is_served(world: World) -> None:
    """pipelines.md's exact delivery: two producers, `epochs: 1`, a trainer reading
    `remote.epoch()` started before them; then the next job: the same producers started
    again, a trainer started after them. Before: the epoch arrived once, but a producer
    was still running 30 s later, buffering an epoch nobody asked for; then, 1 run in 3
    under load, a producer that registered after the other had served the whole epoch and
    the trainer had left began a run nobody asked for and waited for ever (the race made
    certain: tests/exact/test_run_lifetimes.py::
    test_a_late_producer_of_a_served_run_ends_with_it_after_its_trainer_left)."""
    ingress, egress = world.broker("--state-dir", str(world.cwd / "state"))
    config = pipeline(world.cwd / "val.yaml", EXACT)
    read_epoch = f"""
        import numpy as np
        from feedline import RemoteDataZMQ
        remote = RemoteDataZMQ({egress!r}, stream="val", timeout=60)
        seen = [int(x) for (ids,) in remote.epoch() for x in np.asarray(ids).ravel()]
        remote.close()
        print("epoch:", len(seen), "samples,", len(set(seen)), "distinct")
    """
    for run in ("first", "next"):
        before = world.trainer(f"trainer-{run}", read_epoch) if run == "first" else None
        producers = [world.feedline(f"{run}-{k}", "producer", "--config", config,
                                    "--broker", ingress, *LIVENESS) for k in range(2)]
        trainer = before or world.trainer(f"trainer-{run}", read_epoch)
        assert exited(trainer, 90) == 0, trainer.log_text()
        assert "epoch: 80 samples, 80 distinct" in trainer.log_text(), trainer.log_text()
        for p in producers:  # both end with the run: nobody buffers an epoch not asked for
            assert exited(p, 30) == 0, p.log_text()[-2000:]
            assert "Traceback" not in p.log_text()


def test_a_trainer_started_before_and_after_its_producers_gets_the_stream(
        world: World) -> None:
    """The README's order and the other one: a trainer waiting for producers that come
    later, and a trainer joining producers that run already; both read the same pipeline's
    batches."""
    ingress, egress = world.broker()
    loop = f"""
        import numpy as np
        from feedline import RemoteDataZMQ
        n = 0
        for (x,) in RemoteDataZMQ({egress!r}, timeout=60):
            assert x.shape == (4, 8) and x.dtype == np.uint8, (x.shape, x.dtype)
            n += 1
            if n == 10:
                break
        print("took", n)
    """
    early = world.trainer("early", loop)
    world.feedline("producer", "producer", "--config",
                   pipeline(world.cwd / "fake.yaml", FAKE), "--broker", ingress, *LIVENESS)
    assert exited(early, 90) == 0, early.log_text()
    late = world.trainer("late", loop)
    assert exited(late, 90) == 0, late.log_text()
    assert "took 10" in early.log_text() and "took 10" in late.log_text()


def test_an_address_typed_without_its_scheme_is_one_line(world: World) -> None:
    """`RemoteDataZMQ("127.0.0.1:7879")`: before, a raw ZMQError after 20 frames of
    traceback; the message a user gets names the scheme to add."""
    t = world.trainer("trainer", """
        from feedline import RemoteDataZMQ
        try:
            RemoteDataZMQ("127.0.0.1:7879", timeout=5)
        except ValueError as e:
            print("error:", e)
    """)
    assert exited(t, 60) == 0, t.log_text()
    said = t.log_text()
    assert said.count("\n") == 1 and "error:" in said and "tcp://" in said, said


def test_a_producer_with_no_broker_says_it_never_connected(world: World) -> None:
    """A wrong port: before, "silent for 5.0s" once, then nothing, and "sent 2 batches"
    at exit though no broker ever existed."""
    port = free_port()
    p = world.feedline("producer", "producer", "--config",
                       pipeline(world.cwd / "fake.yaml", FAKE),
                       "--broker", f"tcp://127.0.0.1:{port}", *LIVENESS)
    wait_for(lambda: p.log_text().count("never connected") >= 2, 60,
             what="the producer to say twice that it never connected")
    assert f"127.0.0.1:{port}" in p.log_text()
    p.stop()
    assert "sent 0 batches" in p.log_text(), p.log_text()[-1500:]
    assert "Traceback" not in p.log_text()
