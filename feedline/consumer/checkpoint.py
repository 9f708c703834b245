"""The exact-delivery cursor in a ``tf.train.Checkpoint``, saved and restored with the model.

    state = CursorState()
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, data=state)
    ckpt.restore(tf.train.latest_checkpoint(ckpt_dir))     # state.cursor: None, or the saved one
    remote = RemoteDataZMQ(addr, stream="train", resume=state.cursor)
    state.track(remote)                                    # every save records remote.state()
    ...
    ckpt.save(ckpt_dir + "/ckpt")

Restarted from that checkpoint, the job goes on from the next batch after what the model saw:
nothing repeated, nothing skipped, however many times it restarts from it. With several
training processes, give every process the merged cursor of all of them
(:meth:`feedline.exact.cursor.Cursor.merge`, e.g. gathered at save time): the ranks of a job share
one resume. A cursor of another pipeline is refused. Other frameworks:
``remote.state().to_dict()`` / ``RemoteDataZMQ(..., resume=that_dict)``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from feedline.consumer.remote import RemoteDataZMQ
from feedline.exact import Cursor


class CursorState(tf.__internal__.tracking.Trackable):  # type: ignore[misc,name-defined]
    """A checkpointable holder of a :class:`~feedline.exact.cursor.Cursor`.

    At save, it stores the tracked RemoteDataZMQ's ``state()`` (or the cursor it holds); at
    restore, :attr:`cursor` becomes the saved one.
    """

    def __init__(self, remote: RemoteDataZMQ | None = None) -> None:
        self._remote = remote
        self.cursor: Cursor | None = None

    def track(self, remote: RemoteDataZMQ) -> None:
        self._remote = remote

    def _serialize_to_tensors(self) -> dict[str, Any]:
        cursor = self._remote.state() if self._remote is not None else self.cursor
        return {"cursor": tf.constant(cursor.encode() if cursor is not None else b"")}

    def _restore_from_tensors(self, restored: dict[str, Any]) -> Any:
        data = bytes(restored["cursor"].numpy())
        self.cursor = Cursor.decode(data) if data else None
        return tf.no_op()
