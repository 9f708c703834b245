"""A producer's memory while it streams a 1 GiB shard over HTTP stays within the stated
bound, ``read_ahead * ((prefetch + 2) * chunk_size + max_sample_bytes)``, not the shard's
size: measured as the reading process's RSS above its level before the shard."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tests.support import ROOT
from tests.support.shard_server import file_server

MIB = 1 << 20
SLACK = 48 * MIB  # allocator arenas, the HTTP client's buffers, Python's own objects

READER = r"""
import json, sys, threading, psutil
from feedline.producer.dataflow.webdataset import WebDataset
url, small = sys.argv[1], sys.argv[2]
kw = dict(fields=["bin", "cls"], chunk_size=4 << 20, prefetch=2, read_ahead=1,
          max_sample_bytes=2 << 20, shuffle=False)
warm = WebDataset(small, **kw)  # the same code paths once, on a small shard: the baseline
warm.reset_state()
list(warm)
proc = psutil.Process()
base = proc.memory_info().rss
peak = [base]
stop = threading.Event()
def watch():
    while not stop.wait(0.005):
        peak[0] = max(peak[0], proc.memory_info().rss)
threading.Thread(target=watch, daemon=True).start()
ds = WebDataset(url, **kw)
ds.reset_state()
n = 0
check = 0
for data, label in ds:
    n += 1
    check += int(data[8]) + int(label)
stop.set()
print(json.dumps({"base": base, "peak": peak[0], "n": n, "check": check,
                  "bound": ds.memory_bound(), "bytes": ds.stats.bytes_read}))
"""


def write_shard(path: Path, members: int, size: int, seed: int = 0) -> int:
    block = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    check = 0
    with tarfile.open(path, "w") as t:
        for i in range(members):
            block[8] = i % 251
            check += i % 251 + i
            for ext, data in (("bin", block.tobytes()), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return check


@pytest.mark.slow
def test_rss_while_streaming_a_1gib_shard_stays_within_the_bound(tmp_path: Path):
    check = write_shard(tmp_path / "big.tar", members=1024, size=MIB)  # 1 GiB and headers
    write_shard(tmp_path / "small.tar", members=8, size=MIB, seed=1)
    assert (tmp_path / "big.tar").stat().st_size > 1 << 30
    with file_server(str(tmp_path)) as url:
        r = subprocess.run([sys.executable, "-c", READER, f"{url}/big.tar", f"{url}/small.tar"],
                           capture_output=True, text=True, cwd=ROOT, timeout=240,
                           env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["n"] == 1024 and got["check"] == check
    assert got["bytes"] >= 1 << 30
    grew = got["peak"] - got["base"]
    print(f"RSS grew {grew / MIB:.1f} MiB while streaming 1 GiB; bound "
          f"{got['bound'] / MIB:.0f} MiB + {SLACK / MIB:.0f} MiB slack")
    assert grew <= got["bound"] + SLACK, (grew / MIB, got["bound"] / MIB)


MANY = r"""
import json, sys, threading, psutil
from feedline.producer.dataflow.webdataset import WebDataset
path, small, spec = sys.argv[1], sys.argv[2], sys.argv[3]
kw = dict(fields=[spec, "cls"], chunk_size=1 << 20, prefetch=1, read_ahead=1,
          max_sample_bytes=2 << 20, shuffle=False)
warm = WebDataset(small, **kw)
warm.reset_state()
list(warm)
proc = psutil.Process()
base = proc.memory_info().rss
peak = [base]
stop = threading.Event()
def watch():
    while not stop.wait(0.002):
        peak[0] = max(peak[0], proc.memory_info().rss)
threading.Thread(target=watch, daemon=True).start()
ds = WebDataset(path, **kw)
ds.reset_state()
labels = [int(label) for _, label in ds]
stop.set()
print(json.dumps({"base": base, "peak": peak[0], "labels": labels,
                  "corrupt": list(ds.stats.corrupt), "bound": ds.memory_bound()}))
"""
MEMBERS = 160


def write_many(path: Path, members: int, size: int) -> None:
    """Sample 0 small; sample 1 (key ``big``) ``members`` members of ``size`` bytes, each its
    own extension (``e000``...); sample 2 small."""
    block = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    with tarfile.open(path, "w") as t:
        for key, exts in (("a", ["e000"]), ("big", [f"e{i:03d}" for i in range(members)]),
                          ("c", ["e000"])):
            for ext in exts:
                data = block if key == "big" else b"small"
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            info = tarfile.TarInfo(f"{key}.cls")
            label = b"%d" % "a big c".split().index(key)
            info.size = len(label)
            t.addfile(info, io.BytesIO(label))


@pytest.mark.parametrize("asked", ["one field", "every field"])
def test_many_members_under_one_key_hold_at_most_max_sample_bytes(tmp_path: Path, asked):
    """Issue 53, finding 8: 160 members of 1 MiB under one key (each under max_sample_bytes)
    grew the producer's RSS by 156 MiB against a bound of 5 MiB, fields not asked for
    included. Now members not asked for are skipped unread (the sample is served), and a
    sample whose asked-for fields pass max_sample_bytes is one corrupt record: RSS within
    the bound either way."""
    write_many(tmp_path / "many.tar", MEMBERS, MIB)
    write_many(tmp_path / "small.tar", 3, 1000)
    spec = "e000" if asked == "one field" else ";".join(f"e{i:03d}" for i in range(MEMBERS))
    r = subprocess.run([sys.executable, "-c", MANY, str(tmp_path / "many.tar"),
                        str(tmp_path / "small.tar"), spec], capture_output=True, text=True,
                       cwd=ROOT, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if asked == "one field":
        assert got["labels"] == [0, 1, 2] and got["corrupt"] == []
    else:
        assert got["labels"] == [0, 2]
        assert got["corrupt"] == [f"{tmp_path}/many.tar#big"]
    grew = got["peak"] - got["base"]
    print(f"{asked}: RSS grew {grew / MIB:.1f} MiB over {MEMBERS} x 1 MiB under one key; "
          f"bound {got['bound'] / MIB:.0f} MiB + {MANY_SLACK / MIB:.0f} MiB slack")
    assert got["bound"] == 5 * MIB
    assert grew <= got["bound"] + MANY_SLACK, (grew / MIB, got["bound"] / MIB)


MANY_SLACK = 24 * MIB  # a local file: no HTTP client; the allocator and Python's objects
