"""Exact delivery vs training mode: one pipeline's throughput both ways, in the same run.

    python benchmarks/exact.py --rounds 3 --seconds 10
    python benchmarks/exact.py --pipeline jpeg --data data/bench-jpeg --rounds 3
    python benchmarks/exact.py --rounds 1 --profile /tmp/exact-prof

The same pipeline file twice: as it is (training mode, epochs forever) and with
``delivery: exact`` (units of ``--unit`` samples, epochs forever). Each run starts a broker
process (exact: with ``--state-dir``, as a deployment of exact delivery would), ``--producers``
producer processes, and consumes in this process with ``RemoteDataZMQ(stream=...)``: a warm-up
of ``--warmup`` seconds, then ``--seconds`` measured; the rate is samples/s over the measured
seconds, epoch ends included (an exact epoch ends when its last unit is taken: producers
with no unit left wait). Rounds alternate the order of the modes; the report gives medians,
the ratio exact / training (target >= 0.9x), the CPU seconds per 1000 samples of the
producers and of the broker (psutil), which say where extra work goes, and samples per
CPU-second of every process (producers, broker, this consumer): on a shared machine a mode
with more runnable threads gets more of the cores, which the wall-clock ratio cannot tell
from speed. ``--profile DIR``
runs the producers and the broker under cProfile and prints each mode's top functions.

Pipelines (``--pipeline``):

- ``fake``: constant 224x224x3 uint8 images with int32 labels, no map step: nothing to hide
  exact delivery's per-batch costs behind (the worst case for the ratio);
- ``jpeg``: the ImageNet validation transform (decode, resize 256, centre crop 224) on a
  folder of JPEGs (``python benchmarks/make_jpegs.py data/bench-jpeg --count 1024``).
"""

from __future__ import annotations

import argparse
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from feedline.consumer import ConsumerOptions, RemoteDataZMQ  # noqa: E402
from feedline.procs import Child, free_port, wait_for  # noqa: E402

STREAM = "bench"
MODES = ("training", "exact")
LEDGER = "exact-ledger"  # --ledger: exact, the consumer writing its lineage ledger


def pipeline(a: argparse.Namespace) -> dict[str, Any]:
    """The training-mode form of the pipeline (epochs forever)."""
    steps: list[dict[str, Any]] = [{"batch": {"batch_size": a.batch}}]
    if a.pipeline == "jpeg":
        if a.data is None:
            raise SystemExit("--pipeline jpeg needs --data DIR (benchmarks/make_jpegs.py)")
        source: dict[str, Any] = {"image_folder": {"root": str(a.data), "shuffle": False}}
        steps.insert(0, {"imagenet_val": {"component": 0, "size": 224, "resize": 256}})
    else:
        source = {"fake": {"shapes": [[224, 224, 3], [1]], "dtypes": ["uint8", "int32"],
                           "random": False, "size": a.samples}}
    return {"stream": STREAM, "seed": 0, "source": source, "steps": steps, "epochs": None}


def exact_form(cfg: dict[str, Any], unit: int) -> dict[str, Any]:
    return {**cfg, "delivery": "exact", "exact": {"unit_size": unit}}


