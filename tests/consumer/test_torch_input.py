"""PyTorch input from a real broker and producers: zero-copy tensors, DataLoader, a model that
learns, the prefetcher's staging path, DataLoader workers, two torch.distributed ranks, and the
Python blocks of docs/pytorch.md."""

from __future__ import annotations

import collections
import gc
import itertools
import json
import logging
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch", reason="PyTorch is not installed: pip install '.[torch]'")

from torch.utils.data import DataLoader  # noqa: E402

from feedline.consumer import (  # noqa: E402
    ConsumerOptions,
    CudaPrefetcher,
    RemoteDataZMQ,
    RemoteTorchDataset,
    to_torch,
)
from feedline.consumer.torch_input import default_consumer_id  # noqa: E402
from feedline.consumer.torch_prefetch import _prefetch, _Staging  # noqa: E402
from feedline.producer import send_dataflow  # noqa: E402
from feedline.transport.link import LinkConfig  # noqa: E402
from tests.support import ROOT  # noqa: E402

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def _numbered(n: int) -> list[dict]:
    """Batches that say their index, in a nested dict: x[i] == i, y == i, a str and an int."""
    return [{"x": np.full((8, 4), i, np.float32), "pair": [np.arange(3) + i, np.int64(i)],
             "name": f"b{i}", "i": i} for i in range(n)]


def _send(data: list, addr: str, pid: str = "p1") -> threading.Thread:
    t = threading.Thread(target=send_dataflow, args=(data, addr),
                         kwargs={"epochs": 1, "producer_id": pid, "link": FAST}, daemon=True)
    t.start()
    return t


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


# ---------------------------------------------------------------------------- conversion


def test_import_consumer_does_not_import_torch():
    code = "import sys, consumer; assert 'torch' not in sys.modules; consumer.RemoteDataZMQ"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_to_torch_keeps_structure_and_leaves():
    Point = collections.namedtuple("Point", "a b")
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([True, False])
    out = to_torch({"t": (a, [b, "s"]), "p": Point(a, 7), "n": None, "s": np.float64(2.5)})
    assert isinstance(out["t"], tuple) and isinstance(out["t"][1], list)
    assert isinstance(out["p"], Point) and out["p"].b == 7
    assert out["t"][1][1] == "s" and out["n"] is None
    assert out["t"][0].data_ptr() == _address(a) and out["t"][1][0].dtype == torch.bool
    assert out["s"].shape == () and out["s"].item() == 2.5


def test_copy_true_owns_its_memory_and_swapped_bytes_are_converted():
    a = np.arange(4, dtype=np.int32)
    c = to_torch([a], copy=True)[0]
    assert c.data_ptr() != _address(a) and c.tolist() == [0, 1, 2, 3]
    c.add_(1)
    assert a.tolist() == [0, 1, 2, 3]
    assert to_torch(a.astype(">f4")).tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(TypeError, match=r"batch\[0\]\['q'\].*float128"):
        to_torch([{"q": np.zeros(2, np.longdouble)}])


def test_a_read_only_array_converts_without_a_copy_and_without_the_warning():
    """A fresh process (PyTorch warns once per process), warnings as errors."""
    code = textwrap.dedent("""
        import numpy as np
        from feedline.consumer import to_torch
        a = np.frombuffer(bytes(range(16)), np.uint8)
        assert not a.flags.writeable
        t = to_torch({"a": a})["a"]
        assert t.data_ptr() == a.__array_interface__["data"][0] and t[15] == 15
    """)
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, cwd=ROOT,
                   timeout=60)


# ------------------------------------------------------------------- from a live broker


