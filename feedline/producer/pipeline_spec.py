"""The vocabulary of pipeline files: argument validation and one builder per stage name.

Used by :mod:`feedline.producer.pipeline`. Every error is a :class:`ConfigError` whose message
starts
with the path of the offending field (``steps[2].batch.batch_size: expected an int >= 1``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from feedline.errors import ConfigError as ConfigError
from feedline.errors import Unavailable
from feedline.producer.dataflow import (
    BatchData,
    DataFlow,
    DataFromGenerator,
    DataFromList,
    FakeData,
    FilterData,
    ImageFolder,
    LMDBSerializer,
    LocallyShuffleData,
    RepeatedData,
)
from feedline.producer.dataflow.parquet import Parquet
from feedline.producer.dataflow.tfrecord import TFRecord
from feedline.producer.dataflow.webdataset import WebDataset
from feedline.producer.shards.retry import RetryPolicy


class Args:
    """Typed access to one map of a pipeline file; :meth:`done` rejects unknown keys.

    The keys read (``seen``) are the ones accepted; a builder :meth:`expect` s them all up
    front as well, so that an error met before it has read them all (a required key missing
    because it is misspelt: ``rot`` for ``root``) still names every key it takes, and reports
    the misspelt key as the unknown one it is.
    """

    def __init__(self, m: Any, where: str) -> None:
        if m is None:
            m = {}
        if not isinstance(m, Mapping):
            raise ConfigError(f"{where}: expected a map")
        self.m, self.where = m, where
        self.seen: set[str] = set()
        self.known: set[str] = set()  # what the builder says it takes (expect)

    def expect(self, *keys: str) -> Args:
        """Declare the keys this map takes (only for the messages: a key is accepted
        when it is read, so a declared key that nobody reads is still refused)."""
        self.known.update(keys)
        return self

    def _unknown(self, key: str) -> ConfigError:
        known = sorted(self.known | self.seen)
        near = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return ConfigError(f"{self.field(key)}: unknown key ({hint}known: {known})")

    def missing(self, key: str, what: str = "required") -> ConfigError:
        """The error of a required ``key`` that is not there: the key given in its place,
        as unknown, where the map holds one that is not a key this map takes (a misspelling
        is most likely); else ``KEY: required`` (``what``)."""
        extra = sorted(set(self.m) - self.known - self.seen, key=str)
        if extra:
            return self._unknown(extra[0])
        return ConfigError(f"{self.field(key)}: {what}")

    def field(self, key: str) -> str:
        return f"{self.where}.{key}"

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        self.seen.add(key)
        if key not in self.m:
            if required:
                raise self.missing(key)
            return default
        return self.m[key]

    def integer(self, key: str, default: Any = None, lo: int | None = None,
            required: bool = False, allow_none: bool = False) -> Any:
        v = self.get(key, default, required)
        if v is None and allow_none:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or (lo is not None and v < lo):
            raise ConfigError(f"{self.field(key)}: expected an int"
                              f"{f' >= {lo}' if lo is not None else ''}, got {v!r}")
        return v

    def number(self, key: str, default: Any = None, lo: float | None = None) -> float:
        v = self.get(key, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or (lo is not None and v < lo):
            raise ConfigError(f"{self.field(key)}: expected a number"
                              f"{f' >= {lo}' if lo is not None else ''}, got {v!r}")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.field(key)}: expected true or false, got {v!r}")
        return v

    def text(self, key: str, default: Any = None, required: bool = False,
            choices: tuple[str, ...] | None = None) -> Any:
        v = self.get(key, default, required)
        if v is None and not required:
            return None
        if not isinstance(v, str) or (choices and v not in choices):
            raise ConfigError(f"{self.field(key)}: expected "
                              f"{'one of ' + str(list(choices)) if choices else 'a string'}, "
                              f"got {v!r}")
        return v

    def pair(self, key: str, default: tuple[float, float]) -> tuple[float, float]:
        v = self.get(key, list(default))
        if not (isinstance(v, list) and len(v) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            raise ConfigError(f"{self.field(key)}: expected [low, high], got {v!r}")
        return float(v[0]), float(v[1])

    def done(self) -> None:
        extra = sorted(set(self.m) - self.seen, key=str)
        if extra:
            raise self._unknown(extra[0])


def load_object(spec: Any, where: str) -> Any:
    """``'package.module:name'`` -> the object."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(f"{where}: expected 'package.module:name', got {spec!r}")
    mod_name, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod_name), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{where}: cannot load {spec!r}: {e}") from None


