"""The atheris harness of the fused JPEG decoder (fuzz/fuzz_jpeg.py): its seeds decode, its
edits reach the error paths, and a time-boxed libFuzzer run finds nothing (only CorruptImage
and Unsupported ever escape, nothing crashes, nothing allocates past the run's limit)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from feedline.producer.image import turbo
from tests.support import ROOT
from tests.support.fuzzing import time_boxed_fuzz

pytest.importorskip(
    "atheris", reason="atheris is not installed (pip install atheris; the test extra has it "
    "on CPython 3.11+, Linux x86_64, where atheris has wheels)")
pytestmark = pytest.mark.skipif(not turbo.AVAILABLE, reason=turbo.decoder_info())

HARNESS = ROOT / "fuzz" / "fuzz_jpeg.py"
FUZZ_SECONDS = 20
# Thousands of small decodes a second on one core; fewer means it did not fuzz.
MIN_RUNS = 2000


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_jpeg", HARNESS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seeds_decode_and_edits_reach_the_error_paths() -> None:
    fj = _harness()
    results = {name: fj.one_input(data) for name, data in fj.seeds().items()}
    cmyk = {f"{m}-{i}-{g}" for m in ("file", "edit") for g in ("whole", "crop")
            for i in (len(fj.SEED_FILES) - 4, len(fj.SEED_FILES) - 3)}  # CMYK, YCCK
    assert {v for k, v in results.items() if k in cmyk} == {"unsupported"}
    assert {v for k, v in results.items() if k not in cmyk} == {"ok"}, results
    geom = bytes([0, 0, 255, 255, 63, 0, 0, 0])
    # Truncated after 300 bytes, a byte of the frame header changed, raw garbage:
    assert fj.one_input(bytes([1]) + geom + bytes([0]) + (300).to_bytes(2, "big")) == "corrupt"
    assert fj.one_input(bytes([0]) + geom + b"\xff\xd8\xff\xdb" + bytes(64)) == "corrupt"
    assert fj.one_input(bytes([0, 1])) == "short"
    # Mode 2: lies in a prepared seed's index (version 2; row 1 moved by 5 bytes) and scan
    # (a restart marker renumbered; the file cut 100 bytes into its scan).
    assert fj.PREPARED and any(k.startswith("lie-") for k in results)
    lie = bytes([2]) + geom + bytes([0])
    for op, value in [(1, 2), (0, (1 << 16) | 5), (2, (7 << 8) | 6), (3, 100)]:
        assert fj.one_input(lie + bytes([op]) + value.to_bytes(4, "big")) == "corrupt", op
    # Mode 3: lies in a side index (entries edited, the index cut short): the image decodes
    # (without the index once it is refused).
    assert fj.INDEXED and any(k.startswith("index-") for k in results)
    for edits in [bytes([0, 5, 0xFF]), bytes([0xFF, 0xFF, 3]), bytes([0, 1, 0, 0, 2, 0x80])]:
        assert fj.one_input(bytes([3]) + geom + bytes([0]) + edits) == "ok", edits


def test_time_boxed_fuzz_run_finds_nothing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    made = subprocess.run([sys.executable, str(HARNESS), "--make-corpus", str(corpus)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    time_boxed_fuzz(HARNESS, corpus, tmp_path, FUZZ_SECONDS, MIN_RUNS)
