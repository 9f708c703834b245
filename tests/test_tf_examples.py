"""The training examples run against a live broker and producer, as a user would run them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT

pytestmark = pytest.mark.tf


@pytest.mark.parametrize("script", ["train_loop.py", "train_keras.py"])
def test_example_trains_from_a_live_broker(script, broker_proc, daemons, endpoints, tmp_path):
    pytest.importorskip("tensorflow")
    broker_proc()
    cfg = tmp_path / "fake.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [[8, 32, 32, 3], [8]], "dtypes": ["uint8", "int32"], "random": True,
        "size": 1000}}}))  # random int32 labels in [0, 1): a valid class index
    daemons("producer", "--config", cfg, "--broker", endpoints.ingress, name="producer")
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
