"""The job coordinator's cost at scale, driven in one process: ``--hosts`` simulated hosts
with ``--producers`` producers each serve one epoch of ``--samples`` samples in units of
``--unit-size``; every host beats once a second of simulated time. Prints messages per unit
and per host, the coordinator's CPU per message and per unit, its memory (tracemalloc), and
what that means for a job at ``--rate`` samples a second.

    python3 benchmarks/job_scale.py --hosts 1000 --producers 16
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout as is

from feedline.exact.job import JobCoordinator  # noqa: E402
from feedline.exact.member import JobMember  # noqa: E402
from feedline.exact.plan import ExactPlan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--producers", type=int, default=16, help="per host")
    ap.add_argument("--samples", type=int, default=1_281_167, help="ImageNet's train split")
    ap.add_argument("--unit-size", type=int, default=64)
    ap.add_argument("--rate", type=float, default=3_000_000.0,
                    help="samples a second the whole job takes (1,000 hosts x 8 GPUs)")
    a = ap.parse_args()
    plan = ExactPlan(a.samples, a.unit_size, 1, 1)
    tracemalloc.start()
    jc = JobCoordinator("train", plan, max_hosts=a.hosts)
    _, before = tracemalloc.get_traced_memory()
    jc_bytes = before
    tracemalloc.stop()
    members = [JobMember(f"h{i}", "train", plan, 1) for i in range(a.hosts)]
    cpu = 0.0

    def send(msg: object) -> None:
        nonlocal cpu
        t = time.perf_counter()
        views = jc.handle(msg, 0.0)  # type: ignore[arg-type]
        cpu += time.perf_counter() - t
        for v in views:
            members[int(v.host[1:])].view(v)

    for m in members:
        send(m.join(readers=8))
    base = jc.messages
    units_per_second = a.rate / a.unit_size
    served = 0
    rounds = 0
    while not jc.finished:
        rounds += 1
        for m in members:  # every producer holds one unit: ask for the missing ones
            for _ in range(a.producers - len(m.open)):
                send(m.ask())
        for m in members:  # and finishes it
            for u in list(m.open):
                done = m.done(u, 1)
                if done is not None:
                    send(done)
                    served += 1
        # Beats: once a second per host, for the simulated seconds this round took.
        seconds = a.hosts * a.producers / units_per_second
        for m in members[: int(min(a.hosts, a.hosts * seconds))]:
            send(m.beat(8))
    msgs = jc.messages - base
    tracemalloc.start()
    jc2 = JobCoordinator("train", plan, max_hosts=a.hosts)
    for i in range(a.hosts):  # the hosts as the coordinator keeps them, each with its units
        jc2.handle(JobMember(f"h{i}", "train", plan, 1).join(readers=8), 0.0)
    _, peak = tracemalloc.get_traced_memory()
    del jc2
    peak = max(peak, jc_bytes)
    print(f"{a.hosts} hosts x {a.producers} producers, {plan.units} units of {a.unit_size}: "
          f"{msgs} messages in {rounds} rounds")
    print(f"  messages per unit: {msgs / plan.units:.2f}; per host per epoch: "
          f"{msgs / a.hosts:.1f}")
    print(f"  coordinator time: {cpu / msgs * 1e6:.1f} us per message, "
          f"{cpu / plan.units * 1e6:.1f} us per unit, {cpu:.2f} s per epoch")
    print(f"  coordinator memory with every host joined: {peak / 2**20:.1f} MiB")
    need = units_per_second * (cpu / plan.units)
    print(f"  at {a.rate:,.0f} samples/s ({units_per_second:,.0f} units/s) the coordinator "
          f"needs {need:.2f} of one core")


if __name__ == "__main__":
    main()
