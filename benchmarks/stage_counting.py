"""What counting every stage costs: FakeData -> MapData -> BatchData, with and without the
CountData stages that producer.pipeline inserts for the stage metrics, in one run.

Tiny constant datapoints and an identity map, so the pipeline itself is as cheap as it
gets and the counting is as large a share as it can be. Rounds alternate between the two
pipelines; the report gives the best round of each and the difference per datapoint
(3 counting stages: source and map count every datapoint, batch every batch).

    python benchmarks/stage_counting.py --datapoints 200000 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from feedline.producer.dataflow import BatchData, CountData, DataFlow, FakeData, MapData  # noqa: E402


def identity(dp: Any) -> Any:
    return dp


def pipeline(n: int, batch: int, counted: bool) -> DataFlow:
    def count(ds: DataFlow, name: str) -> DataFlow:
        return CountData(ds, name) if counted else ds

    ds = count(FakeData([[4], [1]], size=n, random=False, dtype=["uint8", "int32"]),
               "source:fake")
    ds = count(MapData(ds, identity), "0:map")
    return count(BatchData(ds, batch), "1:batch")


def seconds(df: DataFlow) -> float:
    df.reset_state()
    t0 = time.perf_counter()
    for _ in df:
        pass
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datapoints", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    best = {"plain": float("inf"), "counted": float("inf")}
    for _ in range(args.rounds):
        for name in best:
            t = seconds(pipeline(args.datapoints, args.batch, name == "counted"))
            best[name] = min(best[name], t)
    n = args.datapoints
    per_dp = {k: v / n * 1e9 for k, v in best.items()}
    overhead = per_dp["counted"] - per_dp["plain"]
    print(json.dumps({
        "datapoints": n, "batch": args.batch, "rounds": args.rounds,
        "plain_ns_per_datapoint": round(per_dp["plain"], 1),
        "counted_ns_per_datapoint": round(per_dp["counted"], 1),
        "overhead_ns_per_datapoint": round(overhead, 1),
        "overhead_ns_per_counted_datapoint_per_stage": round(overhead / (2 + 1 / args.batch), 1),
        "overhead_share": round(overhead / per_dp["plain"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()
