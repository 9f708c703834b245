"""The training side: RemoteDataZMQ, and (with the ``tf`` extra) TensorFlow input sources.

``from feedline.consumer import RemoteDataZMQ`` never imports TensorFlow; the TensorFlow input
sources
are imported on first use, so a process that only reads batches does not pay for TF.
"""

from __future__ import annotations

from typing import Any

from feedline.consumer.remote import ConsumerOptions, ProducerStats, RemoteDataZMQ

__all__ = ["ConsumerOptions", "ProducerStats", "RemoteDataZMQ"]

# name -> module, for the TensorFlow-side classes (imported lazily, see __getattr__)
_LAZY: dict[str, str] = {
    "InputSource": "feedline.consumer.input_source",
    "QueueInput": "feedline.consumer.queue_input",
    "StagingInput": "feedline.consumer.staging",
    "DummyConstantInput": "feedline.consumer.dummy",
    "as_dataset": "feedline.consumer.dataset",
    "OccupancyMonitor": "feedline.consumer.bottleneck",
    "CursorState": "feedline.consumer.checkpoint",
    # PyTorch (the ``torch`` extra), imported lazily the same way
    "to_torch": "feedline.consumer.torch_input", "RemoteTorchDataset":
    "feedline.consumer.torch_input",
    "CudaPrefetcher": "feedline.consumer.torch_prefetch",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'consumer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
