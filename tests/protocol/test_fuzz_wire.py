"""The atheris harness of the wire decoder (fuzz/fuzz_wire.py): its seeds decode, and a
time-boxed libFuzzer run finds nothing (only DecodeError ever escapes the decoder)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import ROOT
from tests.support.fuzzing import time_boxed_fuzz

pytest.importorskip(
    "atheris", reason="atheris is not installed (pip install atheris; the test extra has it "
    "on CPython 3.11+, Linux x86_64, where atheris has wheels)")

HARNESS = ROOT / "fuzz" / "fuzz_wire.py"
FUZZ_SECONDS = 20
# This harness does thousands of runs a second on one core; a run that managed only this
# many did not fuzz (it crashed at start, or never got past its seeds).
MIN_RUNS = 2000


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_wire", HARNESS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seeds_are_valid_messages_and_the_harness_sees_rejections() -> None:
    fw = _harness()
    seeds = fw.seeds()
    results = {name: fw.one_input(data) for name, data in seeds.items()}
    encoded = {n: r for n, r in results.items() if n.startswith(("batch", "header", "bundle",
                                                                 "tensorpack", "control"))}
    assert encoded and set(encoded.values()) == {"ok"}, encoded
    # Raw and truncated variants of a valid batch are refused with a reason, not an error.
    batch = seeds["batch-0-0"]
    assert fw.one_input(batch[:-1]) == "rejected:shape_mismatch"
    assert fw.one_input(batch[:2] + fw.join_frames(fw.split_frames(batch[2:])[:2])) == (
        "rejected:frame_count")
    assert fw.one_input(bytes([1, 0]) + b"\xc1") == "rejected:bad_msgpack"
    # A bundle one frame short does not divide into its batches: refused whole.
    bundled = seeds["bundle-0"]
    assert fw.one_input(bundled[:2] + fw.join_frames(fw.split_frames(bundled[2:])[:-1])) == (
        "rejected:frame_count")


@pytest.mark.slow
def test_a_shape_with_a_string_among_huge_dims_costs_the_harness_nothing() -> None:
    """A 22-byte input the CI run reported as an out-of-memory: the harness itself computed
    the claimed size with ``np.prod(shape, dtype=object)``, and 4294967297 * "3" is a 4 GB
    string. The decoder refused the header at once; the harness must not allocate either."""
    import resource

    fw = _harness()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    oom = bytes.fromhex("03221822226a6a6a6a6a6a6a9c9515956a6a6a010222")
    assert fw.one_input(oom) == "rejected:bad_shape"
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 512, grown_mb


def test_time_boxed_fuzz_run_finds_nothing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    made = subprocess.run([sys.executable, str(HARNESS), "--make-corpus", str(corpus)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    time_boxed_fuzz(HARNESS, corpus, tmp_path, FUZZ_SECONDS, MIN_RUNS)
