"""Pipelines from YAML: every stage, sharding, error policy, field-naming errors, and the
producer CLI running an example file against a real broker."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.producer.dataflow import BatchData, DataFromList, MapData, MultiProcessMapData
from feedline.producer.exact import build_exact
from feedline.producer.image import ImageNetVal
from feedline.producer.image.decode import CorruptImage
from feedline.producer.pipeline import ConfigError, build_pipeline, load_config
from feedline.transport.link import LinkConfig
from tests.support.jpeg_data import make_folder

HERE = "tests.producer.test_pipeline_yaml"  # as pipeline files name its functions

ROOT = Path(__file__).resolve().parents[2]
FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)


@pytest.fixture
def images(tmp_path: Path) -> Path:
    make_folder(tmp_path / "imgs", classes=3, per_class=5)
    return tmp_path / "imgs"


def run(cfg: dict, passes: int = 1) -> list:
    df = build_pipeline(cfg)
    try:
        df.reset_state()
        return [list(df) for _ in range(passes)]
    finally:
        df.close()


def labels(batches: list) -> list[int]:
    return sorted(int(x) for b in batches for x in b[1])


def test_image_folder_train_pipeline_in_each_parallel_mode(images: Path) -> None:
    for mode in ("none", "thread", "process", "runner"):
        cfg = {"source": {"image_folder": {"root": str(images)}},
               "parallel": {"mode": mode, "workers": 2, "buffer_size": 4},
               "steps": [{"imagenet_train": {"size": 32, "color_jitter": 0.4, "lighting": 0.1}},
                         {"local_shuffle": {"buffer_size": 4}},
                         {"batch": {"batch_size": 5}}]}
        [batches] = run(cfg)
        assert len(batches) == 3, mode
        assert batches[0][0].shape == (5, 32, 32, 3) and batches[0][0].dtype == np.uint8
        if mode == "runner":  # unordered runner: each worker shuffles its own full copy
            assert len(labels(batches)) == 15 and set(labels(batches)) <= {0, 1, 2}
        else:
            assert labels(batches) == [0] * 5 + [1] * 5 + [2] * 5, mode


def test_every_other_stage_from_yaml(images: Path, tmp_path: Path) -> None:
    cfg = {"source": {"list": {"items": [[i, i] for i in range(10)]}},
           "steps": [{"map": {"function": f"{HERE}:add", "args": {"k": 100},
                              "component": 1}},
                     {"filter": {"function": f"{HERE}:even"}},
                     {"repeat": {"times": 2}},
                     {"batch": {"batch_size": 4, "remainder": True, "use_list": True}}]}
    [batches] = run(cfg)
    assert [dp for b in batches for dp in b[0]] == [0, 2, 4, 6, 8] * 2
    assert batches[0][1] == [100, 102, 104, 106]
    gen = {"source": {"generator": {"function": f"{HERE}:gen", "size": 3}}}
    assert run(gen, 2) == [[[0], [1], [2]]] * 2
    aug = {"source": {"image_folder": {"root": str(images), "shuffle": False}},
           "steps": [{"decode": {"channels": "bgr"}},
                     {"augment": {"augmentors": [
                         {"resize_shortest_edge": {"size": 40}}, {"center_crop": {"size": 40}},
                         {"random_resized_crop": {"size": 24, "scale": [0.5, 1.0]}},
                         {"flip": {"prob": 1.0}}, {"brightness": {"delta": 10}},
                         {"contrast": {"range": [0.8, 1.2]}}, {"saturation": {"alpha": 0.2}},
                         {"color_jitter": {}}, {"lighting": {"std": 0.1}}]}},
                     {"batch": {"batch_size": 15}}]}
    [[batch]] = run(aug)
    assert batch[0].shape == (15, 24, 24, 3)
    fake = load_config(ROOT / "examples" / "fake.yaml")
    df = build_pipeline(fake)
    df.reset_state()
    assert next(iter(df))[0].shape == (64, 224, 224, 3)


def add(k: int):
    return lambda x: x + k


def swap(dp):
    return [dp[1], dp[0]]


def test_component_null_maps_the_whole_datapoint() -> None:
    """docs/pipelines.md: a map step's ``component: null`` is the whole datapoint."""
    cfg = {"source": {"list": {"items": [[i, -i] for i in range(3)]}},
           "steps": [{"map": {"function": f"{HERE}:swap", "component": None}}]}
    assert run(cfg) == [[[0, 0], [-1, 1], [-2, 2]]]
    cfg["parallel"] = {"mode": "thread", "workers": 2, "strict": True, "buffer_size": 2}
    assert run(cfg) == [[[0, 0], [-1, 1], [-2, 2]]]


