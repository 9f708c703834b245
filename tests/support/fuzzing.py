"""The fuzz harnesses' time-boxed run, as the tests run each (fuzz/*.py, atheris): a corpus,
a libFuzzer run of a few seconds, and the checks that it found nothing and ran enough inputs
to mean something."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def time_boxed_fuzz(harness: Path, corpus: Path, work: Path, seconds: int,
                    min_runs: int) -> int:
    """Run ``harness`` over ``corpus`` (made already) for ``seconds``; assert it found nothing
    (no crash, no artifact: the inputs are named, with how to replay them) and ran at least
    ``min_runs`` inputs; returns how many it ran."""
    artifacts = work / "artifacts"
    artifacts.mkdir(exist_ok=True)
    run = subprocess.run(
        [sys.executable, str(harness), str(corpus), f"-max_total_time={seconds}",
         "-rss_limit_mb=2048", "-timeout=10", "-print_final_stats=1",
         f"-artifact_prefix={artifacts}/"],
        capture_output=True, text=True, timeout=seconds + 120, cwd=work)
    out = run.stdout + run.stderr
    findings = sorted(p.name for p in artifacts.iterdir())
    assert run.returncode == 0 and not findings, (
        f"the fuzzer found something (inputs in {artifacts}: {findings}; replay with "
        f"python {harness} FILE):\n{out[-6000:]}")
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
    assert m, out[-3000:]
    runs = int(m.group(1))
    assert runs >= min_runs, f"only {runs} runs:\n{out[-3000:]}"
    rate = re.search(r"stat::average_exec_per_sec:\s*(\d+)", out)
    print(f"fuzzed {runs} inputs in ~{seconds}s ({rate.group(1) if rate else '?'}/s)")
    return runs