def test_tensors_share_memory_with_the_received_frames(thread_broker, endpoints):
    thread_broker()
    _send(_numbered(40), endpoints.ingress)
    with RemoteDataZMQ(endpoints.egress, timeout=30, return_meta=True,
                       options=ConsumerOptions(link=FAST)) as remote:
        kept = None
        for k, batch in enumerate(itertools.islice(remote, 40)):
            dp = batch.datapoint
            out = to_torch(dp)
            i = out["i"]
            assert out["x"].data_ptr() == _address(dp["x"])  # the frame's memory: no copy
            assert out["pair"][0].data_ptr() == _address(dp["pair"][0])
            assert out["name"] == f"b{i}" and out["pair"][1].item() == i
            assert bool((out["x"] == i).all()) and batch.producer == "p1"
            if k == 0:
                kept = out["x"]  # the only reference left to batch 0's frame
            del dp, out, batch
    gc.collect()  # 39 batches received and freed since: their memory was reused
    assert kept is not None and bool((kept == 0).all()) and kept.shape == (8, 4)


def test_dataloader_yields_tensor_batches_in_their_structure(thread_broker, endpoints):
    thread_broker()
    _send(_numbered(20), endpoints.ingress)
    ds = RemoteTorchDataset(endpoints.egress, timeout=30, options=ConsumerOptions(link=FAST))
    seen = []
    for b in itertools.islice(DataLoader(ds, batch_size=None), 20):
        assert isinstance(b["x"], torch.Tensor) and b["x"].shape == (8, 4)
        assert isinstance(b["pair"], list) and b["name"] == f"b{b['i']}"
        seen.append(b["i"])
    assert sorted(seen) == list(range(20))


def test_return_meta_gives_batches_with_tensors(thread_broker, endpoints):
    thread_broker()
    _send(_numbered(3), endpoints.ingress, pid="meta")
    ds = RemoteTorchDataset(endpoints.egress, timeout=30, return_meta=True,
                            options=ConsumerOptions(link=FAST))
    for b in itertools.islice(ds, 3):
        assert b.producer == "meta" and b.epoch == 0
        assert isinstance(b.datapoint["x"], torch.Tensor)


