"""``feedline replay``: make one batch of an exact stream again, offline, bit for bit.

A batch of ``delivery: exact`` is a function of its pipeline file and its place: the unit's
samples in the order ``(seed, epoch, unit)`` gives, each augmented by randomness drawn from
``(seed, epoch, sample)`` (docs/tensorflow.md, "Which samples were in step N"). So this reads the
pipeline file and the dataset, runs that one batch (``ExactPipeline.batches(epoch, unit,
start=index)``), no broker, no producer, and prints its sample ids and a sha256 per component
(``--out FILE.npz``: the arrays themselves). Given a ledger line (``--ledger FILE --line N``)
it first checks that the file is the one that ran: another sample order (pipeline
fingerprint) is refused, another pipeline file or code version is said (the samples are the
same; their bytes may not be).

    feedline replay val.yaml --epoch 0 --unit 3 --index 1
    feedline replay val.yaml --ledger run.jsonl --line 341 --out step340.npz
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from feedline.errors import FeedlineError
from feedline.exact import Lineage, ledger_line
from feedline.flags import HelpFormatter
from feedline.version import code_version


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="make one batch of an exact stream again, offline",
                       description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("pipeline", metavar="PIPELINE.yaml", help="the pipeline file (delivery: "
                   "exact)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="the dataset, as feedline producer --data takes it (default: the "
                   "pipeline file's)")
    p.add_argument("--epoch", type=int, default=None, help="the batch's epoch")
    p.add_argument("--unit", type=int, default=None, help="its work unit")
    p.add_argument("--index", type=int, default=0, help="its index in the unit")
    p.add_argument("--ledger", default=None, metavar="FILE",
                   help="a consumer's ledger (ConsumerOptions(ledger=...)): replay its --line")
    p.add_argument("--line", type=int, default=None, metavar="N",
                   help="the ledger's line (from 1; step S is line S + 1 of a run's ledger)")
    p.add_argument("--out", default=None, metavar="FILE.npz",
                   help="write the batch's arrays here (one per component, named as printed)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=run)


def components(dp: Any, prefix: str = "") -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` of each leaf of a datapoint, in order: list and tuple entries by
    their index, dict entries by their key, nested ones joined by dots (``0``, ``1``;
    ``image``, ``meta.crop``). What replay hashes, and how a consumer's batch is compared."""
    if isinstance(dp, (list, tuple)):
        for k, v in enumerate(dp):
            yield from components(v, f"{prefix}{k}.")
    elif isinstance(dp, dict):
        for k, v in dp.items():
            yield from components(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1] or "0", np.asarray(dp)


def digest(a: np.ndarray) -> str:
    """The sha256 of an array's bytes in C order (its dtype and shape said beside it)."""
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def load(pipeline: str, data: str | None = None) -> Any:
    """The :class:`~feedline.producer.exact.ExactPipeline` of a pipeline file, as a producer
    builds it (``--data`` applied)."""
    from feedline.producer.cli import with_data
    from feedline.producer.exact import build_exact, is_exact
    from feedline.producer.pipeline import load_config

    cfg = with_data(load_config(pipeline), data)
    if not is_exact(cfg):
        raise FeedlineError("replay makes batches of delivery: exact only (a training "
                            "pipeline's batches are not a function of their place)")
    return build_exact(cfg)