class Run:
    """One mode's broker and producers in a work directory."""

    def __init__(self, work: Path, mode: str, a: argparse.Namespace) -> None:
        self.work, self.mode, self.a = work, mode, a
        self.children: list[Child] = []
        self.profiles: list[Path] = []

    def _python(self, module: str, args: list[str], name: str) -> Child:
        argv = [sys.executable]
        if self.a.profile is not None:
            prof = self.a.profile / f"{self.mode}-{name}.prof"
            self.profiles.append(prof)
            argv += ["-m", "cProfile", "-o", str(prof)]
        # cwd: python -m puts the working directory first on the path; ROOT is the tree.
        c = Child([*argv, "-m", module, *args], self.work / f"{name}.log",
                  env={"PYTHONPATH": str(ROOT)}, cwd=self.work)
        self.children.append(c)
        return c

    def measure(self, cfg: dict[str, Any]) -> dict[str, float]:
        a = self.a
        ingress = f"tcp://127.0.0.1:{free_port()}"
        egress = f"ipc://{self.work}/egress.sock"
        path = self.work / "pipeline.yaml"
        path.write_text(yaml.safe_dump(cfg))
        extra = [] if not self.mode.startswith("exact") else ["--exact-ephemeral"] \
            if a.no_journal else ["--state-dir", str(self.work / "state")]
        broker = self._python("feedline.broker", ["--ingress", ingress, "--egress", egress,
                                         "--metrics-port", "0", "--log-level", "WARNING",
                                         *extra], "broker")
        wait_for(lambda: Path(egress[6:]).exists() or not broker.alive(), 30, what="broker")
        producers = [self._python("feedline.producer", ["--config", str(path), "--broker", ingress,
                                               "--id", f"p{i}", "--log-level", "WARNING"],
                                  f"p{i}") for i in range(a.producers)]
        ledger = self.work / "ledger.jsonl" if self.mode == LEDGER else None
        with RemoteDataZMQ(egress, stream=STREAM, timeout=120, return_meta=True,
                           options=ConsumerOptions(window=a.window, ledger=ledger)) as src:
            it = iter(src)
            next(it)
            t_warm = time.perf_counter() + a.warmup
            while time.perf_counter() < t_warm:
                next(it)
            procs = [psutil.Process(c.pid) for c in producers]
            bproc, me = psutil.Process(broker.pid), psutil.Process()
            cpu0 = ([sum(p.cpu_times()[:2]) for p in procs], sum(bproc.cpu_times()[:2]),
                    sum(me.cpu_times()[:2]))
            samples, epochs, times = 0, set(), []
            last: dict[int, float] = {}  # epoch -> its last batch's arrival
            switches = []  # the last batch of an epoch to the first of the next
            t0 = time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < a.seconds:
                b = next(it)
                now = time.perf_counter()
                times.append(now)
                samples += len(b.datapoint[0])
                if b.epoch not in epochs and b.epoch - 1 in last:
                    switches.append(now - last[b.epoch - 1])
                epochs.add(b.epoch)
                last[b.epoch] = now
            cpu1 = ([sum(p.cpu_times()[:2]) for p in procs], sum(bproc.cpu_times()[:2]),
                    sum(me.cpu_times()[:2]))
        producer_cpu = sum(cpu1[0]) - sum(cpu0[0])
        total_cpu = producer_cpu + cpu1[1] - cpu0[1] + cpu1[2] - cpu0[2]
        gaps = [y - x for x, y in zip([t0, *times], times, strict=False)]
        # Stalls: time between batches beyond 5x the typical gap (an epoch's end, a wait).
        typical = statistics.median(gaps)
        stall = sum(g - typical for g in gaps if g > 5 * typical)
        return {"samples_per_s": samples / elapsed, "batches_per_s": len(times) / elapsed,
                "epochs_seen": len(epochs), "stall_s": stall,
                "switch_s": statistics.median(switches) if switches else 0.0,
                "producer_cpu_ms_per_1k": 1e6 * producer_cpu / max(samples, 1),
                "broker_cpu_ms_per_1k": 1e6 * (cpu1[1] - cpu0[1]) / max(samples, 1),
                # The consumer's (this process's) CPU a batch: where a ledger costs.
                "consumer_cpu_us_per_batch": 1e6 * (cpu1[2] - cpu0[2]) / max(len(times), 1),
                "samples_per_cpu_s": samples / max(total_cpu, 1e-9)}

    def close(self) -> None:
        for c in reversed(self.children):
            c.stop(timeout=20)  # SIGTERM: a profiled process writes its profile


