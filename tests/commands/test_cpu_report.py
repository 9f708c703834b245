"""tests/support/cpu_report.py: a test's CPU, its child processes' included, reaches the report,
from
every pytest-xdist worker, and the costliest come first in its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cpu_report import summary

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = '''
import subprocess, sys

def test_burns_in_a_child():
    burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)

def test_idle():
    pass
'''


def test_a_childs_cpu_is_counted_for_the_test_that_started_it(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    report = tmp_path / "cpu.jsonl"
    report.write_text('{"id": "left from an earlier run", "self": 99, "children": 0, "wall": 1}\n')
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "tests.support.cpu_report",
         "--cpu-report", str(report), "-p", "no:cacheprovider", str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["id"].split("::")[-1]: r for r in map(json.loads, report.read_text().splitlines())}
    assert set(rows) == {"test_burns_in_a_child", "test_idle"}, rows  # the old line is gone
    assert rows["test_burns_in_a_child"]["children"] >= 0.5, rows
    assert rows["test_idle"]["children"] < 0.1, rows
    lines = summary(report)
    assert lines[1].endswith("test_sample.py::test_burns_in_a_child"), lines
    assert "cpu report" in out.stdout and "test_burns_in_a_child" in out.stdout, out.stdout


def test_the_modules_every_daemon_imports_are_compiled_before_the_tests_run() -> None:
    """conftest's ``pytest_sessionstart`` byte-compiles feedline and tests/: where
    ``PYTHONDONTWRITEBYTECODE`` is set, each process the suite starts would otherwise compile
    them from source again. A cache counts if its header names the source's mtime and size
    (what the import system checks)."""
    import importlib.util

    import feedline.broker.core
    import feedline.producer.cli
    import tests.support.exact_ledger

    for mod in (feedline.broker.core, feedline.producer.cli, tests.support.exact_ledger):
        src = Path(str(mod.__file__))
        cache = Path(importlib.util.cache_from_source(str(src)))
        assert cache.exists(), f"no bytecode for {src}"
        head, st = cache.read_bytes()[:16], src.stat()
        assert int.from_bytes(head[8:12], "little") == int(st.st_mtime) & 0xFFFFFFFF, cache
        assert int.from_bytes(head[12:16], "little") == st.st_size & 0xFFFFFFFF, cache


def test_the_processes_the_suite_starts_have_one_openblas_thread() -> None:
    """conftest's ``pytest_configure`` sets ``OPENBLAS_NUM_THREADS=1`` for every process the
    suite starts: a child that imports NumPy has one thread, not one per core."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: OpenBLAS starts no extra thread either way")
    code = "import os, numpy; print(len(os.listdir('/proc/self/task')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "1", out.stdout
