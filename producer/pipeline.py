"""Pipelines from YAML: what ``feedline producer --config`` runs.

A pipeline file is a map::

    source: {fake: {shapes: [[64, 224, 224, 3], [64]], dtypes: [uint8, int32], random: false}}
    epochs: null          # passes, or null for forever

or, for a pipeline written in Python::

    factory: mypackage.pipelines:imagenet_train   # a function returning a DataFlow
    args: {root: /data/train}                     # its keyword arguments

Errors are :class:`ConfigError` and name the field, e.g. ``source.fake.shapes[1]``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from producer.dataflow import DataFlow, FakeData


class ConfigError(ValueError):
    """A pipeline file is invalid; the message names the field."""


def load_config(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read: {e.strerror}") from None
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError("top level must be a map with 'source' or 'factory'")
    return cfg


def _require(m: Mapping[str, Any], key: str, where: str, kind: type | tuple) -> Any:
    if key not in m:
        raise ConfigError(f"{where}.{key}: required")
    v = m[key]
    if not isinstance(v, kind):
        raise ConfigError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}")
    return v


def _fake(args: Mapping[str, Any], where: str) -> DataFlow:
    shapes = _require(args, "shapes", where, list)
    for i, s in enumerate(shapes):
        if not isinstance(s, list) or not all(isinstance(d, int) and d >= 0 for d in s):
            raise ConfigError(f"{where}.shapes[{i}]: expected a list of non-negative ints")
    dtypes = args.get("dtypes", "float32")
    try:
        df = FakeData(shapes, size=int(args.get("size", 1000)),
                      random=bool(args.get("random", True)), dtype=dtypes,
                      seed=int(args.get("seed", 0)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    return df


SOURCES: dict[str, Callable[[Mapping[str, Any], str], DataFlow]] = {"fake": _fake}


def _factory(spec: Any, args: Any) -> DataFlow:
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError("factory: expected 'package.module:function'")
    mod_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"factory: cannot load {spec!r}: {e}") from None
    if args is not None and not isinstance(args, dict):
        raise ConfigError("args: expected a map")
    return fn(**(args or {}))


def build_pipeline(cfg: Mapping[str, Any]) -> DataFlow:
    """Build the DataFlow a pipeline map describes."""
    if "factory" in cfg:
        return _factory(cfg["factory"], cfg.get("args"))
    source = _require(cfg, "source", "pipeline", dict)
    if len(source) != 1:
        raise ConfigError(f"source: expected one of {sorted(SOURCES)}")
    (name, args), = source.items()
    if name not in SOURCES:
        raise ConfigError(f"source.{name}: unknown source (known: {sorted(SOURCES)})")
    if not isinstance(args, dict):
        raise ConfigError(f"source.{name}: expected a map")
    return SOURCES[name](args, f"source.{name}")
