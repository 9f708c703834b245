"""Pipelines from YAML: what ``feedline producer --config`` runs.

A pipeline file is a map (see docs/pipelines.md for every stage and its arguments)::

    seed: 0                                      # randomness = f(seed, epoch, worker)
    source: {image_folder: {root: /data/train}}  # fake | image_folder | lmdb | list | generator
    shard: {index: 0, count: 4}                  # this producer's share (no overlap)
    on_error: skip                               # raise | skip (corrupt images: counted)
    parallel: {mode: process, workers: 2}        # none | thread | process | runner
    steps:
      - imagenet_train: {size: 224}              # decode + augment component 0
      - batch: {batch_size: 64}
    epochs: null                                 # passes, or null for forever

Consecutive map steps (``imagenet_train``, ``imagenet_val``, ``decode``, ``augment``,
``map``) are fused into one function, run by ``parallel``'s workers (``thread`` /
``process``); ``runner`` instead runs whole copies of everything before the first ``batch``
in worker processes. ``parallel.strict: true`` gives every input exactly once, in order where
the mode can (validation).

Or, for a pipeline written in Python::

    factory: mypackage.pipelines:imagenet_train   # a function returning a DataFlow
    args: {root: /data/train}                     # its keyword arguments
    epochs: null                                  # the one other key it may have

Errors are :class:`ConfigError` and name the field, e.g. ``source.fake.shapes[1]``.

Every stage's output is counted (:class:`~feedline.producer.dataflow.CountData`, one increment per
datapoint, in this process) under a label taken from the file, never from the data:
``source:image_folder``, ``0:imagenet_train``, ``0-1:decode+augment`` (map steps fused into
one stage), ``2:batch``; a factory's pipeline is one stage, ``factory``. Map stages also
report what their skip policy dropped. :func:`pipeline_stages` lists them, source first, for
the producer's metrics. In ``runner`` mode the stages before the first ``batch`` count in
the worker processes and the runner adds their counts to this process's stages.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from feedline.producer.dataflow import (
    CountData,
    DataFlow,
    MapData,
    MultiProcessMapData,
    MultiProcessRunner,
    MultiThreadMapData,
)
from feedline.producer.dataflow.auto_map_data import AutoMapData, InlineMapData
from feedline.producer.dataflow.autotune import AutoWorkers, ModeTuner, cpu_budget, plural
from feedline.producer.dataflow.base import Counted, Shardable, as_dataflow, stages
from feedline.producer.dataflow.map_data import ComponentFunc, reseed
from feedline.producer.dataflow.parallel_map import ParallelMapBase
from feedline.producer.dataflow.shard import check_shard, source_of
from feedline.producer.dataflow.sharded import ShardedSource
from feedline.producer.pipeline_spec import (
    MAP_STEPS,
    SOURCES,
    STEPS,
    Args,
    ConfigError,
    batch_step,
    call_with_args,
    guarded,
    load_object,
    located,
    one_key,
)
from feedline.protocol.messages import check_stream

__all__ = ["SOURCES", "ConfigError", "build_pipeline", "load_config", "pipeline_stages"]

TOP_LEVEL = ("source", "factory", "args", "steps", "shard", "seed", "parallel", "on_error",
             "epochs", "stream", "delivery", "exact")
# Read only by the built-in form: next to `factory:` they would be silently ignored.
BUILT_IN_ONLY = ("source", "steps", "shard", "seed", "parallel", "on_error")
MODES = ("none", "thread", "process", "runner")
PRESETS = ("imagenet_train", "imagenet_val", "decode", "augment")  # the image steps


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


# What a pipeline file says that does not change the batches it makes: where they go, and
# for how long.
_NOT_THE_PIPELINE = ("stream", "epochs")


def training_fingerprint(cfg: Mapping[str, Any]) -> int:
    """The pipeline a (training) pipeline file describes, as one number (1 .. 2**63 - 1):
    everything in it but its stream and epochs (``--data`` applied). Producers of one file
    have the same; a broker drops what a departed pipeline left on a stream once one with
    another fingerprint produces it (docs/architecture.md, "Streams")."""
    return _fingerprint(cfg, _NOT_THE_PIPELINE)


def exact_file_fingerprint(cfg: Mapping[str, Any]) -> int:
    """The file an exact pipeline was built from, as a batch's lineage names it: as
    :func:`training_fingerprint`, and without ``parallel``: an exact batch is the same bytes
    whatever the workers (each sample's randomness is its own), so a file run with more
    workers is not another pipeline file (``feedline diff`` would call it one)."""
    return _fingerprint(cfg, (*_NOT_THE_PIPELINE, "parallel"))


def _fingerprint(cfg: Mapping[str, Any], leave_out: tuple[str, ...]) -> int:
    what = {k: v for k, v in cfg.items() if k not in leave_out}
    text = json.dumps(what, sort_keys=True, default=str)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


class Chain:
    """Several map functions as one (one hop to a worker for all of them); picklable."""

    def __init__(self, funcs: list[Callable[[Any], Any]]) -> None:
        self.funcs = funcs

    def reseed(self, epoch: int) -> None:
        for f in self.funcs:
            reseed(f, epoch)

    def __call__(self, dp: Any) -> Any:
        for f in self.funcs:
            dp = f(dp)
            if dp is None:
                return None
        return dp


def _factory(cfg: Mapping[str, Any]) -> DataFlow:
    for k in BUILT_IN_ONLY:
        if k in cfg:
            raise ConfigError(f"{k}: not used with factory (only the built-in source/steps "
                              "pipeline reads it; the factory builds the whole pipeline: pass "
                              "what it needs in args)")
    spec = cfg["factory"]
    fn = load_object(spec, "factory")
    args = cfg.get("args")
    out = call_with_args(fn, {} if args is None else args, "args", spec)
    if not isinstance(out, Iterable):
        raise ConfigError(f"factory: {spec} returned a {type(out).__name__}, not a DataFlow "
                          "or an iterable of datapoints")
    df = as_dataflow(out)
    # Not introspectable: its output is one stage, and its skips are those of every stage
    # of its chain that counts any.
    return CountData(df, "factory", skips=[s for s in stages(df) if isinstance(s, Counted)])


def pipeline_stages(df: DataFlow) -> list[CountData]:
    """The counted stages of a pipeline :func:`build_pipeline` built, source first."""
    return [s for s in reversed(list(stages(df))) if isinstance(s, CountData)]


def _parallel(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``parallel`` of a pipeline map: a mode and a worker count, either of which may be
    ``auto`` (``parallel: auto`` is both). Without ``parallel``, a pipeline with image steps
    (the presets) is ``auto``, any other runs in the producer process."""
    raw = cfg.get("parallel")
    if raw is None and "parallel" not in cfg and _has_presets(cfg):
        raw = "auto"
    if raw == "auto":
        raw = {"mode": "auto"}
    a = Args(raw, "parallel")
    mode = a.text("mode", "none", choices=(*MODES, "auto"))
    workers = a.get("workers", "auto" if mode == "auto" else 1)
    if workers != "auto":
        workers = a.integer("workers", 1, lo=1)
    elif mode == "none":
        mode = "auto"
    p = {"mode": mode, "workers": workers, "strict": a.flag("strict", False),
         "buffer_size": a.integer("buffer_size", 64, lo=1)}
    a.done()
    if workers == "auto" and mode == "runner":
        raise ConfigError("parallel.workers: auto tunes the map steps' threads or processes; "
                          "with mode: runner give a number")
    if workers == "auto" and p["strict"]:
        raise ConfigError("parallel.workers: auto changes which worker gets a datapoint as it "
                          "measures; strict (reproducible) output needs a number of workers")
    if workers != "auto" and p["buffer_size"] < workers:
        raise ConfigError(f"parallel.buffer_size: must be >= parallel.workers ({workers})")
    return p


def _has_presets(cfg: Mapping[str, Any]) -> bool:
    steps = cfg.get("steps")
    return isinstance(steps, list) and any(
        isinstance(s, Mapping) and len(s) == 1 and next(iter(s)) in PRESETS for s in steps)


def _wrap_map(ds: DataFlow, funcs: list, par: dict[str, Any], on_error: str,
              steps: list[tuple[int, str]]) -> DataFlow:
    """One stage running ``funcs`` (map ``steps``, fused), counted under their label."""
    func = funcs[0] if len(funcs) == 1 else Chain(funcs)
    (first, _), (last, _) = steps[0], steps[-1]
    index = str(first) if first == last else f"{first}-{last}"
    label = f"{index}:{'+'.join(kind for _, kind in steps)}"
    mode, workers, buffer = par["mode"], par["workers"], par["buffer_size"]
    auto = None
    if workers == "auto":
        budget = cpu_budget()
        if mode == "auto" and budget.workers == 1:
            # One CPU: a worker would only add its hand-over to the same CPU's work.
            inline = InlineMapData(ds, func, f"auto: {budget.cores:g} CPU by {budget.source}",
                                   on_error)
            return CountData(inline, label, skips=[inline])
        # A thread more than CPUs hides I/O; a process more would only compete with ours.
        his = {"thread": budget.workers + 1, "process": budget.workers}
        modes = ("thread", "process") if mode == "auto" else (mode,)
        buffer = max(buffer, 8 * sum(his[m] for m in modes))
        auto = AutoWorkers(ModeTuner(modes, his, start=budget.workers), buffer,
                           note=f"auto: {' or '.join(plural(m) for m in modes)}, "
                           f"{budget.cores:g} CPUs by {budget.source}")
        if mode == "auto":
            both = AutoMapData(ds, func, his["thread"], his["process"], auto, buffer, on_error)
            both.name = label
            return CountData(both, label, skips=[both])
        workers = his[mode]
    elif mode == "auto":
        # A number of workers, and no mode: the image steps release the GIL where their time
        # goes (libjpeg, OpenCV); Python in a map step holds it.
        mode = "thread" if all(kind in PRESETS for _, kind in steps) else "process"
    m: DataFlow
    if mode == "thread":
        m = MultiThreadMapData(ds, workers, func, buffer, par["strict"], on_error,
                               autotune=auto)
    elif mode == "process":
        m = MultiProcessMapData(ds, workers, func, buffer, par["strict"], on_error,
                                autotune=auto)
    else:
        m = MapData(ds, func, on_error)
    if isinstance(m, ParallelMapBase):
        m.name = label
    return CountData(m, label, skips=[m])


def parallel_summary(df: DataFlow) -> str:
    """The map stages' workers, in words (the producer's start-up line): ``0:imagenet_train
    2 threads (auto 1-3, 2 CPUs by affinity)``; "" for a pipeline without parallel map."""
    out = []
    for s in pipeline_stages(df):
        for m in s.skips:
            if isinstance(m, InlineMapData):
                out.append(f"{s.name} in the producer's thread ({m.note})")
            elif isinstance(m, ParallelMapBase):
                kind = plural(m.mode) if m.active != 1 else m.mode
                note = f" ({m.auto.note})" if m.auto is not None else ""
                out.append(f"{s.name} {m.active} {kind}{note}")
    return ", ".join(out)


def _runner(ds: DataFlow, par: dict[str, Any]) -> DataFlow:
    # Over shards the workers split the producer's shards (worker k of n reads every n-th):
    # each of its shards once per pass, a pass ending when every worker has read its own.
    # Unstrict copies would each read all of them, and a pass would be len(ds) datapoints,
    # which shards named by urls do not know (no manifest).
    strict = par["strict"] or isinstance(source_of(ds), ShardedSource)
    try:
        return MultiProcessRunner(ds, par["workers"], par["buffer_size"], strict)
    except ValueError as e:
        raise ConfigError(f"parallel: {e}") from None


def _check_stream(cfg: Mapping[str, Any]) -> None:
    """``stream`` names the stream (consumers pick theirs); ``delivery`` is ``training``
    (the default: fast, at most once) or ``exact`` (every sample once per epoch: built by
    :func:`feedline.producer.exact.build_exact`, not here)."""
    top = Args(cfg, "pipeline")
    stream = top.text("stream", "default")
    if stream is not None:
        try:
            check_stream(stream)
        except ValueError as e:
            raise ConfigError(f"stream: {e}") from None
    delivery = top.text("delivery", "training", choices=("training", "exact"))
    if "exact" in cfg and delivery != "exact":
        raise ConfigError("exact: only with delivery: exact")


def build_pipeline(cfg: Mapping[str, Any]) -> DataFlow:
    """Build the DataFlow a pipeline map describes (workers start at ``reset_state()``)."""
    for k in cfg:
        if k not in TOP_LEVEL:
            near = difflib.get_close_matches(str(k), list(TOP_LEVEL), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"{k}: unknown key ({hint}known: {list(TOP_LEVEL)})")
    _check_stream(cfg)
    if "factory" in cfg:
        return _factory(cfg)
    if "args" in cfg:
        raise ConfigError("args: only used with factory (the built-in pipeline takes its "
                          "arguments in source and steps)")
    top = Args(cfg, "pipeline")
    seed = top.integer("seed", 0)
    on_error = top.text("on_error", "raise", choices=("raise", "skip"))
    par = _parallel(cfg)
    source = top.get("source", required=True)
    name, args = one_key(source, "source", SOURCES)
    a = Args(args, f"source.{name}")
    ds = SOURCES[name](a, seed)
    a.done()
    if par["mode"] == "runner" and isinstance(ds, ShardedSource) and ds.claims \
            and "shard" not in cfg:
        raise ConfigError(f"parallel.mode: runner runs whole copies of the source in worker "
                          f"processes, and source.{name} claims its shards from the broker in "
                          "the producer's: use mode: process (the map steps in worker "
                          "processes), or give the source a static shard (claim: false)")
    if "shard" in cfg:
        s = Args(cfg["shard"], "shard").expect("index", "count")
        index = s.integer("index", required=True, lo=0)
        count = s.integer("count", required=True, lo=1)
        s.done()
        if not isinstance(ds, Shardable):
            raise ConfigError(f"shard: source '{name}' cannot be sharded")
        guarded("shard", lambda: check_shard(index, count))
        ds.set_shard(index, count)
    ds = CountData(ds, f"source:{name}")

    steps = cfg.get("steps") or []
    if not isinstance(steps, list):
        raise ConfigError("steps: expected a list")
    known = {**MAP_STEPS, **STEPS}
    funcs: list[Any] = []
    fused: list[tuple[int, str]] = []  # the map steps in funcs: (index, kind)
    runner_done = par["mode"] != "runner"
    for i, item in enumerate(steps):
        where = f"steps[{i}]"
        step, sargs = one_key(item, where, known)
        a = Args(sargs, f"{where}.{step}")
        step_seed = seed * 1000 + i  # distinct streams per step, all from one seed
        if step in MAP_STEPS:
            component = a.get("component", 0)
            if component is None and step != "map":
                raise ConfigError(f"{a.field('component')}: null (the whole datapoint) is "
                                  f"only for map steps; {step} works on one image: give its "
                                  "index or key")
            if component is not None and (not isinstance(component, (int, str))
                                          or isinstance(component, bool)):
                raise ConfigError(f"{a.field('component')}: expected an int or a key"
                                  f"{', or null' if step == 'map' else ''}, got {component!r}")
            f = MAP_STEPS[step](a, step_seed)
            funcs.append(f if component is None else ComponentFunc(f, component))
            fused.append((i, step))
            a.done()
            continue
        if funcs:
            ds = _wrap_map(ds, funcs, par, on_error, fused)
            funcs, fused = [], []
        if step == "batch" and not runner_done:
            ds = _runner(ds, par)
            runner_done = True
        try:
            if step == "batch":  # the pipeline's on_error: a sample that does not stack
                batch = batch_step(ds, a, step_seed, on_error)
                ds = CountData(batch, f"{i}:{step}", skips=[batch])
            else:
                ds = CountData(STEPS[step](ds, a, step_seed), f"{i}:{step}")
        except (ValueError, TypeError) as e:
            raise located(where, e) from None
        a.done()
    if funcs:
        ds = _wrap_map(ds, funcs, par, on_error, fused)
    if not runner_done:
        ds = _runner(ds, par)
    return ds
