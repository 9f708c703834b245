"""The bottleneck verdict's thresholds, shared by every place that gives it.

The training process's ``OccupancyMonitor`` (its input queue), ``feedline top`` and the Grafana
dashboard (the consumers' receive queues) all answer "is the input or the model the slow
side?" from a queue's mean occupancy, with these thresholds: a queue that stays near empty
means the model waits for data; one that stays near full means batches wait for the model.

A steady run still gives noisy samples (a small window is full one second and half empty the
next; the time the loop waited comes in bursts), and a verdict recomputed from each sample
flapped between input-bound and model-bound. So every place that reports it:

- averages over :data:`WINDOW_SECONDS` (the dashboard's and the recording rules' ``[1m]``,
  ``feedline top``'s history of scrapes); and
- keeps its current verdict until the evidence is clear (:class:`VerdictTracker`): a
  threshold is crossed by :data:`MARGIN` in the other direction, and the new verdict holds
  for :data:`HOLD` samples in a row.
"""

from __future__ import annotations

INPUT_BOUND_BELOW = 0.25  # mean queue occupancy below this: the model starves
MODEL_BOUND_ABOVE = 0.75  # above this: batches queue up in front of the model
WAIT_SHARE_INPUT_BOUND = 0.10  # the model waits for data this share of its time or more
WINDOW_SECONDS = 60  # what a verdict averages over (the dashboard's rate windows)
MARGIN = 0.05  # how far past a threshold a sample must be to argue against the verdict held
HOLD = 3  # consecutive samples that must agree before the verdict held changes

VERDICTS = ("input-bound", "balanced", "model-bound")


def verdict(occupancy: float, wait_share: float | None = None,
            current: str | None = None) -> str:
    """'input-bound', 'model-bound' or 'balanced' for a mean occupancy in 0..1 and, where
    known, the share of time the training loop waited for data.

    With ``current`` (the verdict held now) the thresholds move by :data:`MARGIN` in its
    favour: leaving a verdict takes a clearer sample than entering it (hysteresis).
    """
    lo, hi, wait = INPUT_BOUND_BELOW, MODEL_BOUND_ABOVE, WAIT_SHARE_INPUT_BOUND
    if current == "input-bound":
        lo, wait = lo + MARGIN, wait - MARGIN / 2
    elif current == "model-bound":
        hi, wait = hi - MARGIN, wait + MARGIN
    if occupancy < lo or (wait_share or 0.0) >= wait:
        return "input-bound"
    if occupancy > hi:
        return "model-bound"
    return "balanced"


class VerdictTracker:
    """The verdict held across samples: it changes only when :data:`HOLD` consecutive samples
    (each judged with :func:`verdict`'s hysteresis) agree on another one."""

    def __init__(self, hold: int = HOLD) -> None:
        self.hold = hold
        self.current: str | None = None
        self._candidate: str | None = None
        self._count = 0

    def update(self, occupancy: float, wait_share: float | None = None) -> str:
        """Judge one sample; return the verdict held now."""
        raw = verdict(occupancy, wait_share, self.current)
        if self.current is None or raw == self.current:
            self.current = raw
            self._candidate, self._count = None, 0
            return raw
        if raw == self._candidate:
            self._count += 1
        else:
            self._candidate, self._count = raw, 1
        if self._count >= self.hold:
            self.current = raw
            self._candidate, self._count = None, 0
        return self.current
