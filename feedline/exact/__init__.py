"""Exact delivery: every sample of an epoch taken exactly once by the job, through kill -9,
restarts and resumes (docs/reliability.md, "Exact delivery").

The package holds the whole of it, and the serving core and the consumer call it through the
names below:

- :mod:`~feedline.exact.cursor`: a job's position (:class:`Cursor`): what it took of its
  epoch, as a consumer keeps it, checkpoints it and reports it when it registers;
- :mod:`~feedline.exact.plan`: what an exact stream is made of (:class:`ExactPlan`: sizes,
  runs, fingerprint), a unit's progress and a unit handed to a producer (:class:`Assignment`);
- :mod:`~feedline.exact.coordinator`: one stream's units, runs and settled batches
  (:class:`Coordinator`, pure logic, no sockets), kept in
- :mod:`~feedline.exact.journal`: an append-only, fsync'd journal a restarted broker restores
  from;
- :mod:`~feedline.exact.streams`: a host's exact streams (:class:`ExactStreams`): their
  coordinators made, restored, kept to one pipeline and reclaimed, and the cursors of the
  consumers applied to them (:class:`Applied`);
- :mod:`~feedline.exact.keeper`: a consumer's side (:class:`CursorKeeper`): what it took,
  what it reports when it registers again, the checkpoint it resumes from;
- :mod:`~feedline.exact.job`, :mod:`~feedline.exact.member`, :mod:`~feedline.exact.scope`,
  :mod:`~feedline.exact.job_wire`: one stream served by several hosts: the job's coordinator
  (:class:`JobCoordinator`), a host's side of it (:class:`JobMember`, and :class:`JobScope`,
  which limits the host's coordinator to the units the job opened there), and their frames;
- :mod:`~feedline.exact.lineage`: where a batch came from (:class:`Lineage`), a consumer's
  ledger of them (:class:`Ledger`) and the diff of two ledgers (:func:`diff`);
- :mod:`~feedline.exact.succession`: whether a changed dataset's producer waits for the old
  one's producers (killed, not yet dropped) or is refused (:class:`Succession`).

It imports only the kernel (errors, logs): the broker, a direct-mode trainer and a consumer
each use it the same way, and its model test drives it as it is.
"""

from __future__ import annotations

from feedline.exact.coordinator import RECORDS_PER_COMMIT, Coordinator
from feedline.exact.cursor import MAX_CURSOR_BYTES, MAX_UNITS, Cursor
from feedline.exact.job import JobCoordinator, JobRefused, View
from feedline.exact.job import Join as JobJoin
from feedline.exact.job_wire import MAX_FRAME as JOB_FRAME_MAX
from feedline.exact.job_wire import decode as decode_job_frame
from feedline.exact.job_wire import encode as encode_job_frame
from feedline.exact.job_wire import encode_refusal as encode_job_refusal
from feedline.exact.keeper import CursorKeeper
from feedline.exact.lineage import (
           Comparison,
           Difference,
           Ledger,
           Lineage,
           check_ledger_path,
           diff,
           ledger_line,
           read_ledger,
)
from feedline.exact.member import JobMember
from feedline.exact.plan import Assignment, ExactPlan, NoUnit
from feedline.exact.scope import JobScope
from feedline.exact.streams import MAX_STREAMS, Applied, ExactConfig, ExactStreams
from feedline.exact.succession import WAIT, Succession

__all__ = ["JOB_FRAME_MAX", "MAX_CURSOR_BYTES", "MAX_STREAMS", "MAX_UNITS", "RECORDS_PER_COMMIT",
           "WAIT", "Applied", "Assignment", "Comparison", "Coordinator", "Cursor", "CursorKeeper",
           "Difference", "ExactConfig", "ExactPlan", "ExactStreams", "JobCoordinator", "JobJoin",
           "JobMember", "JobRefused", "JobScope", "Ledger", "Lineage", "NoUnit", "Succession",
           "View", "check_ledger_path", "decode_job_frame", "diff", "encode_job_frame",
           "encode_job_refusal", "ledger_line", "read_ledger"]
