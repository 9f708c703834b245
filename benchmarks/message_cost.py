"""Where a message's CPU goes: every thread of every process of a transport variant.

Runs one variant of benchmarks/transport.py (same processes, same batches) and reads, over
the consumer's measured seconds, each thread's on-CPU time (``/proc/PID/task/TID/schedstat``)
of the sender, the broker (if any) and the consumer, named by ``py-spy dump`` (Python
threads) or their own names (libzmq's ``ZMQbg/IO/0``), in microseconds per batch. With
``--profile`` it also samples each Python process with py-spy (``pip install py-spy``; an
investigation tool, not a dependency) while a thread holds the GIL (``--gil``: Python's own
work, not its waits, nor libzmq's or the kernel's) and prints, per thread, the functions
that held it, in microseconds per batch (inclusive, from samples: approximate).

    python benchmarks/message_cost.py --variants raw direct feedline --size 150K --seconds 5
    python benchmarks/message_cost.py --variants direct direct-before --before DIR --size 16K
    python benchmarks/message_cost.py --variants direct --size 16K --profile
    python benchmarks/message_cost.py --variants raw direct --size 1M --perf

With ``--perf`` it also samples each process with Linux ``perf`` (``perf record``, the kernel
included: where libzmq's I/O thread copies a batch out of the socket, ``_copy_to_iter``) and
prints, per thread name and shared object, and for the top symbols, microseconds per batch.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.transport import Run, Size, result, variants  # noqa: E402

RATE = 200  # py-spy samples per second
PERF_HZ = 2000  # perf samples per second


def thread_times(pid: int) -> dict[int, tuple[str, int]]:
    """tid -> (name, on-CPU nanoseconds) of every thread of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[int(task.name)] = (name, ns)
    return out


def py_names(pid: int) -> dict[int, str]:
    """Python thread names by native id (py-spy dump), if py-spy is there."""
    if shutil.which("py-spy") is None:
        return {}
    out = subprocess.run(["py-spy", "dump", "--pid", str(pid), "--nonblocking"],
                         capture_output=True, text=True, timeout=30).stdout
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r'^Thread (\d+) \([^)]*\): "([^"]*)"', out, re.M)}


def profile_summary(path: Path, batches: int, top: int) -> list[str]:
    """py-spy's raw (collapsed) stacks -> per thread, top functions in us per batch."""
    per_thread: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r"^thread \(\d+\): ", "", frames[0])
        n = int(count)
        totals[thread] += n
        seen = set()
        for f in frames[1:]:
            fn = re.sub(r" \(([^:]*/)?([^/:]*):\d+\)$", r" (\2)", f)
            if fn not in seen:
                seen.add(fn)
                per_thread[thread][fn] += n
    us = 1e6 / RATE / max(1, batches)
    lines = []
    for thread, c in sorted(per_thread.items(), key=lambda kv: -totals[kv[0]]):
        lines.append(f"    {thread}: {totals[thread] * us:.1f} us/batch sampled")
        for fn, n in c.most_common(top):
            lines.append(f"      {n * us:8.1f}  {fn}")
    return lines


def perf_summary(path: Path, batches: int, top: int) -> list[str]:
    """``perf report`` of one process: us per batch by (thread, shared object), then by
    symbol (the top ``top``)."""
    us = 1e6 / PERF_HZ / max(1, batches)
    lines = []
    for sort, limit in (("comm,dso", 8), ("comm,sym", top)):
        out = subprocess.run(["perf", "report", "-i", str(path), "--stdio", "-n", "--sort", sort],
                             capture_output=True, text=True, timeout=120).stdout
        for row in [r for r in out.splitlines() if r.startswith(" ")][:limit]:
            f = row.split()  # percent, samples, what
            if len(f) >= 3 and f[1].isdigit():
                lines.append(f"      {int(f[1]) * us:8.1f}  {' '.join(f[2:])}")
        lines.append("")
    return lines