def regenerate(pipe: Any, epoch: int, unit: int, index: int) -> Any:
    """The batch at ``(epoch, unit, index)``; None if every sample of it was skipped
    (``on_error: skip``: its producer sent nothing). Out of range is a FeedlineError."""
    spec = pipe.spec
    units = -(-spec.dataset_size // max(1, spec.unit_size))
    if not 0 <= unit < units:
        raise FeedlineError(f"unit {unit}: the pipeline has units 0..{units - 1}")
    # Any epoch: the file's ``epochs:`` is how long one run went, not part of the pipeline
    # (a run given more, or resumed past it, made later epochs from the same file).
    if epoch < 0:
        raise FeedlineError(f"epoch {epoch}: epochs are >= 0")
    slots = pipe.slots(epoch, unit)
    if not 0 <= index < slots:
        raise FeedlineError(f"index {index}: unit {unit} of epoch {epoch} has batches "
                            f"0..{slots - 1}")
    batches = pipe.batches(epoch, unit, start=index)
    try:
        return next(batches, (index, None))[1]
    finally:
        batches.close()  # its threads, now


def checked(pipe: Any, lin: Lineage) -> list[str]:
    """What a ledger line says against this pipeline file: a FeedlineError for another
    sample order; notes for another file or code."""
    if lin.unit < 0:
        raise FeedlineError("that ledger line is a training-mode batch: it has no place to "
                            "replay")
    if lin.pipeline and lin.pipeline != pipe.fingerprint:
        raise FeedlineError(f"this pipeline file does not make that batch: its sample order "
                            f"(seed, unit or batch size, shuffling, dataset) has fingerprint "
                            f"{pipe.fingerprint}, the ledger's batch {lin.pipeline}")
    notes = []
    if lin.pipeline_file and lin.pipeline_file != pipe.file_fingerprint:
        notes.append(f"note: the ledger's batch came from another pipeline file (fingerprint "
                     f"{lin.pipeline_file}, this one {pipe.file_fingerprint}): the same "
                     "samples, but another step setting may give other bytes")
    if lin.code and lin.code != code_version():
        notes.append(f"note: the ledger's batch was made by code {lin.code}, this is "
                     f"{code_version()}: the bytes may differ")
    return notes


def _write_npz(path: str, parts: list[tuple[str, np.ndarray]]) -> None:
    """An .npz as ``np.savez`` writes it, each component ``NAME.npy`` (numpy.lib.format),
    whatever its name: ``np.savez(f, **parts)`` takes "file" or "allow_pickle" as its own."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, a in parts:
            with z.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)


def _check_out(path: str) -> None:
    target = Path(path)
    if target.is_dir():
        raise FeedlineError(f"--out {path}: a directory; give a file name (batch.npz)")
    if not target.parent.is_dir():
        raise FeedlineError(f"--out {path}: its directory {target.parent} does not exist")


def run(args: argparse.Namespace) -> int:
    err = sys.stderr
    try:
        if args.ledger is not None:
            if args.line is None or args.epoch is not None or args.unit is not None:
                raise SystemExit("feedline replay: --ledger takes --line N (and no --epoch, "
                                 "--unit)")
            lin = ledger_line(args.ledger, args.line)
            epoch, unit, index = lin.epoch, lin.unit, lin.index
        else:
            if args.epoch is None or args.unit is None:
                raise SystemExit("feedline replay: give --epoch E --unit U [--index I], or "
                                 "--ledger FILE --line N")
            lin, epoch, unit, index = None, args.epoch, args.unit, args.index
        if args.ledger is not None and args.index != 0:
            raise SystemExit("feedline replay: --ledger takes --line N; the line gives the "
                             "batch's index (drop --index)")
        if args.out:
            _check_out(args.out)  # before minutes of decoding, not after
        try:
            pipe = load(args.pipeline, args.data)
        except UnicodeDecodeError:
            raise FeedlineError(f"{args.pipeline}: not a text file (a pipeline file is "
                                "YAML)") from None
        except FeedlineError as e:  # which file, where the message says only what
            raise FeedlineError(e if args.pipeline in str(e) else
                                f"{args.pipeline}: {e}") from None
        notes = checked(pipe, lin) if lin is not None else []
        for n in notes:
            print(n, file=err)
        batch = regenerate(pipe, epoch, unit, index)  # checks the place first
        ids = pipe.batch_samples(epoch, unit, index)
    except FeedlineError as e:  # ConfigError, DataError included
        raise SystemExit(f"feedline replay: {e}") from None
    except OSError as e:  # a ledger or pipeline file that is not there, a directory
        raise SystemExit(f"feedline replay: {e.filename or args.pipeline}: "
                         f"{e.strerror}") from None
    if batch is None:
        print(f"feedline replay: every sample of epoch {epoch} unit {unit} batch {index} was "
              "skipped (on_error: skip): its producer sent nothing", file=err)
        return 1
    parts = list(components(batch))
    if args.out:
        # Keys as one dict argument: a component named "file" or "allow_pickle" is an array
        # of the archive, not savez's parameter.
        _write_npz(args.out, parts)
    if args.json:
        print(json.dumps({
            "epoch": epoch, "unit": unit, "index": index, "samples": ids, "seed": pipe.seed,
            "pipeline": pipe.fingerprint, "file": pipe.file_fingerprint, "code": code_version(),
            "components": [{"name": k, "dtype": a.dtype.str, "shape": list(a.shape),
                            "sha256": digest(a)} for k, a in parts]}))
        return 0
    print(f"epoch {epoch} unit {unit} batch {index}: {len(ids)} samples {ids}")
    print(f"seed {pipe.seed}: each sample's randomness is drawn from (seed, epoch {epoch}, "
          "its id)")
    print(f"pipeline {pipe.fingerprint} file {pipe.file_fingerprint} code {code_version()}")
    for k, a in parts:
        print(f"{k}: {a.dtype.str} {list(a.shape)} sha256 {digest(a)}")
    if args.out:
        print(f"wrote {args.out}")
    return 0
