"""One exact stream served by several hosts, checked as a model: a Hypothesis rule-based
state machine drives the real job coordinator (:mod:`feedline.exact.job`, its real journal
in a tmpfs directory) and a real :class:`~feedline.exact.member.JobMember` per host (3
hosts), with each host's delivery played in miniature (tests/support/job_model.py), in random
interleavings of: a host asking for a unit, its producers making a batch, the host
delivering one to one of its consumers, saying a unit is done, giving one back; messages
between the coordinator and the hosts taken in any order, lost, delivered twice; a host's
broker killed and started again (its buffer lost, its journal kept), a host cut off and back,
time passing past the heartbeat timeout; the coordinator killed and started again from its
journal (with a torn last record); the job checkpointed (the ranks' cursors merged), and
restarted from any of its checkpoints on another number of hosts and ranks.

After every step: no batch is taken twice by one launch of the job (a launch: the ranks
started together; a restart from a checkpoint begins the next), and none it resumed from is
taken again; every epoch a rank is told ended was taken whole by its launch and the cursor
it resumed from.

Runs: ``FEEDLINE_MODEL_EXAMPLES`` (default 200 examples of up to 80 steps: seconds);
``FEEDLINE_MODEL_EXAMPLES=100000 FEEDLINE_MODEL_STEPS=150`` for a long run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from tests.support.job_model import JobModel

JobModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("FEEDLINE_MODEL_EXAMPLES", "200")),
    stateful_step_count=int(os.environ.get("FEEDLINE_MODEL_STEPS", "80")),
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestJobModel = JobModel.TestCase
