"""Soak: ``feedline demo`` many times in a row under CPU load; count aborts and leftovers.

A busy loop runs on every core (like ``stress --cpu N``) while the demo runs ``--runs`` times,
one after the other, each in its own work directory and with its own ``TMPDIR`` under one
soak directory. After each run it records the exit status (an abort is a death by a signal,
or libzmq's "Assertion failed" in the output), how long it took, and what it left behind:
processes whose command line names the run's directory (the broker, producers and their
forked workers all do), temporary directories and socket files. Prints a line per run and a
summary; ``--json`` writes the runs. Bounded: each run has a timeout, after which its whole
process group is killed (and counted as a hang).

    python benchmarks/demo_soak.py --runs 20 --duration 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from feedline.procs import wait_for  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def busy_loops(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes spinning on the CPU (the load), each in its own session."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             start_new_session=True) for _ in range(n)]


def leftovers(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a run's directory)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if marker in cmd and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid():
                found.append(f"{p.pid} {cmd[:160]}")
        except psutil.Error:
            continue
    return found


def one_run(i: int, root: Path, args: argparse.Namespace) -> dict:
    work = root / f"run-{i:02d}"
    tmp = work / "tmp"
    tmp.mkdir(parents=True)
    argv = [sys.executable, "-m", "feedline.commands", "demo", "--duration", str(args.duration),
            "--workdir", str(work / "demo")]
    if args.no_train:
        argv.append("--no-train")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)})
    hung = False
    try:
        out, _ = proc.communicate(timeout=args.duration + args.timeout)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    seconds = time.monotonic() - t0
    # The daemons get SIGTERM when the demo exits; give them a moment to finish.
    try:
        wait_for(lambda: not leftovers(str(work)), 15, interval=0.2, what="daemons to exit")
    except TimeoutError:
        pass
    left = leftovers(str(work))
    for line in left:  # do not let one run's leftovers load the next
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    code = proc.returncode
    return {
        "run": i, "exit": code, "seconds": round(seconds, 1), "hung": hung,
        "abort": (code is not None and code < 0 and not hung) or "Assertion failed" in out,
        "processes_left": left,
        "temp_left": sorted(p.name for p in tmp.iterdir()),
        "sockets_left": sorted(str(p.relative_to(work)) for p in work.rglob("*.sock")),
        "tail": out.strip().splitlines()[-3:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20, help="demo runs, one after the other")
    ap.add_argument("--duration", type=float, default=5.0, help="each demo's --duration")
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2,
                    help="busy-loop processes (default: one per core)")
    ap.add_argument("--no-train", action="store_true", help="pass --no-train to the demo")
    ap.add_argument("--timeout", type=float, default=240.0,
                    help="seconds beyond --duration after which a run counts as hung")
    ap.add_argument("--json", default=None, help="write the runs here")
    args = ap.parse_args()

    load = busy_loops(args.load)
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="feedline-soak-") as tmp:
            root = Path(tmp)
            print(f"demo soak: {args.runs} runs of {args.duration:.0f} s, {args.load} busy "
                  f"loops, in {root}", flush=True)
            for i in range(1, args.runs + 1):
                r = one_run(i, root, args)
                runs.append(r)
                print(f"run {i:2d}/{args.runs}: exit {r['exit']}, {r['seconds']:5.1f} s"
                      f"{', ABORT' if r['abort'] else ''}{', HUNG' if r['hung'] else ''}, "
                      f"left: {len(r['processes_left'])} processes, {len(r['temp_left'])} temp "
                      f"dirs, {len(r['sockets_left'])} sockets", flush=True)
                if r["exit"] != 0:
                    print("    " + "\n    ".join(r["tail"]), flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
    aborts = sum(r["abort"] for r in runs)
    failed = sum(r["exit"] != 0 for r in runs)
    procs = sum(len(r["processes_left"]) for r in runs)
    print(f"\n{len(runs)} runs: {aborts} aborts, {failed} non-zero exits, "
          f"{sum(r['hung'] for r in runs)} hung, {procs} processes left, "
          f"{sum(len(r['temp_left']) for r in runs)} temp dirs left, "
          f"{sum(len(r['sockets_left']) for r in runs)} socket files left")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 1 if aborts or failed or procs else 0


if __name__ == "__main__":
    sys.exit(main())
