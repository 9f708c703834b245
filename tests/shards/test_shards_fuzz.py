"""The atheris harness of the shard readers (fuzz/fuzz_shards.py): its seeds read, the inputs
that found the harness's first findings stay fixed, and a time-boxed libFuzzer run finds
nothing (only CorruptRecord and ShardError escape the tar, TFRecord, Example, field and
Parquet readers; the reader and ``feedline info`` count the same samples; no datapoint holds
more than ``max_sample_bytes``; what they yield goes through the batch step under ``on_error:
skip`` batched or skipped, never a crash, and its batches encode for the wire)."""

from __future__ import annotations

import base64
import functools
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import ROOT
from tests.support.fuzzing import time_boxed_fuzz

pytest.importorskip(
    "atheris", reason="atheris is not installed (pip install atheris; the test extra has it "
    "on CPython 3.11+, Linux x86_64, where atheris has wheels)")

HARNESS = ROOT / "fuzz" / "fuzz_shards.py"
FUZZ_SECONDS = 10
# Hundreds of runs a second on one core (each reads a shard twice or three times); a run
# that managed fewer than this did not fuzz (it crashed at start, or never left its seeds).
MIN_RUNS = 1000


@functools.cache
def _harness() -> ModuleType:
    """The harness, imported once (atheris instruments what it imports: seconds)."""
    spec = importlib.util.spec_from_file_location("fuzz_shards", HARNESS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seeds_read_and_edits_reach_the_corrupt_paths() -> None:
    fs = _harness()
    results = {name: fs.one_input(data) for name, data in fs.seeds().items()}
    readers = {k: v for k, v in results.items()
               if not k.startswith(("field", "parquet", "odd", "example-1"))}
    assert readers and set(readers.values()) == {"ok"}, results
    if fs.PQ_SEEDS:
        assert {v for k, v in results.items() if k.startswith("parquet")} == {"rows:5"}
    assert results["field-cls"] == "corrupt" and results["field-json"] == "ok"
    # a list of two byte strings where the others have one: skipped at the batch step
    assert results["example-1-0"] == "ok skipped:1"
    # a tar header's checksum broken (0xFF is left unfixed), a TFRecord length cut short
    assert fs.one_input(bytes([1, 0, 0, 0, 0, 0, 150, 0xFF])) == "corrupt"
    assert fs.one_input(bytes([2, 0]) + bytes(11)) == "corrupt"
    assert fs.one_input(bytes([4, 0, 0x0A, 0x05])) == "rejected"  # an Example cut short


def test_odd_samples_are_corrupt_or_skipped_at_the_batch_step_never_a_crash() -> None:
    """Issue 53, round 2, finding 4, through the harness: each seed made the batch step (or
    the wire after it) raise OverflowError, TypeError, EncodeError or "cannot stack"."""
    fs = _harness()
    results = {k: fs.one_input(v) for k, v in fs.seeds().items() if k.startswith("odd")}
    assert results["odd-tar-0"] == "corrupt"  # the .cls past int64: the reader's
    assert results["odd-field-cls"] == results["odd-field-json"] == "corrupt"
    assert results["odd-tar-1"] == "ok"  # the deep .json is not among the first fields...
    deep = fs._sources(1 << 20)[0][1]  # ... but among the second source's: corrupt there
    items = list(deep.read_stream(fs.Bytes(fs.TAR_SEEDS[fs.ODD_TAR + 1]), "fuzz.tar"))
    assert [type(x).__name__ for x in items] == ["Named", "CorruptRecord", "Named"]
    assert results["odd-tfrecord-0"] == "ok skipped:1"  # a label of another shape
    if fs.PQ_SEEDS:
        assert results["odd-parquet-0"] == "rows:5 skipped:1"  # a null


# Inputs the harness found on its first runs, each a bug fixed with it:
FOUND = {
    # a feature value of wire type 0 (an int where a list belongs): TypeError in _fields
    "varint-feature": "BAEKVAoZCg1pbWFnZS9lbmNvZGVkEggAWAoBcAoBcQoRCgFmEgxbCgoIAA1pbWFnZS9lbmNvZ"
                      "GVkEggKBmxhc3IvbGFiZWwSDxoNCgsBgICAgICAgICAAQ==",
    # a member past max_sample_bytes cut short by the shard's end: the reader counted the
    # sample and the member, ``info`` the member only
    "over-and-cut": "AQQBDlQKGQoS0jHS0tLSZAgK",
    # a 10-byte varint (70 bits) as an int64 label: OverflowError in np.asarray(.., int64)
    "varint-70-bits": "//n//y0H9cn15/Xyjm1jZ2UvZW4Aegg=",
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_what_the_fuzzer_found_stays_fixed(name: str) -> None:
    fs = _harness()
    assert fs.one_input(base64.b64decode(FOUND[name])) in ("ok", "corrupt", "rejected")


def test_time_boxed_fuzz_run_finds_nothing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    assert _harness().make_corpus(corpus) > 0  # in this process: one instrumented start
    time_boxed_fuzz(HARNESS, corpus, tmp_path, FUZZ_SECONDS, MIN_RUNS)
