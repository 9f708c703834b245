"""The bottleneck verdict's thresholds, shared by every place that gives it.

The training process's ``OccupancyMonitor`` (its input queue), ``feedline top`` and the Grafana
dashboard (the consumers' receive queues) all answer "is the input or the model the slow
side?" from a queue's mean occupancy, with these thresholds: a queue that stays near empty
means the model waits for data; one that stays near full means batches wait for the model.
"""

from __future__ import annotations

INPUT_BOUND_BELOW = 0.25  # mean queue occupancy below this: the model starves
MODEL_BOUND_ABOVE = 0.75  # above this: batches queue up in front of the model
WAIT_SHARE_INPUT_BOUND = 0.10  # the model waits for data this share of its time or more


def verdict(occupancy: float, wait_share: float | None = None) -> str:
    """'input-bound', 'model-bound' or 'balanced' for a mean occupancy in 0..1 and, where
    known, the share of time the training loop waited for data."""
    if occupancy < INPUT_BOUND_BELOW or (wait_share or 0.0) >= WAIT_SHARE_INPUT_BOUND:
        return "input-bound"
    if occupancy > MODEL_BOUND_ABOVE:
        return "model-bound"
    return "balanced"
