"""``parallel: auto``: how many workers a map stage runs, found by measuring it.

Two parts, both pure but for reading a few files:

- :func:`cpu_budget`: the CPUs this process may use: the CPUs it may run on
  (``sched_getaffinity``: ``taskset``, a cpuset) and its cgroup's CPU quota (v2 ``cpu.max``,
  v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``: a container's ``--cpus``, a pod's CPU limit),
  whichever is smaller.
- :class:`Tuner`: a hill-climb on measured throughput, as tf.data's autotune does for its
  parallel maps. Every period the stage reports its output rate and the share of time the
  thread that iterates it waited for a result. A stage its consumer waits on is the
  bottleneck: the tuner tries one worker more and keeps it only if the rate rose by
  ``gain``. A stage whose results are always ready is not, and one where a worker more did
  not help may have too many: it tries one fewer and keeps it if the rate held (within
  ``loss``), which frees a CPU for the rest of the producer. A try that failed is not made
  again for a while, twice as long each time it fails (bounded exploration; a bottleneck at
  ``hi`` that one fewer made slower waits the longest backoff at once); a rate that
  stayed far from the last decision's for a few periods (new data, a slower trainer) starts
  the exploring afresh.
- :class:`ModeTuner`: with both kinds allowed, first measures threads and processes at the
  starting count, then climbs the count of the better one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    cores: float  # CPUs this process may use (a quota may give a fraction)
    source: str  # what limits it, for the start-up line

    @property
    def workers(self) -> int:
        """Workers that can each have a CPU: the budget rounded up, at least 1."""
        return max(1, math.ceil(self.cores - 1e-9))


def cpu_budget(cgroup_root: str | Path = "/sys/fs/cgroup",
               proc_cgroup: str | Path = "/proc/self/cgroup") -> CpuBudget:
    """The CPUs this process may use: its affinity, or its cgroup's quota if smaller."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
        source = "affinity"
    except (AttributeError, OSError):
        cpus, source = float(os.cpu_count() or 1), "cpu_count"
    quota = cgroup_quota(Path(cgroup_root), Path(proc_cgroup))
    if quota is not None and quota < cpus:
        return CpuBudget(quota, "cgroup quota")
    return CpuBudget(cpus, source)