def test_image_steps_refuse_component_null() -> None:
    """An image step works on one array, never on the whole ``[image, label]`` list: null
    there is refused when the file is read, not by a worker at the first datapoint."""
    cfg = {"source": {"list": {"items": [1]}},
           "steps": [{"augment": {"augmentors": [{"flip": {}}], "component": None}}]}
    with pytest.raises(ConfigError, match=r"^steps\[0\]\.augment\.component: null .* only for "
                       "map steps"):
        build_pipeline(cfg)


def make_list(n: int, offset: int = 0):
    return DataFromList([[i + offset] for i in range(n)])


def broken_factory(n: int):
    raise TypeError("a bug inside the factory")


def test_a_factory_builds_the_pipeline_from_its_args() -> None:
    assert run({"factory": f"{HERE}:make_list", "args": {"n": 2, "offset": 5},
                "epochs": 1}) == [[[5], [6]]]


@pytest.mark.parametrize("args, why", [
    ({"n": 2, "nope": 1}, "unexpected keyword argument 'nope'"),
    ({"offset": 1}, "missing a required argument: 'n'"),
    ({1: 2}, ""),
    ([1, 2], "expected a map"),
])
def test_factory_args_that_do_not_fit_are_a_config_error(args, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_pipeline({"factory": f"{HERE}:make_list", "args": args})
    msg = str(info.value)
    assert msg.startswith("args:") and why in msg, msg
    if why != "expected a map":
        assert f"{HERE}:make_list" in msg, msg


def test_an_error_inside_a_factory_is_its_own() -> None:
    """Arguments are checked against the signature, so a factory's own TypeError is a bug
    in it with its traceback, not blamed on the file."""
    with pytest.raises(TypeError, match="a bug inside the factory"):
        build_pipeline({"factory": f"{HERE}:broken_factory", "args": {"n": 1}})


@pytest.mark.parametrize("key, value", [
    ("source", {"list": {"items": [1]}}), ("steps", [{"batch": {"batch_size": 2}}]),
    ("shard", {"index": 0, "count": 2}), ("seed", 3), ("parallel", {"mode": "thread"}),
    ("on_error", "skip"),
])
def test_built_in_keys_next_to_a_factory_are_refused(key: str, value) -> None:
    cfg = {"factory": f"{HERE}:make_list", "args": {"n": 2}, key: value}
    with pytest.raises(ConfigError, match=f"^{key}: not used with factory"):
        build_pipeline(cfg)


def test_args_without_a_factory_are_refused() -> None:
    with pytest.raises(ConfigError, match="^args: only used with factory"):
        build_pipeline({"source": {"list": {"items": [1]}}, "args": {"n": 2}})


def even(dp) -> bool:
    return dp[0] % 2 == 0


def gen():
    yield from ([i] for i in range(3))


def test_lmdb_source_from_yaml(images: Path, tmp_path: Path) -> None:
    from feedline.producer.dataflow import ImageFolder, LMDBSerializer

    LMDBSerializer.save(ImageFolder(images, shuffle=False), tmp_path / "i.lmdb", progress=False)
    cfg = {"source": {"lmdb": {"path": str(tmp_path / "i.lmdb"), "shuffle": True}},
           "steps": [{"imagenet_val": {"size": 16, "resize": 20}}, {"batch": {"batch_size": 15}}]}
    [[batch]] = run(cfg)
    assert batch[0].shape == (15, 16, 16, 3) and labels([batch]) == [0] * 5 + [1] * 5 + [2] * 5


@pytest.mark.parametrize("mode", ["none", "process", "runner"])
def test_shards_cover_the_dataset_exactly_once(images: Path, mode: str) -> None:
    seen: list[int] = []
    for i in range(3):
        cfg = {"source": {"image_folder": {"root": str(images), "shuffle": True}},
               "shard": {"index": i, "count": 3},
               "parallel": {"mode": mode, "workers": 2, "strict": True, "buffer_size": 4},
               "steps": [{"map": {"function": f"{HERE}:digest",
                                  "component": 0}}]}
        [out] = run(cfg)
        seen += [dp[0] for dp in out]
    expected = [digest(p.read_bytes()) for p in sorted(images.rglob("*.jpg"))]
    assert sorted(seen) == sorted(expected) and len(set(seen)) == 15


def digest(data) -> str:
    return hashlib.sha1(bytes(data)).hexdigest()


def test_a_corrupt_jpeg_is_skipped_and_counted_not_fatal(images: Path) -> None:
    (images / "c1" / "zz-corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 64)
    for mode in ("none", "process"):
        cfg = {"source": {"image_folder": {"root": str(images)}}, "on_error": "skip",
               "parallel": {"mode": mode, "workers": 2, "buffer_size": 4},
               "steps": [{"imagenet_train": {"size": 16}}, {"batch": {"batch_size": 1}}]}
        df = build_pipeline(cfg)
        with df:
            df.reset_state()
            assert len(list(df)) == 15
            batch = df.ds  # type: ignore[attr-defined]  # the batch step's counting stage
            assert isinstance(batch, BatchData)
            stage = batch.ds.ds  # type: ignore[attr-defined]  # batch <- count <- the map
            assert isinstance(stage, (MapData, MultiProcessMapData)) and stage.skipped == 1
    cfg["on_error"] = "raise"
    cfg["parallel"] = {"mode": "none"}
    # The error names the file, whichever decoder read it (the fused one says what libjpeg
    # found, OpenCV only that it cannot decode).
    with pytest.raises(CorruptImage, match="zz-corrupt.jpg"):
        run(cfg)


def test_same_seed_same_batches(images: Path) -> None:
    cfg = {"seed": 11, "source": {"image_folder": {"root": str(images)}},
           "parallel": {"mode": "process", "workers": 2, "strict": True, "buffer_size": 4},
           "steps": [{"imagenet_train": {"size": 24}}, {"batch": {"batch_size": 5}}]}
    a, b = run(cfg, 2), run(cfg, 2)
    flat = [[x.tobytes() for x in batch] for epoch in a for batch in epoch]
    assert flat == [[x.tobytes() for x in batch] for epoch in b for batch in epoch]
    assert flat[:3] != flat[3:], "epochs differ"
    c = run({**cfg, "seed": 12})
    assert [[x.tobytes() for x in batch] for batch in c[0]] != flat[:3]


@pytest.mark.parametrize("cfg, field", [
    ({"source": {"fake": {"shapes": [[2], ["x"]]}}}, "source.fake.shapes[1]"),
    ({"source": {"nope": {}}}, "source.nope"),
    ({"source": {"fake": {"shapes": [[2]], "sise": 3}}}, "source.fake.sise"),
    ({"source": {"image_folder": {}}}, "source.image_folder.root"),
    ({"source": {"image_folder": {"root": "/no/such/dir"}}}, "source.image_folder"),
    ({"source": {"list": {"items": [1]}}, "shard": {"index": 2, "count": 2}}, "shard"),
    ({"source": {"list": {"items": [1]}}, "shard": {"count": 2}}, "shard.index"),
    ({"source": {"fake": {"shapes": [[1]]}}, "shard": {"index": 0, "count": 2}}, "shard"),
    ({"source": {"list": {"items": [1]}}, "steps": [{"batch": {"batch_size": 0}}]},
     "steps[0].batch.batch_size"),
    ({"source": {"list": {"items": [1]}}, "steps": [{"batch": {}}]}, "steps[0].batch.batch_size"),
    ({"source": {"list": {"items": [1]}}, "steps": [{"bach": {}}]}, "steps[0].bach"),
    ({"source": {"list": {"items": [1]}}, "steps": [{"imagenet_train": {"size": "big"}}]},
     "steps[0].imagenet_train.size"),
    ({"source": {"list": {"items": [1]}},
      "steps": [{"augment": {"augmentors": [{"flip": {}}, {"twirl": {}}]}}]},
     "steps[0].augment.augmentors[1].twirl"),
    ({"source": {"list": {"items": [1]}},
      "steps": [{"augment": {"augmentors": [{"center_crop": {"size": -1}}]}}]},
     "steps[0].augment.augmentors[0].center_crop.size"),
    ({"source": {"list": {"items": [1]}}, "steps": [{"map": {"function": "os:nope"}}]},
     "steps[0].map.function"),
    ({"source": {"list": {"items": [1]}}, "parallel": {"mode": "gpu"}}, "parallel.mode"),
    ({"source": {"list": {"items": [1]}}, "parallel": {"workers": 0}}, "parallel.workers"),
    ({"source": {"list": {"items": [1]}}, "on_error": "ignore"}, "pipeline.on_error"),
    ({"source": {"list": {"items": [1]}}, "epoch": 3}, "epoch"),
    ({"factory": "no_colon"}, "factory"),
])
def test_errors_name_the_field(cfg: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_pipeline(cfg)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_example_configs_build(images: Path, tmp_path: Path) -> None:
    cfg = load_config(ROOT / "examples" / "imagenet_train.yaml")
    cfg["source"]["image_folder"]["root"] = str(images)
    cfg["steps"][-1]["batch"]["batch_size"] = 4
    [batches] = run(cfg)
    assert batches[0][0].shape == (4, 224, 224, 3) and batches[0][0].dtype == np.uint8
    assert sum(len(b[1]) for b in batches) == 12  # remainder: false
    # The validation example is exact delivery: built unit by unit, every image once.
    cfg = load_config(ROOT / "examples" / "imagenet_val.yaml")
    cfg["source"]["image_folder"]["root"] = str(images)
    cfg["steps"][-1]["batch"]["batch_size"] = 4
    pipe = build_exact(cfg)
    assert pipe.stream == "val" and pipe.spec.dataset_size == 15
    batches = [b for unit in range(-(-15 // pipe.unit_size)) for _, b in pipe.batches(0, unit)]
    assert batches[0][0].shape == (4, 224, 224, 3) and batches[0][0].dtype == np.uint8
    assert labels(batches) == [0] * 5 + [1] * 5 + [2] * 5  # the last batch short: kept


def test_producer_cli_runs_the_val_example_against_a_real_broker(
    images: Path, tmp_path: Path, broker_proc, daemons, endpoints
) -> None:
    """Two producer processes of the exact-delivery example (units of 4 images here), its
    dataset given by --data: epoch 0, as the training process's epoch() yields it, is every
    image exactly once, as the model would see it."""
    broker_proc("--state-dir", str(tmp_path / "state"))  # exact streams need one
    cfg = yaml.safe_load((ROOT / "examples" / "imagenet_val.yaml").read_text())
    cfg["exact"] = {"unit_size": 4}
    cfg["steps"] = [{"imagenet_val": {"size": 64, "resize": 72}},
                    {"batch": {"batch_size": 3}}]
    (tmp_path / "val.yaml").write_text(yaml.safe_dump(cfg))
    for i in range(2):
        daemons("feedline.producer", "--config", tmp_path / "val.yaml", "--data", images,
                "--broker", endpoints.ingress, "--id", f"p{i}", "--heartbeat-interval", "0.2",
                "--heartbeat-timeout", "1.5", name=f"producer-{i}")
    got: list = []
    with RemoteDataZMQ(endpoints.egress, stream="val", timeout=60,
                       options=ConsumerOptions(link=FAST)) as src:
        for imgs, labs in src.epoch():
            got += [(img.tobytes(), int(lab)) for img, lab in zip(imgs, labs, strict=True)]
    val = ImageNetVal(64, 72)
    expected = []
    for k, d in enumerate(sorted(images.iterdir())):
        expected += [(val(np.fromfile(p, np.uint8)).tobytes(), k) for p in sorted(d.iterdir())]
    assert sorted(got) == sorted(expected)


_SHARD_KEYS = ["chunk_size", "claim", "fields", "manifest", "max_sample_bytes", "prefetch",
               "read_ahead", "retries", "seed", "shuffle", "shuffle_buffer",
               "storage_options", "timeout", "urls"]


_WDS_KEYS = sorted([*_SHARD_KEYS, "jpeg_index"])  # its JPEGs' side indexes


@pytest.mark.parametrize("fmt", ["webdataset", "tfrecord", "parquet"])
def test_an_unknown_shard_key_lists_every_key_the_source_takes(fmt: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_pipeline({"source": {fmt: {"urls": "x-{0..1}", "chunksize": 5}}})
    keys = _WDS_KEYS if fmt == "webdataset" else _SHARD_KEYS
    assert str(e.value) == (f"source.{fmt}.chunksize: unknown key (did you mean "
                            f"'chunk_size'? known: {keys})")


@pytest.mark.parametrize("cfg, said", [
    ({"source": {"image_folder": {"rot": "/data"}}},
     "source.image_folder.rot: unknown key (did you mean 'root'? known: ['jpeg_index', "
     "'list_file', 'root', 'seed', 'shuffle'])"),
    ({"source": {"fake": {"shapes": [[1]]}}, "steps": [{"map": {"function": "builtins:id"}},
                                                       {"batch": {"batchsize": 8}}]},
     "steps[1].batch.batchsize: unknown key (did you mean 'batch_size'? known: "
     "['batch_size', 'remainder', 'use_list'])"),
    ({"source": {"webdataset": {"url": "x-{0..1}.tar"}}},
     "source.webdataset.url: unknown key (did you mean 'urls'? known: "
     f"{_WDS_KEYS})"),
    ({"source": {"fake": {"shapes": [[1]]}}, "steps": [{"batch": {}}]},
     "steps[0].batch.batch_size: required"),  # nothing misspelt: the key is missing
])
def test_a_misspelt_required_key_is_reported_as_the_unknown_key(cfg, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_pipeline(cfg)
    assert str(e.value) == said


def test_a_misspelt_top_level_key_names_the_key_it_is_near() -> None:
    """A new user's ``stram:`` was refused with the list of keys only (a nested key named its
    near miss)."""
    with pytest.raises(ConfigError) as e:
        build_pipeline({"stram": "train", "source": {"fake": {"shapes": [[1]]}}})
    assert str(e.value).startswith("stram: unknown key (did you mean 'stream'? known: [")