def measure(name: str, size: Size, seconds: float, work: Path, profile: bool,
            top: int, before: Path | None = None, perf: bool = False) -> None:
    run = Run(work, size, seconds)
    cons: subprocess.Popen | None = None
    try:
        kind, addr, tree = variants(before)[name](run)
        cons = subprocess.Popen([*run.consumer_argv(kind, addr), "hold"],
                                env=run.consumer_env(tree), cwd=work, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        procs = {_role(c.argv): c.pid for c in run.children}
        procs["consumer"] = cons.pid
        assert cons.stdout is not None
        line = cons.stdout.readline()
        if not line.startswith("MARK"):
            raise RuntimeError(f"{name}: consumer said {line!r}")
        names = {role: py_names(pid) for role, pid in procs.items()}
        at_start = {role: thread_times(pid) for role, pid in procs.items()}
        # (role, samples file, sampler, what its summary says, the summary)
        spies: list[tuple[str, Path, subprocess.Popen, str, Any]] = []
        if profile:
            for role, pid in procs.items():
                out = work / f"{role}.spy"
                spies.append((role, out, subprocess.Popen(
                    ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)),
                     "--rate", str(RATE), "--format", "raw", "--threads", "--gil", "--nonblocking",
                     "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                    "py-spy, holding the GIL, inclusive", profile_summary))
        if perf:
            for role, pid in procs.items():
                out = work / f"{role}.perf"
                spies.append((role, out, subprocess.Popen(
                    ["perf", "record", "-F", str(PERF_HZ), "-o", str(out), "-p", str(pid), "--",
                     "sleep", str(seconds)], stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL),
                    "perf: thread and object, then symbols; us per batch", perf_summary))
        line = cons.stdout.readline()
        after = {role: thread_times(pid) for role, pid in procs.items()}
        for _, _, spy, _, _ in spies:
            spy.wait(seconds + 30)
        assert cons.stdin is not None
        cons.stdin.write("\n")
        cons.stdin.close()
        cons.wait(30)
        r = json.loads(line)
    finally:
        if cons is not None and cons.poll() is None:  # it waits for us ("hold"): a failure
            cons.kill()  # here must not leave it holding our stdout's pipe
            cons.wait(30)
        run.close()
    res = result(r)
    batches = r["batches"]
    print(f"\n{name}, {size.name}: {res['gbps']:.2f} GB/s, {res['batches_per_s']:.0f} "
          f"batches/s, consumer {res['cpu_s_per_gb']:.3f} CPU-s/GB; CPU us per batch:")
    for role in procs:
        rows = []
        for tid, (comm, ns) in after[role].items():
            ns0 = at_start[role].get(tid, (comm, 0))[1]
            label = names[role].get(tid, comm)
            rows.append((label, (ns - ns0) / 1e3 / batches))
        total = sum(v for _, v in rows)
        parts = ", ".join(f"{lbl} {v:.1f}" for lbl, v in sorted(rows, key=lambda x: -x[1])
                          if abs(v) >= 0.5)
        print(f"  {role:<9} {total:7.1f}  ({parts})")
    for role, out, _, what, summarize in spies:
        if out.exists():
            print(f"  {role} ({what}):")
            print("\n".join(summarize(out, batches, top)))


def _role(argv: list[str]) -> str:
    text = " ".join(argv)
    if "feedline.broker" in text:
        return "broker"
    if "zmq.proxy" in text:
        return "relay"
    return "sender"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["raw", "direct", "feedline"],
                    help="transport.py variants to measure (default raw direct feedline)")
    ap.add_argument("--size", default="150K", help="batch size (as transport.py --sizes)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per variant")
    ap.add_argument("--before", type=Path, default=None,
                    help="another checkout: variants before and direct-before run from it")
    ap.add_argument("--profile", action="store_true", help="also sample with py-spy")
    ap.add_argument("--perf", action="store_true",
                    help="also sample with Linux perf (the kernel and libzmq included)")
    ap.add_argument("--top", type=int, default=25, help="functions per thread in a profile")
    args = ap.parse_args()
    for flag, tool, how in (("profile", "py-spy", "pip install py-spy"),
                            ("perf", "perf", "apt-get install linux-perf")):
        if getattr(args, flag) and shutil.which(tool) is None:
            ap.error(f"--{flag} needs {tool}, which is not on PATH: {how}")
    size = Size.parse(args.size)
    with tempfile.TemporaryDirectory(prefix="feedline-cost-") as tmp:
        for name in args.variants:
            work = Path(tmp) / name
            work.mkdir()
            measure(name, size, args.seconds, work, args.profile, args.top, args.before,
                    args.perf)


if __name__ == "__main__":
    main()
