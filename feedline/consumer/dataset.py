"""A ``tf.data.Dataset`` over a QueueInput, for Keras ``fit`` and ``tf.distribute``.

The dataset dequeues inside the tf.data runtime (a graph function capturing the queue), so no
Python generator runs per batch. Each element is one batch as the producers made it, so the
batch size is the producers'. With ``MirroredStrategy``, use
``strategy.distribute_datasets_from_function(lambda ctx: as_dataset(input))``: every replica
dequeues its own batches from the one queue (the global batch is replicas x producer batch).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from feedline.consumer.input_source import as_input_source


def as_dataset(input: Any, prefetch: int = 2, map_fn: Any = None) -> tf.data.Dataset:
    """An endless dataset of batches dequeued from ``input`` (an
    :class:`~feedline.consumer.input_source.InputSource`, started here if it is not yet; or anything
    with ``dequeue()`` and ``dtypes``; else a TypeError).

    ``map_fn`` (optional) turns a batch into what ``fit`` wants, e.g. ``(x, y)`` or a
    normalisation on the device. ``prefetch`` bounds how many batches tf.data holds ahead.
    """
    source = as_input_source(input, "as_dataset")
    source.start()

    def take(_: tf.Tensor) -> Any:
        batch = source.dequeue()
        return map_fn(batch) if map_fn is not None else batch

    ds = tf.data.Dataset.from_tensors(tf.constant(0)).repeat()
    ds = ds.map(take, num_parallel_calls=1, deterministic=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = ds.with_options(options)
    return ds.prefetch(prefetch) if prefetch else ds
