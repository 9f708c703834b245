"""``parallel: auto`` against hand-picked settings, on 1 and 2 cores.

Pipelines (each run iterates the pipeline in a fresh process pinned with ``taskset``, no
network: what is measured is the pipeline):

- ``jpeg``: examples/imagenet_train.yaml (RandomResizedCrop 224, flip, color jitter,
  lighting, batches of 64) over the demo photos (``feedline.producer.demo_data``: 512 JPEGs
  cut from scikit-image's photos, about 400x350) or ``--data DIR``;
- ``fake``: examples/fake.yaml (constant 64x224x224x3 batches, no map step: nothing to
  parallelise; auto must not make it slower). Iterating constant arrays costs nothing, so
  this one is measured end to end: ``feedline producer`` -> ``feedline broker`` ->
  ``feedline drain``, all three pinned to the same cores, batches/s at the consumer;
- ``python-map``: examples/fake.yaml's source (one 64x64 image per datapoint) through a map
  step of pure Python (:func:`spin`, ~2 ms holding the GIL), batches of 64: threads cannot
  help, processes can.

Settings: ``none`` (in the producer process), ``thread N`` and ``process N`` for N up to the
cores + 1, ``runner N`` for the fake pipeline, and ``auto``. Rounds alternate the settings;
each run lasts ``--seconds``; reported per setting: the median over rounds of the rate over
the run's second half (steady: auto has done its exploring) and over the whole run.

    python benchmarks/autotune.py --rounds 3 --seconds 20 --json benchmarks/results/autotune.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = ("jpeg", "fake", "python-map")


def spin(x: Any) -> Any:
    """About 2 ms of pure Python (the GIL held throughout), then the datapoint unchanged."""
    s = 0
    for i in range(60_000):
        s += i * i
    return x


def pipeline(name: str, data: str) -> dict[str, Any]:
    if name == "jpeg":
        cfg = yaml.safe_load((ROOT / "examples/imagenet_train.yaml").read_text())
        cfg["source"] = {"image_folder": {"root": data, "shuffle": True}}
        return cfg
    cfg = yaml.safe_load((ROOT / "examples/fake.yaml").read_text())
    if name == "fake":
        return cfg
    cfg["source"] = {"fake": {"shapes": [[64, 64, 3]], "dtypes": ["uint8"], "random": False,
                              "size": 10**6}}
    cfg["steps"] = [{"map": {"function": "benchmarks.autotune:spin"}},
                    {"batch": {"batch_size": 64}}]
    return cfg


def settings(name: str, cores: int) -> list[str]:
    if name == "fake":
        return ["none", *(f"runner {n}" for n in range(1, cores + 2)), "auto"]
    return ["none", *(f"{m} {n}" for m in ("thread", "process") for n in range(1, cores + 2)),
            "auto"]


def with_setting(cfg: dict[str, Any], setting: str) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    if setting == "auto":
        cfg["parallel"] = "auto"
    elif setting == "none":
        cfg["parallel"] = {"mode": "none"}
    else:
        mode, n = setting.split()
        cfg["parallel"] = {"mode": mode, "workers": int(n), "buffer_size": 128}
    cfg.pop("shard", None)
    cfg["epochs"] = None
    return cfg


def child(cfg: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Iterate the pipeline for ``seconds`` from its first batch; the datapoints out by
    time (one mark per half second) and what the auto stages chose."""
    from feedline.producer.pipeline import build_pipeline, parallel_summary

    df = build_pipeline(cfg)
    try:
        df.reset_state()
        it = iter(df)
        first = next(it)
        per = len(first[0]) if isinstance(first, (list, tuple)) else 1
        t0 = time.monotonic()
        marks, n, nxt = [], 0, 0.5
        while True:
            try:
                next(it)
            except StopIteration:  # an epoch ended (a finite source): the next one
                it = iter(df)
                continue
            n += per
            now = time.monotonic() - t0
            if now >= nxt:
                marks.append((now, n))
                nxt += 0.5
            if now >= seconds:
                break
        return {"marks": marks, "summary": parallel_summary(df)}
    finally:
        df.close()