def function(a: Args) -> Callable[[Any], Any]:
    """``function: mod:name`` (used as is) or with ``args: {...}`` (a factory, called)."""
    fn = load_object(a.get("function", required=True), a.field("function"))
    fargs = a.get("args")
    if fargs is None:
        return fn  # type: ignore[no-any-return]
    return call_with_args(fn, fargs, a.field("args"), a.m["function"])  # type: ignore[no-any-return]


def call_with_args(fn: Callable[..., Any], fargs: Any, where: str, spec: str) -> Any:
    """``fn(**fargs)``, where ``fargs`` is the map at ``where`` and ``fn`` was loaded from
    ``spec``. Arguments that do not fit ``fn``'s signature (unknown, missing, not strings)
    are a ConfigError at ``where`` naming ``spec``; checked before the call, so that an
    exception raised inside ``fn`` is ``fn``'s own and keeps its traceback."""
    if not isinstance(fargs, Mapping):
        raise ConfigError(f"{where}: expected a map, got {fargs!r}")
    try:
        sig: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (some builtins): just call
        sig = None
    if sig is not None:
        try:
            sig.bind(**fargs)
        except TypeError as e:
            raise ConfigError(f"{where}: do not fit the parameters of {spec}: {e}") from None
    return fn(**fargs)


def guarded(where: str, build: Callable[[], Any]) -> Any:
    """Run a constructor; its ValueError/TypeError becomes a ConfigError at ``where``."""
    try:
        return build()
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise located(where, e) from None


def located(where: str, e: Exception) -> ConfigError:
    """``e`` as a ConfigError that names the place in the file: ``where`` put in front,
    unless the message starts with it already (those of :class:`Args`)."""
    if isinstance(e, ConfigError) and str(e).startswith((f"{where}:", f"{where}.",
                                                          f"{where}[")):
        return e
    return ConfigError(f"{where}: {e}")


# -- sources: (args, seed) -> DataFlow ------------------------------------------------------

def _fake(a: Args, seed: int) -> DataFlow:
    a.expect("shapes", "dtypes", "size", "random", "seed", "delay")
    shapes = a.get("shapes", required=True)
    if not isinstance(shapes, list):
        raise ConfigError(f"{a.field('shapes')}: expected list")
    for i, s in enumerate(shapes):
        if not isinstance(s, list) or not all(isinstance(d, int) and d >= 0 for d in s):
            raise ConfigError(f"{a.field('shapes')}[{i}]: expected a list of non-negative ints")
    dtypes = a.get("dtypes", "float32")
    size = a.integer("size", 1000, lo=0)
    random = a.flag("random", True)
    seed = a.integer("seed", seed)
    delay = a.number("delay", 0.0, lo=0)
    a.done()
    return guarded(a.where, lambda: FakeData(shapes, size=size, random=random, dtype=dtypes,
                                             seed=seed, delay=delay))


def _image_folder(a: Args, seed: int) -> DataFlow:
    a.expect("root", "list_file", "shuffle", "seed", "jpeg_index")
    root, list_file = a.text("root"), a.text("list_file")
    if root is None and list_file is None:
        raise a.missing("root", "required (or list_file)")
    shuffle = a.flag("shuffle", True)
    seed = a.integer("seed", seed)
    jpeg_index = a.flag("jpeg_index", True)
    a.done()
    return guarded(a.where, lambda: ImageFolder(root, list_file, shuffle=shuffle, seed=seed,
                                                jpeg_index=jpeg_index))


def _lmdb(a: Args, seed: int) -> DataFlow:
    a.expect("path", "shuffle", "seed", "jpeg_index")
    path = a.text("path", required=True)
    shuffle = a.flag("shuffle", False)
    seed = a.integer("seed", seed)
    jpeg_index = a.flag("jpeg_index", True)
    a.done()
    return guarded(a.where, lambda: LMDBSerializer.load(path, shuffle=shuffle, seed=seed,
                                                        jpeg_index=jpeg_index))