def cgroup_quota(root: Path, proc_cgroup: Path) -> float | None:
    """CPUs the cgroup's quota allows (quota / period), or None if it sets none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2_paths, v1_paths = [], []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":
            v2_paths += [root / rel, root]
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                v1_paths += [root / mount / rel, root / mount]
    for p in (*v2_paths, root):
        got = _read(p / "cpu.max")
        if got is not None:
            fields = got.split()
            if len(fields) == 2 and fields[0] != "max":
                return _ratio(fields[0], fields[1])
            return None
    for p in v1_paths:
        quota, period = _read(p / "cpu.cfs_quota_us"), _read(p / "cpu.cfs_period_us")
        if quota is not None and period is not None:
            return None if quota.strip().startswith("-") else _ratio(quota, period)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


@dataclass(frozen=True)
class TunerConfig:
    lo: int = 1
    hi: int = 1
    gain: float = 0.05  # one worker more must raise the rate by this much to stay
    loss: float = 0.05  # one worker fewer may lower it by at most this much
    busy: float = 0.05  # the stage's consumer waits this share of its time: a bottleneck
    idle: float = 0.01  # below this share it is not: try fewer workers
    max_backoff: int = 32  # periods a failed try is not made again, at most
    moved: float = 0.4  # a rate this far from the last decision's, ...
    moved_periods: int = 3  # ... this many periods in a row, starts exploring afresh


class Tuner:
    """Worker counts in ``[lo, hi]``, one decision per measured period (pure)."""

    def __init__(self, cfg: TunerConfig, start: int) -> None:
        self.cfg = cfg
        self.k = max(cfg.lo, min(cfg.hi, start))
        self._trial: tuple[int, float, float] | None = None  # (previous k, its rate, wait)
        self._confirmed = 0  # periods a try of fewer workers has held so far
        self._cool = {+1: 0, -1: 0}  # periods before trying that direction again
        self._backoff = {+1: 1, -1: 1}
        self._settled_rate: float | None = None
        self.last: str = ""  # what the last decision was, in words (for the log)
        self.moved = False  # the last observation found the load changed
        self._away = 0  # periods in a row the rate was far from the settled one

    def observe(self, rate: float, wait: float) -> int:
        """The period at :attr:`k` gave ``rate`` (outputs/s) with its consumer waiting
        ``wait`` of the time; returns the worker count for the next period."""
        cfg = self.cfg
        self.last, self.moved = "", False
        for d in self._cool:
            self._cool[d] = max(0, self._cool[d] - 1)
        if self._trial is not None:
            prev, prev_rate, prev_wait = self._trial
            d = +1 if self.k > prev else -1
            # More workers must earn their CPU; fewer that deliver as much free one, judged
            # over two periods (a wrong "fewer" costs rate, a wrong "more" only a CPU).
            kept = rate >= prev_rate * (1 + cfg.gain) if d > 0 else \
                rate >= prev_rate * (1 - cfg.loss)
            if kept and d < 0 and self._confirmed < 1:
                self._confirmed += 1
                return self.k
            self._trial, self._confirmed = None, 0
            if kept:
                self.last = f"{self.k} kept ({rate:.0f}/s, was {prev_rate:.0f}/s with {prev})"
                self._backoff[d] = 1
                self._settled_rate = rate
                return self.k
            self.last = f"{self.k} tried ({rate:.0f}/s): back to {prev} ({prev_rate:.0f}/s)"
            if d < 0 and prev == cfg.hi and prev_wait >= cfg.busy:
                # A bottleneck with every worker its range allows, and one fewer was slower:
                # it has nothing to give back, so that try waits the longest backoff (each
                # try costs its periods' rate).
                self._backoff[d] = cfg.max_backoff
            self._cool[d] = self._backoff[d]
            self._backoff[d] = min(cfg.max_backoff, 2 * self._backoff[d])
            self.k = prev
            self._settled_rate = prev_rate
            return self.k
        far = self._settled_rate is not None and self._settled_rate > 0 and \
            abs(rate / self._settled_rate - 1) > cfg.moved
        self._away = self._away + 1 if far else 0
        if self._away >= cfg.moved_periods:
            # The load changed under us: what failed before may work now.
            self.moved, self._away = True, 0
            self._cool = {+1: 0, -1: 0}
            self._backoff = {+1: 1, -1: 1}
            self._settled_rate = rate
        elif self._settled_rate is None:
            self._settled_rate = rate
        if wait >= cfg.busy and self.k < cfg.hi and not self._cool[+1]:
            return self._try(+1, rate, wait)
        # Not the bottleneck, or one more did not help: would one fewer do as well?
        if (wait < cfg.idle or self._cool[+1] or self.k == cfg.hi) and self.k > cfg.lo \
                and not self._cool[-1]:
            return self._try(-1, rate, wait)
        return self.k

    def _try(self, d: int, rate: float, wait: float) -> int:
        self._trial = (self.k, rate, wait)
        self.k += d
        return self.k


def plural(mode: str) -> str:
    """'thread' -> 'threads', 'process' -> 'processes'."""
    return mode + ("es" if mode.endswith("s") else "s")


class ModeTuner:
    """Threads or processes, and how many (pure). With both modes allowed it first measures
    each at the starting count, one period each, and keeps processes only if they beat
    threads by ``gain`` (threads share memory and copy nothing); then a :class:`Tuner`
    climbs the count in that mode. A load that changes a lot compares the modes again."""

    def __init__(self, modes: tuple[str, ...], hi: dict[str, int], start: int,
                 gain: float = 0.05, periods: int = 2) -> None:
        self.modes, self.gain, self.periods = modes, gain, periods
        self.tuners = {m: Tuner(TunerConfig(lo=1, hi=hi[m]), start) for m in modes}
        self.mode = modes[0]
        # While comparing the modes: each one's rates, ``periods`` of them (a mean of two
        # periods, not one, decides: one period on a busy machine can be far off).
        self._rates: dict[str, list[float]] | None = {} if len(modes) > 1 else None
        self.last = ""

    @property
    def k(self) -> int:
        return self.tuners[self.mode].k

    def observe(self, rate: float, wait: float) -> tuple[str, int]:
        self.last = ""
        if self._rates is not None:
            rates = self._rates.setdefault(self.mode, [])
            rates.append(rate)
            if len(rates) < self.periods:
                return self.mode, self.k
            left = [m for m in self.modes if m not in self._rates]
            mean = {m: sum(r) / len(r) for m, r in self._rates.items()}
            if left:
                self.last = (f"{self.k} {plural(self.mode)}: {mean[self.mode]:.0f}/s; "
                             f"measuring {plural(left[0])}")
                self.mode = left[0]
                return self.mode, self.k
            first = self.modes[0]
            best = max(self.modes, key=lambda m: mean[m] if m == first
                       else mean[m] / (1 + self.gain))
            self.last = f"{plural(best)} kept (" + ", ".join(
                f"{plural(m)} {r:.0f}/s" for m, r in mean.items()) + ")"
            self.mode, self._rates = best, None
            return self.mode, self.k
        t = self.tuners[self.mode]
        k = t.observe(rate, wait)
        self.last = t.last and f"{plural(self.mode)}: {t.last}"
        if t.moved and len(self.modes) > 1:
            self._rates = {}  # measure the modes again, from this mode at this count
            for other in self.tuners.values():
                other.k = max(other.cfg.lo, min(other.cfg.hi, k))
            return self.mode, self.k
        return self.mode, k


class AutoWorkers:
    """Measures a parallel map stage in periods and asks its :class:`ModeTuner` for the mode
    and worker count. The stage calls :meth:`waited` with the time its iterating thread
    blocked for a result, :meth:`result` for each result, and applies what it returns.

    A period lasts ``min_period`` seconds, or longer until twice the stage's buffer has gone
    through it (bounded by ``max_period``), so that a change is judged on its own results,
    not on those the buffer held; the period right after a change is not judged at all.
    """

    def __init__(self, tuner: ModeTuner, buffer: int, min_period: float = 1.0,
                 max_period: float = 10.0, note: str = "") -> None:
        self.tuner, self.buffer, self.note = tuner, buffer, note
        self.min_period, self.max_period = min_period, max_period
        self._start: float | None = None
        self._count = 0
        self._waited = 0.0
        self._warmup = False
        self.changes: list[str] = []  # what the tuner decided (the stage logs and clears it)

    @property
    def setting(self) -> tuple[str, int]:
        return self.tuner.mode, self.tuner.k

    def waited(self, seconds: float) -> None:
        self._waited += seconds

    def result(self, now: float) -> tuple[str, int]:
        if self._start is None:
            self._start = now
            self._warmup = True  # the first period: workers starting, buffers filling
        self._count += 1
        span = now - self._start
        if span < self.min_period or (self._count < 2 * self.buffer and span < self.max_period):
            return self.setting
        rate, wait = self._count / span, min(1.0, self._waited / span)
        self._start, self._count, self._waited = now, 0, 0.0
        if self._warmup:
            self._warmup = False
            return self.setting
        before = self.setting
        after = self.tuner.observe(rate, wait)
        if self.tuner.last:
            self.changes.append(self.tuner.last)
        self._warmup = after != before
        return after