def end_to_end(cfg: dict[str, Any], cpus: str, seconds: float) -> dict[str, Any]:
    """Producer -> broker -> drain on ``cpus``: batches the consumer received by time."""
    import tempfile

    from feedline.procs import Child, free_port, wait_for
    from feedline.scrape import scrape

    with tempfile.TemporaryDirectory(prefix="feedline-autotune-") as tmp:
        path = Path(tmp) / "pipeline.yaml"
        path.write_text(yaml.safe_dump(cfg))
        port, metrics = free_port(), free_port()
        ingress, egress = f"tcp://127.0.0.1:{port}", f"ipc://{tmp}/egress.sock"
        pin = ["taskset", "-c", cpus, sys.executable, "-m", "feedline.commands"]
        procs = [Child([*pin, "broker", "--ingress", ingress, "--egress", egress,
                        "--metrics-port", "0", "--log-level", "WARNING"], cwd=ROOT),
                 Child([*pin, "drain", "--broker", egress, "--window", "8", "--metrics-port",
                        str(metrics), "--log-level", "WARNING"], cwd=ROOT),
                 Child([*pin, "producer", "--config", str(path), "--broker", ingress,
                        "--log-level", "WARNING"], cwd=ROOT)]
        try:
            url = f"http://127.0.0.1:{metrics}/metrics"

            def received() -> float:
                return scrape(url).get("feedline_consumer_received_batches_total") or 0.0

            wait_for(received, 60, what="first batches")
            t0, n0 = time.monotonic(), received()
            marks = []
            while time.monotonic() - t0 < seconds:
                time.sleep(0.5)
                marks.append((time.monotonic() - t0, received() - n0))
            return {"marks": marks, "summary": "end to end"}
        finally:
            for c in reversed(procs):
                c.stop(10)


def rates(marks: list[list[float]]) -> tuple[float, float]:
    """(steady: the second half's rate, overall: the whole run's)."""
    end_t, end_n = marks[-1]
    mid_t, mid_n = min(marks, key=lambda m: abs(m[0] - end_t / 2))
    return (end_n - mid_n) / (end_t - mid_t), end_n / end_t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    ap.add_argument("--cores", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--data", default=None, help="JPEG folder (default: the demo photos)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child), a.seconds)))
        return 0
    data = a.data
    if data is None:
        from feedline.producer.demo_data import build, default_dir

        data = str(build(default_dir(os.environ.get("XDG_CACHE_HOME"), count=512), count=512))
    results: dict[str, dict[str, Any]] = {}
    plan = [(p, c) for p in a.pipelines for c in a.cores]
    for r in range(a.rounds):
        for p, cores in plan:
            order = settings(p, cores)
            order = order[r % len(order):] + order[:r % len(order)]  # alternate the order
            for s in order:
                cfg = with_setting(pipeline(p, data), s)
                cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:cores])
                if p == "fake":
                    got = end_to_end(cfg, cpus, a.seconds)
                else:
                    out = subprocess.run(
                        ["taskset", "-c", cpus, sys.executable, __file__, "--seconds",
                         str(a.seconds), "--child", json.dumps(cfg)],
                        capture_output=True, text=True, cwd=ROOT, timeout=a.seconds * 4 + 60)
                    if out.returncode:
                        raise SystemExit(f"{p} {s} on {cores} cores failed:\n"
                                         f"{out.stderr[-2000:]}")
                    got = json.loads(out.stdout.strip().splitlines()[-1])
                steady, overall = rates(got["marks"])
                key = f"{p}|{cores}|{s}"
                e = results.setdefault(key, {"steady": [], "overall": [], "chose": []})
                e["steady"].append(steady)
                e["overall"].append(overall)
                e["chose"].append(got["summary"])
                print(f"round {r + 1}/{a.rounds}  {p:<10} {cores} core(s)  {s:<10} "
                      f"{steady:9.1f}/s steady {overall:9.1f}/s overall  {got['summary']}",
                      flush=True)
    print()
    print(f"{'pipeline':<10} {'cores':>5} {'setting':<10} {'steady/s':>10} {'overall/s':>10} "
          f"{'vs best':>8}")
    table = []
    for p, cores in plan:
        rows = {s: results[f"{p}|{cores}|{s}"] for s in settings(p, cores)}
        med = {s: statistics.median(e["steady"]) for s, e in rows.items()}
        best = max(v for s, v in med.items() if s != "auto")
        for s, e in rows.items():
            overall = statistics.median(e["overall"])
            print(f"{p:<10} {cores:>5} {s:<10} {med[s]:>10.1f} {overall:>10.1f} "
                  f"{med[s] / best:>7.2f}x")
            table.append({"pipeline": p, "cores": cores, "setting": s, "steady": med[s],
                          "overall": overall, "vs_best": med[s] / best,
                          "runs": e["steady"], "chose": e["chose"]})
    if a.json:
        Path(a.json).write_text(json.dumps({"seconds": a.seconds, "rounds": a.rounds,
                                            "results": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
