"""Exact delivery's coordinator checked as a model: a Hypothesis rule-based state machine
drives the real :class:`feedline.exact.coordinator.Coordinator` (and its real journal, in a
tmpfs directory) with the broker's glue around it played in miniature (the buffer, what is in
flight to each consumer, orphans, the consumers' own checks, producers making units batch by
batch), in random interleavings of: a producer asking for a unit, making a batch (or losing
one on the way), finishing a unit, dying, registering (one more of the run being served, or,
on a served stream, a second job's); a batch delivered, taken by the model, acknowledged; a
consumer paused past the timeout and woken, killed, or registering again; the journal
committed; the broker restarted from its journal (with a torn last record); the job
checkpointed, and resumed from any earlier checkpoint; everything run to the epoch's end.

After every step: no batch is taken twice by the job (its view rolls back only with a resume);
every epoch the coordinator ends was taken whole (every batch, but for those every sample of
which was skipped). A new run begins only when no producer of the served run is attached, and
a producer of a run is never given a later run's unit (issue 53, finding 3). A producer that
registers after the run was served is of that run (told it is finished) exactly when it
started before the run was served (one of the job slow to come up); one that started after
starts the next run; and one that does not say when it started, or any after a broker restart
on a served stream (when the run was served is in memory only), is told it is finished
exactly while a consumer registered during the run is registered and no other consumer
registered since (a late producer of the job just served), and otherwise starts the next
run. At the end, everything is woken and run to completion: the epoch (or the run) must end,
so nothing can be stranded.

The glue mirrors ``feedline.broker.egress`` and ``feedline.consumer.io``: batches of a dropped
consumer's registration are served again (those not settled) when its connection closes or
it registers again with its report; a consumer drops what it was sent under a registration it
no longer has, and acknowledges without taking what its cursor holds already.

Runs: ``FEEDLINE_MODEL_EXAMPLES`` (default 200 examples of up to 80 steps: seconds);
``FEEDLINE_MODEL_EXAMPLES=200000 FEEDLINE_MODEL_STEPS=120`` for a long run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from tests.support.exact_model import ExactModel

ExactModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("FEEDLINE_MODEL_EXAMPLES", "200")),
    stateful_step_count=int(os.environ.get("FEEDLINE_MODEL_STEPS", "80")),
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestExactModel = ExactModel.TestCase
