"""Exact delivery over shards: a unit is a shard (or a slice of one). The same dataset as an
image folder and as WebDataset shards served over HTTP gives identical bytes per sample id;
and under injected HTTP faults plus a producer killed with ``kill -9``, three epochs arrive
with no sample lost and none duplicated."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.producer.exact import build_exact
from feedline.transport.link import LinkConfig
from tests.support import ROOT
from tests.support.jpeg_data import make_folder
from tests.support.shard_server import Plan, fault_proxy, file_server
from tests.support.shard_support import make_wds, payload

LIVENESS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.5")
FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
STEPS = [{"imagenet_train": {"size": 48, "scale": [0.2, 1.0]}},
         {"batch": {"batch_size": 4}}]


def by_id(batches) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for images, labels in batches:
        for img, i in zip(images, np.asarray(labels), strict=True):
            assert int(i) not in out, f"sample {int(i)} twice"
            out[int(i)] = img.tobytes()
    return out


def test_image_folder_and_http_shards_give_identical_bytes_per_sample(broker_proc, daemons,
                                                                      endpoints, tmp_path):
    paths = make_folder(tmp_path / "images", classes=3, per_class=9)
    # label = the image's place in the folder's order: a sample id the consumer sees
    (tmp_path / "list.txt").write_text("".join(
        f"{p.relative_to(tmp_path / 'images')} {k}\n" for k, p in enumerate(paths)))
    r = subprocess.run([sys.executable, "-m", "feedline.commands", "convert",
                        str(tmp_path / "images"), str(tmp_path / "shards"), "--list-file",
                        str(tmp_path / "list.txt"), "--shard-size", "25KB", "--no-progress"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "shards").glob("*.tar"))) >= 3
    folder = build_exact({"delivery": "exact", "exact": {"unit_size": 5}, "seed": 7,
                          "source": {"image_folder": {"root": str(tmp_path / "images"),
                                                      "list_file": str(tmp_path / "list.txt")}},
                          "steps": STEPS, "epochs": 2})
    expected = {e: by_id(b for u in range(-(-27 // 5)) for _, b in folder.batches(e, u))
                for e in range(2)}
    assert expected[0] != expected[1] and len(expected[0]) == 27
    broker_proc("--exact-ephemeral")  # nothing here restarts the broker
    with file_server(str(tmp_path / "shards")) as url:
        cfg = {"delivery": "exact", "stream": "val", "seed": 7, "epochs": 2,
               "source": {"webdataset": {"manifest": f"{url}/manifest.json"}},
               "parallel": {"workers": 2}, "steps": STEPS}
        (tmp_path / "shards.yaml").write_text(yaml.safe_dump(cfg))
        for k in range(2):
            daemons("feedline.producer", "--config", tmp_path / "shards.yaml", "--broker",
                    endpoints.ingress, "--id", f"p{k}", *LIVENESS, name=f"p{k}")
        with RemoteDataZMQ(endpoints.egress, stream="val", timeout=30,
                           options=ConsumerOptions(link=FAST)) as src:
            for epoch in range(2):
                assert by_id(src.epoch()) == expected[epoch]


N_SHARDS, PER_SHARD, NBYTES = 12, 8, 3000


def test_exact_over_http_faults_and_kill9_loses_and_repeats_nothing(broker_proc, daemons,
                                                                    endpoints, tmp_path):
    make_wds(tmp_path / "shards", shards=N_SHARDS, per_shard=PER_SHARD, nbytes=NBYTES)
    from feedline.producer.shards.manifest import Manifest, ShardInfo

    (tmp_path / "shards" / "manifest.json").write_text(Manifest("webdataset", [
        ShardInfo(f"train-{k:06d}.tar", PER_SHARD) for k in range(N_SHARDS)]).to_json())
    broker_proc("--state-dir", str(tmp_path / "state"))
    # a slow link (a unit takes ~0.3 s: the kill lands mid-unit), a 503 every 5th GET and a
    # connection reset mid-body every 7th
    plan = Plan(rate=100_000, every=[("503", 5), ("reset", 7)])
    with file_server(str(tmp_path / "shards")) as url, fault_proxy(url, plan) as proxy:
        cfg = {"delivery": "exact", "stream": "val", "seed": 3, "epochs": 3,
               "exact": {"unit_size": 4},  # two units per shard: slices
               "source": {"webdataset": {"manifest": f"{proxy}/manifest.json",
                                         "fields": ["bin", "cls"], "chunk_size": 8192,
                                         "retries": 30}},
               "steps": [{"map": {"function": "tests.support.shard_support:id_and_digest",
                                  "component": None}},
                         {"batch": {"batch_size": 2}}]}
        path = tmp_path / "exact.yaml"
        path.write_text(yaml.safe_dump(cfg))

        def producer(name: str):
            return daemons("feedline.producer", "--config", path, "--broker",
                           endpoints.ingress, "--id", name, *LIVENESS, name=name)

        victim = producer("victim")
        producer("survivor")
        want = {i: hashlib.blake2b(payload(i, NBYTES), digest_size=16).digest()
                for i in range(N_SHARDS * PER_SHARD)}
        with RemoteDataZMQ(endpoints.egress, stream="val", timeout=60,
                           options=ConsumerOptions(link=FAST)) as src:
            for epoch in range(3):
                seen: Counter = Counter()
                for ids, digests in src.epoch():
                    for i, d in zip(np.asarray(ids), np.asarray(digests), strict=True):
                        seen[int(i)] += 1
                        assert d.tobytes() == want[int(i)], f"sample {int(i)}'s bytes"
                    if epoch == 1 and sum(seen.values()) == 20 and victim.alive():
                        victim.kill9()  # mid-epoch, mid-unit
                        producer("victim-again")
                lost = set(want) - set(seen)
                dup = {i: n for i, n in seen.items() if n > 1}
                assert not lost and not dup, (epoch, sorted(lost), dup)
        assert not victim.alive()  # it was killed in epoch 1
    assert plan.injected["503"] >= 5 and plan.injected["reset"] >= 3, plan.injected


def _manifest(root: Path, counts: list[int]) -> str:
    from feedline.producer.shards.manifest import Manifest, ShardInfo

    path = root / "manifest.json"
    path.write_text(Manifest("webdataset", [ShardInfo(f"train-{k:06d}.tar", n)
                                            for k, n in enumerate(counts)]).to_json())
    return str(path)


def _exact(manifest: str, unit_size: int | None = 3) -> dict:
    return {"delivery": "exact", "seed": 5, "exact": {"unit_size": unit_size},
            "source": {"webdataset": {"manifest": manifest, "fields": ["bin", "cls"],
                                      "shuffle_buffer": 4}},
            "steps": [{"map": {"function": "tests.support.shard_support:id_and_digest",
                               "component": None}}, {"batch": {"batch_size": 2}}]}


def ids_of(batches) -> list[list[int] | None]:
    return [None if b is None else [int(i) for i in np.asarray(b[0])] for _, b in batches]


def test_units_are_slices_of_shards_and_restart_anywhere_the_same(tmp_path: Path):
    make_wds(tmp_path, shards=3, per_shard=7, nbytes=100)
    pipe = build_exact(_exact(_manifest(tmp_path, [7, 7, 7])))
    assert pipe.spec.dataset_size == 9 and pipe.spec.unit_size == 1  # 3 slices of each shard
    for epoch in range(2):
        seen: list[int] = []
        for u in range(9):
            full = ids_of(pipe.batches(epoch, u))
            assert len(full) == pipe.slots(epoch, u)
            for j in range(len(full)):  # a unit made again from batch j: the same batches
                assert ids_of(pipe.batches(epoch, u, j)) == full[j:]
            seen += [i for b in full for i in b or []]
        assert sorted(seen) == list(range(21))
    whole = build_exact(_exact(_manifest(tmp_path, [7, 7, 7]), unit_size=None))
    assert whole.spec.dataset_size == 3  # a unit is a shard


def test_a_corrupt_record_leaves_its_place_empty_in_every_run(tmp_path: Path):
    make_wds(tmp_path, shards=2, per_shard=4, nbytes=600)
    shard = tmp_path / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:2 * 2560 + 512 + 300])  # 2 samples, then a cut .bin
    pipe = build_exact(_exact(_manifest(tmp_path, [4, 4]), unit_size=None))
    got = [sorted(i for b in ids_of(pipe.batches(0, u)) for i in b or [])
           for u in range(2)]
    assert sorted(got) == [[0, 1, 2, 3], [4, 5]]
    again = [sorted(i for b in ids_of(pipe.batches(0, u)) for i in b or []) for u in range(2)]
    assert again == got
    src = pipe.source
    assert src.stats.corrupt_records == 2  # type: ignore[union-attr]  # once per run


def test_a_shard_whose_count_is_not_the_manifests_is_an_error_naming_it(tmp_path: Path):
    """Issue 53, finding 7: a shard re-written shorter (or longer) than its manifest says.
    Before: the epoch ended normally, the missing places empty (shorter) or the extra
    samples never served (longer), with no word of it."""
    import pytest

    from feedline.producer.shards.manifest import ManifestError

    make_wds(tmp_path, shards=2, per_shard=8, nbytes=100)
    for counts, holds in (([8, 10], "holds 8 records, not the 10"),
                          ([8, 6], "holds more than the 6 records")):
        for unit_size in (None, 3):
            pipe = build_exact(_exact(_manifest(tmp_path, counts), unit_size))
            with pytest.raises(ManifestError, match=holds) as err:
                for u in range(pipe.source.units()):  # type: ignore[union-attr]
                    list(pipe.batches(0, u))
            text = str(err.value)
            assert "train-000001.tar" in text and "feedline info" in text, text
    # the counts right: every sample, in slices of any size
    for unit_size in (None, 3, 5):
        pipe = build_exact(_exact(_manifest(tmp_path, [8, 8]), unit_size))
        got = sorted(i for u in range(pipe.source.units())  # type: ignore[union-attr]
                     for b in ids_of(pipe.batches(0, u)) for i in b or [])
        assert got == list(range(16))
