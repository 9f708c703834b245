"""The training examples run against a live broker and producer, as a user would run them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.support import ROOT

pytestmark = pytest.mark.tf


@pytest.mark.parametrize("script", ["train_loop.py", "train_keras.py"])
def test_example_trains_from_a_live_broker(script, broker_proc, daemons, endpoints, tmp_path):
    pytest.importorskip("tensorflow")
    broker_proc()
    cfg = tmp_path / "fake.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [[8, 32, 32, 3], [8]], "dtypes": ["uint8", "int32"], "random": True,
        "size": 1000}}}))  # random int32 labels in [0, 1): a valid class index
    daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress, name="producer")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--egress", endpoints.egress,
         "--steps", "6", "--classes", "10", "--capacity", "8", "--log-every", "3"],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "final loss" in out.stdout
    assert "-> " in out.stdout  # the bottleneck verdict


def test_example_runs_on_the_demo_dataset_without_a_broker_or_imagenet(tmp_path):
    """No --egress: the example starts its own broker and producer, which reads the demo
    dataset when this host has no /data/imagenet/train (and says so); nothing is left."""
    pytest.importorskip("tensorflow")
    if os.path.isdir("/data/imagenet/train"):
        pytest.skip("this host has ImageNet: the example would train on it")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_loop.py"), "--steps", "3",
         "--classes", "14", "--capacity", "8", "--log-every", "3"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no ImageNet at /data/imagenet/train: training on the demo dataset" in out.stdout
    assert "final loss" in out.stdout


def test_validate_counts_the_demo_set_exactly_once_with_a_producer_killed(tmp_path):
    """examples/validate.py as a user runs it on a host without ImageNet: a broker and two
    producers of imagenet_val.yaml (exact delivery) on the demo dataset, one killed half way;
    the samples counted are the dataset's, class by class."""
    pytest.importorskip("tensorflow")
    if os.path.isdir("/data/imagenet/val"):
        pytest.skip("this host has ImageNet: the example would validate on it")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "validate.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    text = out.stdout
    assert "no ImageNet at /data/imagenet/val: validating on the demo dataset" in text
    size = int(re.search(r"validation set: (\d+) images", text).group(1))  # type: ignore[union-attr]
    assert size == 512  # the demo dataset
    killed = re.search(r"^killed producer (val-\d) \(kill -9\) after (\d+) samples", text, re.M)
    assert killed, text
    assert size // 2 <= int(killed.group(2)) < size, text  # half way, not after the end
    m = re.search(r"^top-1 accuracy (\S+) over (\d+) samples \(the dataset has (\d+)\)$", text,
                  re.M)
    assert m, text
    assert 0 <= float(m.group(1)) <= 1
    assert int(m.group(2)) == int(m.group(3)) == size, text
    assert "per class: as in the dataset" in text and "every sample exactly once" in text
    assert "delivered twice" not in text
    # The kill mattered: the survivor made the rest of the victim's unit (the local broker
    # lets producers run at most 2 batches ahead of the model, a unit is 8 batches).
    assert re.search(rf"^  unit \d+ was made by .* \({killed.group(1)} was killed\)$", text,
                     re.M), text


def test_validate_against_a_running_broker(broker_proc, daemons, endpoints, tmp_path):
    """--egress: producers of imagenet_val.yaml someone else runs (here: two, on a small
    image folder); --data only tells the script what to expect. No producer of theirs is
    killed: --kill-one is refused."""
    pytest.importorskip("tensorflow")
    from tests.support.jpeg_data import make_folder

    make_folder(tmp_path / "val", classes=3, per_class=7)
    broker_proc("--state-dir", str(tmp_path / "state"))  # exact streams need one
    for i in range(2):
        daemons("feedline.producer", "--config", ROOT / "examples" / "imagenet_val.yaml", "--data",
                tmp_path / "val", "--broker", endpoints.ingress, "--id", f"p{i}",
                name=f"p{i}")
    script = [sys.executable, str(ROOT / "examples" / "validate.py"), "--egress",
              endpoints.egress, "--data", str(tmp_path / "val")]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    refused = subprocess.run([*script, "--kill-one"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert refused.returncode == 2 and "--kill-one" in refused.stderr, refused.stderr
    out = subprocess.run(script, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "over 21 samples (the dataset has 21)" in out.stdout, out.stdout
    assert "killed" not in out.stdout and "every sample exactly once" in out.stdout