def _list(a: Args, seed: int) -> DataFlow:
    a.expect("items", "shuffle", "seed")
    items = a.get("items", required=True)
    if not isinstance(items, list):
        raise ConfigError(f"{a.field('items')}: expected a list")
    shuffle = a.flag("shuffle", False)
    seed = a.integer("seed", seed)
    a.done()
    return DataFromList(items, shuffle=shuffle, seed=seed)


def _generator(a: Args, seed: int) -> DataFlow:
    a.expect("function", "args", "size")
    gen: Any = function(a)
    size = a.integer("size", None, lo=0, allow_none=True)
    a.done()
    return DataFromGenerator(gen, size=size)


def _sharded(cls: Callable[..., DataFlow], flags: tuple[str, ...] = (),
             ) -> Callable[[Args, int], DataFlow]:
    """The builder of a sharded source (webdataset, tfrecord, parquet): the same keys for
    each (docs/pipelines.md, "Sharded datasets"), plus its own ``flags`` (each a bool, on by
    default: webdataset's ``jpeg_index``)."""
    sized = ("read_ahead", "chunk_size", "prefetch", "max_sample_bytes", "shuffle_buffer")

    def build(a: Args, seed: int) -> DataFlow:
        a.expect("urls", "manifest", "fields", *sized, "storage_options", "shuffle", "seed",
                 "claim", "timeout", "retries", *flags)
        urls, manifest = a.get("urls"), a.text("manifest")
        if urls is None and manifest is None:
            raise a.missing("urls", "required (a list, a glob or a brace pattern), or "
                            "manifest")
        kw: dict[str, Any] = {"urls": urls, "manifest": manifest}
        fields = a.get("fields")
        if fields is not None:
            if not (isinstance(fields, list) and fields and all(isinstance(f, str)
                                                                for f in fields)):
                raise ConfigError(f"{a.field('fields')}: expected a list of names")
            kw["fields"] = fields
        for key in sized:
            if a.get(key) is not None:  # read (so accepted) even where the default stays
                kw[key] = a.integer(key, lo=1)
        opts = a.get("storage_options", {})
        if not isinstance(opts, Mapping):
            raise ConfigError(f"{a.field('storage_options')}: expected a map")
        kw.update(shuffle=a.flag("shuffle", True), seed=a.integer("seed", seed),
                  claim=a.flag("claim", True), timeout=a.number("timeout", 30.0, lo=0.1),
                  retry=RetryPolicy(attempts=a.integer("retries", 6, lo=1)),
                  storage_options=dict(opts))
        kw.update({f: a.flag(f, True) for f in flags})
        a.done()
        try:
            return guarded(a.where, lambda: cls(**kw))  # type: ignore[no-any-return]
        except Unavailable as e:  # a store client or pyarrow that is not installed
            raise ConfigError(f"{a.where}: {e}") from None
    return build


SOURCES: dict[str, Callable[[Args, int], DataFlow]] = {
    "fake": _fake, "image_folder": _image_folder, "lmdb": _lmdb, "list": _list,
    "generator": _generator, "webdataset": _sharded(WebDataset, ("jpeg_index",)),
    "tfrecord": _sharded(TFRecord), "parquet": _sharded(Parquet),
}


def _image() -> Any:
    """``feedline.producer.image``, imported at a pipeline's first image step, not at start:
    it imports OpenCV, which a producer of other data does not use."""
    from feedline.producer import image

    return image


# -- augmentors (inside an `augment` step) -------------------------------------------------


AUGMENTORS: dict[str, Callable[[Args], Any]] = {
    "resize_shortest_edge": lambda a: _image().ResizeShortestEdge(
        a.integer("size", required=True, lo=1)),
    "random_resized_crop": lambda a: _image().RandomResizedCrop(
        a.expect("size", "scale", "ratio").integer("size", required=True, lo=1),
        a.pair("scale", (0.08, 1.0)), a.pair("ratio", (3 / 4, 4 / 3))),
    "center_crop": lambda a: _image().CenterCrop(a.integer("size", required=True, lo=1)),
    "flip": lambda a: _image().Flip(a.number("prob", 0.5, lo=0)),
    "brightness": lambda a: _image().Brightness(a.number("delta", 30.0, lo=0)),
    "contrast": lambda a: _image().Contrast(a.pair("range", (0.6, 1.4))),
    "saturation": lambda a: _image().Saturation(a.number("alpha", 0.4, lo=0)),
    "color_jitter": lambda a: _image().ColorJitter(a.number("brightness", 30.0, lo=0),
                                                   a.number("contrast", 0.4, lo=0),
                                                   a.number("saturation", 0.4, lo=0)),
    "lighting": lambda a: _image().Lighting(a.number("std", 0.1, lo=0)),
}