def produce_one_epoch(mode: str, cfg: dict[str, Any]) -> float:
    """Samples/s of one epoch made in this process, no broker: the pipeline alone (exact: unit
    by unit, as its producer runs it)."""
    from feedline.producer.exact import build_exact
    from feedline.producer.pipeline import build_pipeline

    samples = 0
    t0 = time.perf_counter()
    if mode == "exact":
        pipe = build_exact(cfg)
        for unit in range(-(-pipe.source.samples() // pipe.unit_size)):
            for _, batch in pipe.batches(0, unit):
                samples += len(batch[0]) if batch is not None else 0
    else:
        df = build_pipeline(cfg)
        df.reset_state()
        for batch in df:
            samples += len(batch[0])
        close = getattr(df, "close", None)
        if close is not None:
            close()
    return samples / (time.perf_counter() - t0)


def profile_report(paths: list[Path], top: int) -> None:
    for path in paths:
        if not path.exists():
            print(f"(no profile written: {path})")
            continue
        print(f"\n--- {path.name}: top {top} by own time")
        st = pstats.Stats(str(path))
        st.sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", choices=("fake", "jpeg"), default="fake")
    ap.add_argument("--data", type=lambda s: Path(s).resolve(), default=None,
                    help="JPEG folder (--pipeline jpeg; the producers run in a work directory)")
    ap.add_argument("--samples", type=int, default=16384,
                    help="dataset size of the fake pipeline (samples per epoch)")
    ap.add_argument("--batch", type=int, default=64, help="samples per batch")
    ap.add_argument("--unit", type=int, default=256, help="exact: samples per work unit")
    ap.add_argument("--producers", type=int, default=2, help="producer processes")
    ap.add_argument("--no-journal", action="store_true",
                    help="exact: run the broker with --exact-ephemeral instead of --state-dir "
                    "(no fsync'd journal)")
    ap.add_argument("--window", type=int, default=4, help="the consumer's window")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    ap.add_argument("--profile", type=Path, default=None,
                    help="write cProfile files here and print the top functions")
    ap.add_argument("--top", type=int, default=15, help="functions per profile printed")
    ap.add_argument("--in-process", action="store_true",
                    help="also time one epoch of each mode's pipeline in this process (no "
                         "broker): the producer's own cost, apart from transport")
    ap.add_argument("--ledger", action="store_true",
                    help="also run exact delivery with the consumer writing its lineage "
                    "ledger (ConsumerOptions(ledger=...)): the ledger's cost, exact-ledger / "
                    "exact")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args()
    modes = (*MODES, LEDGER) if a.ledger else MODES
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if a.profile is not None:
        a.profile.mkdir(parents=True, exist_ok=True)
    base = pipeline(a)
    cfgs = {"training": base, "exact": exact_form(base, a.unit)}
    cfgs[LEDGER] = cfgs["exact"]
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    runs: list[Run] = []
    for r in range(a.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            with tempfile.TemporaryDirectory(prefix=f"feedline-exact-{mode}-") as tmp:
                run = Run(Path(tmp), mode, a)
                try:
                    got = run.measure(cfgs[mode])
                finally:
                    run.close()
                runs.append(run)
            results[mode].append(got)
            print(f"round {r + 1} {mode}: {got['samples_per_s']:.0f} samples/s "
                  f"({got['epochs_seen']} epochs seen)", flush=True)
    med = {m: {k: statistics.median(x[k] for x in results[m]) for k in results[m][0]}
           for m in modes}
    print(f"\npipeline {a.pipeline}, batch {a.batch}, unit {a.unit}, {a.producers} producers, "
          f"{a.seconds:.0f} s measured per run, {a.rounds} rounds"
          f"{', exact without journal' if a.no_journal else ''}")
    print("| mode | samples/s per round | median samples/s | batches/s | epochs seen | "
          "stalled s | epoch switch s | producer CPU ms / 1000 samples | broker CPU ms / "
          "1000 samples | samples per CPU-s (all processes) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in modes:
        each = " / ".join(f"{x['samples_per_s']:.0f}" for x in results[m])
        print(f"| {m} | {each} | {med[m]['samples_per_s']:.0f} | "
              f"{med[m]['batches_per_s']:.1f} | {med[m]['epochs_seen']:.0f} | "
              f"{med[m]['stall_s']:.2f} | {med[m]['switch_s']:.2f} | "
              f"{med[m]['producer_cpu_ms_per_1k']:.0f} | "
              f"{med[m]['broker_cpu_ms_per_1k']:.0f} | {med[m]['samples_per_cpu_s']:.0f} |")
    ratio = med["exact"]["samples_per_s"] / med["training"]["samples_per_s"]
    per_cpu = med["exact"]["samples_per_cpu_s"] / med["training"]["samples_per_cpu_s"]
    print(f"\nexact / training = {ratio:.2f}x (target >= 0.9x); per CPU-second "
          f"{per_cpu:.2f}x")
    if a.ledger:
        # Each round's ledger run against its exact run (the same round, side by side).
        paired = [x["samples_per_s"] / y["samples_per_s"]
                  for x, y in zip(results[LEDGER], results["exact"], strict=True)]
        whole = med[LEDGER]["samples_per_s"] / med["exact"]["samples_per_s"]
        each = " / ".join(f"{x:.3f}" for x in paired)
        print(f"exact-ledger / exact = {whole:.3f}x (medians); per round {each}, median "
              f"{statistics.median(paired):.3f}x")
        # Throughput hides the ledger when the consumer is not the bottleneck; its CPU shows it.
        cx, cl = (med[m]["consumer_cpu_us_per_batch"] for m in ("exact", LEDGER))
        print(f"consumer CPU per batch: exact {cx:.1f} us, exact-ledger {cl:.1f} us: the "
              f"ledger {cl - cx:+.1f} us a batch, {100 * (cl - cx) / max(cx, 1e-9):+.1f}% of "
              "the consumer's CPU")
    local: dict[str, list[float]] = {m: [] for m in MODES}
    if a.in_process:
        for r in range(a.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                local[mode].append(produce_one_epoch(mode, cfgs[mode]))
        lm = {m: statistics.median(local[m]) for m in MODES}
        print(f"in this process, no broker (one epoch, median of {a.rounds}): training "
              f"{lm['training']:.0f} samples/s, exact {lm['exact']:.0f} samples/s: "
              f"{lm['exact'] / lm['training']:.2f}x")
    if a.json is not None:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "results": results, "ratio": ratio,
                                      "in_process": local}, indent=1))
    if a.profile is not None:
        for mode in modes:
            last = [r for r in runs if r.mode == mode][-1]
            profile_report(last.profiles, a.top)


if __name__ == "__main__":
    main()