def _linear_task(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """y = x @ w + noise: learnable by one linear layer."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 1)).astype(np.float32)
    out = []
    for _ in range(n):
        x = rng.normal(size=(32, 8)).astype(np.float32)
        out.append((x, x @ w + 0.01 * rng.normal(size=(32, 1)).astype(np.float32)))
    return out


def test_a_model_learns_from_the_stream(thread_broker, endpoints):
    thread_broker()
    _send(_linear_task(60), endpoints.ingress)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(RemoteTorchDataset(endpoints.egress, timeout=30,
                                           options=ConsumerOptions(link=FAST)),
                        batch_size=None)
    losses = []
    for x, y in itertools.islice(CudaPrefetcher(loader, depth=2), 60):  # CPU: pass-through
        assert isinstance(x, torch.Tensor) and x.shape == (32, 8)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert len(losses) == 60
    assert np.mean(losses[-5:]) < 0.05 * np.mean(losses[:5]), losses


# -------------------------------------------------------------------------- prefetcher


def test_prefetcher_without_cuda_passes_batches_through_zero_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    (out,) = list(CudaPrefetcher([{"a": a}], device="cpu"))
    assert out["a"].data_ptr() == _address(a)
    with pytest.raises(ValueError, match="depth"):
        CudaPrefetcher([], depth=0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            CudaPrefetcher([], device="cuda")


class _Counted:
    """An iterable that counts what was taken from it (how far ahead the prefetcher reads)."""

    def __init__(self, items: Iterable) -> None:
        self.items, self.taken = items, 0

    def __iter__(self) -> Iterator:
        for item in self.items:
            self.taken += 1
            yield item


def test_staging_path_on_the_cpu(thread_broker, endpoints):
    """The CUDA code path with PyTorch's CPU stand-ins for streams and events (no pinning)."""
    thread_broker()
    shapes = [(8, 4)] * 6 + [(2, 2)] * 4  # a layout change half way
    _send([[np.full(s, i, np.float32), np.int64(i)] for i, s in enumerate(shapes)],
          endpoints.ingress)
    with RemoteDataZMQ(endpoints.egress, timeout=30, options=ConsumerOptions(link=FAST)) as remote:
        frames = _Counted(itertools.islice(remote, len(shapes)))
        staging = _Staging(torch.device("cpu"), slots=3)
        depth, buffers = 2, []
        for k, batch in enumerate(_prefetch(iter(frames), staging, depth)):
            x, i = batch
            assert i.item() == k and x.shape == shapes[k] and bool((x == k).all())
            assert frames.taken <= k + 1 + depth  # a bounded read-ahead
            buffers.append([b.data_ptr() for s in staging.slots for b in s.buffers[:1]])
            for s in staging.slots:  # the batch is never a staging buffer
                assert all(b.data_ptr() != x.data_ptr() for b in s.buffers)
    assert k == len(shapes) - 1
    assert buffers[2] == buffers[3]  # same layout: the slots' buffers are reused
    assert buffers[4][0] != buffers[3][0] and buffers[4][1:] == buffers[3][1:]  # (2, 2) in 0
    assert all(b.shape == (2, 2) for s in staging.slots for b in s.buffers[:1])


@needs_cuda
def test_prefetcher_on_cuda_stages_through_pinned_buffers(thread_broker, endpoints):
    thread_broker()
    _send(_linear_task(40), endpoints.ingress)
    model = torch.nn.Linear(8, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(RemoteTorchDataset(endpoints.egress, timeout=30,
                                           options=ConsumerOptions(link=FAST)),
                        batch_size=None)
    prefetcher = CudaPrefetcher(loader, device="cuda", depth=3)
    losses = []
    for x, y in itertools.islice(prefetcher, 40):
        assert x.is_cuda and y.is_cuda
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < 0.05 * np.mean(losses[:5]), losses
    staging = _Staging(torch.device("cuda"), slots=2)
    out, event = staging.issue([np.arange(5, dtype=np.float32)])
    assert staging.slots[0].buffers[0].is_pinned()
    assert staging.hand_over(out, event)[0].cpu().tolist() == [0, 1, 2, 3, 4]


def test_the_dataset_takes_options_and_warns_at_the_callers_line_for_old_keywords():
    nowhere = "ipc:///tmp/feedline-torch-options-nobody.sock"  # never iterated
    with pytest.warns(DeprecationWarning) as record:
        old = RemoteTorchDataset(nowhere, timeout=5, window=2)
    (w,) = record
    assert w.filename == __file__ and str(w.message).startswith(
        "RemoteTorchDataset(window=...) is deprecated"), (w.filename, str(w.message))
    assert old.options == ConsumerOptions(window=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'windw'"):
        RemoteTorchDataset(nowhere, windw=2)
    ds = RemoteTorchDataset(nowhere, timeout=5, stream="val", options=ConsumerOptions(window=2))
    with ds.connect() as remote:  # what each iterator opens: the options, its own name
        assert remote.options == ConsumerOptions(window=2, consumer_id=default_consumer_id())
        assert (remote.timeout, remote.config.stream) == (5, "val")


# ------------------------------------------------------------------ workers and ranks


def test_each_dataloader_worker_gets_its_own_share(thread_broker, endpoints, caplog):
    thread_broker()
    _send(_numbered(30), endpoints.ingress)
    caplog.set_level(logging.INFO, logger="feedline.broker")
    ds = RemoteTorchDataset(endpoints.egress, timeout=10,
                            options=ConsumerOptions(link=FAST, window=2))
    it = iter(DataLoader(ds, batch_size=None, num_workers=2, in_order=False))
    seen = [next(it)["i"] for _ in range(30)]
    del it  # stops the workers (their connections close)
    assert sorted(seen) == list(range(30))  # every batch once: none twice
    joined = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert any("-worker0 " in m for m in joined) and any("-worker1 " in m for m in joined)


RANK = """
import json, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from feedline.consumer import ConsumerOptions, RemoteTorchDataset
from feedline.consumer.torch_input import default_consumer_id
from feedline.errors import ReceiveTimeout
from feedline.transport.link import LinkConfig

rank, init, egress, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
fast = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
ds = RemoteTorchDataset(egress, timeout=3, options=ConsumerOptions(window=2, link=fast))
it = iter(DataLoader(ds, batch_size=None))
got = [int(next(it)[1][0])]
dist.barrier()  # both ranks hold a connection and a batch: the rest is shared
try:
    for x, y in it:
        got.append(int(y[0]))
except ReceiveTimeout:  # the producer sent all it had
    pass
counts = [None, None]
dist.all_gather_object(counts, len(got))
json.dump({"got": got, "counts": counts, "id": default_consumer_id()}, open(out, "w"))
dist.destroy_process_group()
"""


def test_two_ranks_share_the_stream_without_overlap(thread_broker, endpoints, tmp_path,
                                                     caplog):
    thread_broker()
    caplog.set_level(logging.INFO, logger="feedline.broker")
    # More than a rank's window holds (2, counted by bytes: 256 of these), so that the rank
    # that registers first cannot take them all before the other registers.
    n = 600
    _send([(np.full((4, 4), i, np.float32), np.full(4, i, np.int64)) for i in range(n)],
          endpoints.ingress)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    init = f"file://{tmp_path}/store"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), init, endpoints.egress,
                               str(tmp_path / f"rank{r}.json")], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        assert p.returncode == 0, err[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    got0, got1 = results[0]["got"], results[1]["got"]
    assert got0 and got1, "each rank receives batches"
    assert not set(got0) & set(got1), "no batch seen by both ranks"
    assert sorted(got0 + got1) == list(range(n)), "the union is what the producer sent"
    assert results[0]["counts"] == [len(got0), len(got1)] == results[1]["counts"]
    assert results[0]["id"].endswith("-rank0") and results[1]["id"].endswith("-rank1")
    joined = " ".join(r.getMessage() for r in caplog.records if "joined" in r.getMessage())
    assert f"{results[0]['id']} joined" in joined and f"{results[1]['id']} joined" in joined


# --------------------------------------------------------------------------------- docs


def _doc_blocks(path: Path) -> list[tuple[str, str, str]]:
    """(marker, language, code) for each fenced block; the marker is an HTML comment above."""
    pattern = r"(?:<!-- (.+?) -->\n)?```(\w*)\n(.*?)```"
    return re.findall(pattern, path.read_text(), flags=re.S)


def test_docs_python_blocks_run_against_a_live_broker(broker_proc, daemons, endpoints,
                                                      tmp_path):
    blocks = _doc_blocks(ROOT / "docs" / "pytorch.md")
    for marker, lang, _ in blocks:  # every block runs here, or the page says why not
        assert lang == "python" or marker.startswith("not run:"), (lang, marker)
    session = [c for m, lang, c in blocks if lang == "python" and not m]
    ranks = [c for m, lang, c in blocks if lang == "python" and m == "run: torchrun 2"]
    assert len(session) == 3 and len(ranks) == 1
    broker_proc()
    cfg = tmp_path / "fake.yaml"
    cfg.write_text(yaml.safe_dump({"source": {"fake": {
        "shapes": [[8, 32, 32, 3], [8]], "dtypes": ["uint8", "int32"], "random": True,
        "size": 1000}}}))
    daemons("feedline.producer", "--config", cfg, "--broker", endpoints.ingress, name="producer")

    def run(code: str, name: str, *launcher: str) -> str:
        script = tmp_path / name
        script.write_text(code.replace("ipc:///tmp/feedline.sock", endpoints.egress))
        out = subprocess.run([sys.executable, *launcher, str(script)], cwd=ROOT, timeout=240,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        return out.stdout

    assert "final loss" in run("\n".join(session), "session.py")
    out = run(ranks[0], "train_ddp.py", "-m", "torch.distributed.run", "--standalone",
              "--nproc-per-node", "2")
    assert "rank 0: 20 steps" in out and "rank 1: 20 steps" in out