def one_key(item: Any, where: str, known: Mapping[str, Any]) -> tuple[str, Any]:
    """``{name: args}`` -> (name, args), checking the name against ``known``."""
    if not isinstance(item, Mapping) or len(item) != 1:
        raise ConfigError(f"{where}: expected a map with one of {sorted(known)}")
    (name, args), = item.items()
    if name not in known:
        raise ConfigError(f"{where}.{name}: unknown (known: {sorted(known)})")
    return name, args


# -- map steps: (args, seed) -> function on a datapoint --------------------------------------
# (the component they apply to is read by the caller)

def _imagenet_train(a: Args, seed: int) -> Any:
    return guarded(a.where, lambda: _image().ImageNetTrain(
        size=a.integer("size", 224, lo=1), seed=a.integer("seed", seed),
        scale=a.pair("scale", (0.08, 1.0)), ratio=a.pair("ratio", (3 / 4, 4 / 3)),
        flip=a.flag("flip", True), color_jitter=a.number("color_jitter", 0.0, lo=0),
        lighting=a.number("lighting", 0.0, lo=0), reduced_decode=a.flag("reduced_decode", True)))


def _imagenet_val(a: Args, seed: int) -> Any:
    return _image().ImageNetVal(size=a.integer("size", 224, lo=1),
                                resize=a.integer("resize", 256, lo=1),
                                reduced_decode=a.flag("reduced_decode", True))


def _decode(a: Args, seed: int) -> Any:
    return _image().Decode(bgr=a.text("channels", "rgb", choices=("rgb", "bgr")) == "bgr")


def _augment(a: Args, seed: int) -> Any:
    items = a.expect("augmentors", "seed").get("augmentors", required=True)
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{a.field('augmentors')}: expected a non-empty list")
    augs = []
    for i, item in enumerate(items):
        w = f"{a.field('augmentors')}[{i}]"
        name, args = one_key(item, w, AUGMENTORS)
        sub = Args(args, f"{w}.{name}")
        augs.append(AUGMENTORS[name](sub))
        sub.done()
    return _image().Augment(augs, seed=a.integer("seed", seed))


def _map(a: Args, seed: int) -> Any:
    return function(a.expect("function", "args"))


MAP_STEPS: dict[str, Callable[[Args, int], Any]] = {
    "imagenet_train": _imagenet_train, "imagenet_val": _imagenet_val, "decode": _decode,
    "augment": _augment, "map": _map,
}

# -- other steps: (ds, args, seed) -> DataFlow ----------------------------------------------


def batch_step(ds: DataFlow, a: Args, seed: int, on_error: str = "raise") -> BatchData:
    a.expect("batch_size", "remainder", "use_list")
    return BatchData(ds, a.integer("batch_size", required=True, lo=1),
                     remainder=a.flag("remainder", False), use_list=a.flag("use_list", False),
                     on_error=on_error)


def _local_shuffle(ds: DataFlow, a: Args, seed: int) -> DataFlow:
    a.expect("buffer_size", "seed")
    return LocallyShuffleData(ds, a.integer("buffer_size", required=True, lo=1),
                              seed=a.integer("seed", seed))


def _repeat(ds: DataFlow, a: Args, seed: int) -> DataFlow:
    times = a.integer("times", required=True, lo=-1)
    if times == 0:
        raise ConfigError(f"{a.field('times')}: expected an int >= 1 or -1 (forever)")
    return RepeatedData(ds, times)


def _filter(ds: DataFlow, a: Args, seed: int) -> DataFlow:
    return FilterData(ds, function(a.expect("function", "args")))


STEPS: dict[str, Callable[[DataFlow, Args, int], DataFlow]] = {
    "batch": batch_step, "local_shuffle": _local_shuffle, "repeat": _repeat, "filter": _filter,
}
