"""Hostile manifests and shards rewritten under exact delivery (issue 53, round 2, findings 5
and 6). A manifest is refused in one line naming the field and what it may be: nesting, a
count that is not an int (``true``, ``40.0``, a list of names), a count past
``MAX_SHARD_SAMPLES`` or more than the shard's bytes hold. The exact producer's memory does
not follow a count: its units are counted before they are cut (at most ``MAX_UNITS``), and a
shard's count is checked against its size when it is opened. A shard rewritten while an exact
producer reads it is named as such: its slices' learnt offsets are stale, and the message
says to restart the producers, not that the manifest is wrong."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from feedline.producer.exact import build_exact
from feedline.producer.shards.manifest import Manifest, ManifestError, ShardInfo
from feedline.producer.shards.tar import write_sample
from tests.support import ROOT
from tests.support.shard_support import make_wds, payload

MEMORY = 2 << 30  # the producer's address space in these tests (it needs ~1 GB to start)


def feedline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "feedline.commands", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _shard(name: str, samples: object, **more: object) -> dict:
    return {"format": "webdataset", "version": 1,
            "shards": [{"name": name, "samples": samples, **more}]}


HOSTILE = {
    # text -> what the one line must say
    "nested": ("[" * 100_000, "JSON nested deeper than Python parses"),
    "true": (json.dumps(_shard("a.tar", True)),
             "shards[0].samples: expected the shard's sample count, an int from 0 to "
             "1099511627776, got true"),
    "float": (json.dumps(_shard("a.tar", 40.0)), "shards[0].samples: expected the shard's "
              "sample count, an int from 0 to 1099511627776, got 40.0"),
    "names": (json.dumps(_shard("a.tar", ["a.tar", "b.tar"])),
              "shards[0].samples: expected the shard's sample count"),
    "huge": (json.dumps(_shard("a.tar", 10**15)), "got 1000000000000000"),
    "bytes": (json.dumps(_shard("a.tar", 1000, bytes=10240)),
              "shards[0].samples: 1000 samples in the 10240 bytes it says the shard has: a "
              "webdataset record takes at least 512"),
    "name": (json.dumps({"shards": [{"name": 7, "samples": 1}]}),
             "shards[0].name: expected the shard's name, got 7"),
    "shards": (json.dumps({"shards": {"a.tar": 1}}), "shards: expected a list of shards"),
    "total": (json.dumps({**_shard("a.tar", 3), "samples": 4}),
              "samples: 4, but its shards' add up to 3"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_manifest_is_one_line_naming_the_field(tmp_path: Path, case: str):
    """Before: "[" * 100000 was a RecursionError traceback; ``true``, ``40.0`` and 10**15
    were taken as counts (``feedline info`` printed them), a list of names a TypeError."""
    text, says = HOSTILE[case]
    path = tmp_path / "manifest.json"
    path.write_text(text)
    r = feedline("info", str(path))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith(f"feedline info: {path}: "), line
    assert says in line, line


def _exact_cfg(manifest: Path, unit_size: int | None) -> dict:
    return {"delivery": "exact", "stream": "val", "epochs": 1,
            "exact": {"unit_size": unit_size},
            "source": {"webdataset": {"manifest": str(manifest), "fields": ["bin", "cls"]}},
            "steps": [{"batch": {"batch_size": 2}}]}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _producer(tmp_path: Path, cfg: dict, broker: str) -> subprocess.CompletedProcess:
    """A real exact producer under MEMORY: it must end by itself with one line."""
    path = tmp_path / "exact.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "feedline.producer", "--config", str(path),
                           "--broker", broker, "--heartbeat-interval", "0.2",
                           "--heartbeat-timeout", "1.5"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, preexec_fn=_limit_memory,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("case", ["1e15-parsed", "2**40-units"])
def test_an_exact_producer_refuses_a_count_without_allocating_it(tmp_path: Path, case: str):
    """Before: the producer cut 10**12 units (10**15 samples in slices of 1000) or 2**40
    (unit_size 1) into a table, and died of MemoryError (under a 2 GB limit; without one,
    the machine's memory). Now: one line before any table, naming what to change."""
    make_wds(tmp_path, shards=1, per_shard=4, nbytes=100)
    count, unit = (10**15, 1000) if case == "1e15-parsed" else (1 << 40, 1)
    (tmp_path / "manifest.json").write_text(json.dumps(_shard("train-000000.tar", count)))
    r = _producer(tmp_path, _exact_cfg(tmp_path / "manifest.json", unit),
                  "tcp://127.0.0.1:1")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out and "MemoryError" not in out, out
    last = out.strip().splitlines()[-1]
    if case == "1e15-parsed":
        assert "shards[0].samples: expected the shard's sample count, an int from 0 to " \
               "1099511627776, got 1000000000000000" in last, last
    else:
        assert f"exact.unit_size: 1 cuts the {1 << 40} samples of 1 shards into " \
               f"{1 << 40} units, more than the 262144 an exact stream takes" in last, last


def test_a_count_its_shard_cannot_hold_is_refused_when_the_shard_is_opened(
        broker_proc, endpoints, tmp_path: Path):
    """A manifest without ``bytes`` claiming 10**11 samples of a shard that is cut short:
    before, the exact producer reported each missing batch as empty, 5 * 10**10 of them in a
    list (MemoryError under 2 GB); now the shard's size refutes the count when it opens."""
    make_wds(tmp_path, shards=1, per_shard=4, nbytes=600)
    shard = tmp_path / "train-000000.tar"
    shard.write_bytes(shard.read_bytes()[:2 * 2560 + 512 + 300])  # 2 samples, then a cut .bin
    (tmp_path / "manifest.json").write_text(json.dumps(_shard("train-000000.tar", 10**11)))
    broker_proc("--exact-ephemeral")
    r = _producer(tmp_path, _exact_cfg(tmp_path / "manifest.json", None), endpoints.ingress)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out and "MemoryError" not in out, out
    last = out.strip().splitlines()[-1]
    assert f"shard {shard}: 100000000000 samples ({tmp_path}/manifest.json) in its " \
           f"{shard.stat().st_size} bytes: a webdataset record takes at least 512" in last, last


def _manifest(root: Path, counts: list[int]) -> Path:
    path = root / "manifest.json"
    path.write_text(Manifest("webdataset", [ShardInfo(f"train-{k:06d}.tar", n)
                                            for k, n in enumerate(counts)]).to_json())
    return path


def _cfg(manifest: Path) -> dict:
    return {"delivery": "exact", "seed": 5, "exact": {"unit_size": 3},
            "source": {"webdataset": {"manifest": str(manifest), "fields": ["bin", "cls"]}},
            "steps": [{"map": {"function": "tests.support.shard_support:id_and_digest",
                               "component": None}}, {"batch": {"batch_size": 2}}]}


def _epoch(pipe) -> list[int]:
    return sorted(int(i) for u in range(pipe.source.units())
                  for _, b in pipe.batches(0, u) if b is not None for i in np.asarray(b[0]))


STALE = "changed since this producer learnt where its slices start"


def test_a_shard_rewritten_under_an_exact_producer_is_named_stale_not_miscounted(tmp_path):
    """Before: "holds more than the 9 records that manifest.json says: it changed since the
    manifest was written; rebuild it" for a shard rewritten with larger samples (its count,
    and the manifest, still right); one rewritten to the same size with its records moved
    served empty places, with a corrupt record logged. Now both say the learnt offsets are
    stale and to restart the producers; the next read learns them again."""
    make_wds(tmp_path, shards=1, per_shard=9, nbytes=100)
    pipe = build_exact(_cfg(_manifest(tmp_path, [9])))
    assert _epoch(pipe) == list(range(9))  # the slices' starts learnt
    make_wds(tmp_path, shards=1, per_shard=9, nbytes=1500)  # rewritten, larger
    with pytest.raises(ManifestError) as err:
        _epoch(pipe)
    text = str(err.value)
    assert STALE in text and "restart the producers" in text and "bytes, not the" in text, text
    assert "changed since the manifest was written" not in text, text
    assert _epoch(pipe) == list(range(9))  # learnt again, from the start
    make_wds(tmp_path, shards=1, per_shard=9, nbytes=100)  # as it was: stale again
    with pytest.raises(ManifestError, match=STALE):
        _epoch(pipe)
    assert _epoch(pipe) == list(range(9))

    # the same size, records moved: sample 2 grows a block, sample 3 loses its one
    shard = tmp_path / "train-000000.tar"
    size = shard.stat().st_size
    with tarfile.open(shard, "w") as t:
        for i in range(9):
            n = {2: 1000, 3: 0}.get(i, 100)
            write_sample(t, f"{i:08d}", {"bin": payload(i, n), "cls": b"%d" % i})
    assert shard.stat().st_size == size
    with pytest.raises(ManifestError, match=STALE):
        _epoch(pipe)


def test_the_manifest_info_writes_for_the_smallest_records_reads_back(tmp_path: Path):
    """The bound is a place per record but the last, which may be cut short: samples of
    one empty member (512 bytes each) and 100 bytes of a header cut short are 4 places in
    1,636 bytes, and the manifest `info` writes of them is taken."""
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w") as t:
        for i in range(3):
            t.addfile(tarfile.TarInfo(f"{i:04d}.bin"))
    shard.write_bytes(shard.read_bytes()[:3 * 512] + b"x" * 100)
    r = feedline("info", str(shard), "--manifest", str(tmp_path / "m.json"))
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["shards"][0]["samples"] == 4 and m["shards"][0]["bytes"] == 3 * 512 + 100
    r = feedline("info", str(tmp_path / "m.json"))
    assert r.returncode == 0 and "1 shards, 4 samples" in r.stdout, r.stderr
