"""The training side: RemoteDataZMQ, and (with the ``tf`` extra) TensorFlow input sources.

``from consumer import RemoteDataZMQ`` never imports TensorFlow; the TensorFlow input sources
are imported on first use, so a process that only reads batches does not pay for TF.
"""

from __future__ import annotations

from typing import Any

from consumer.remote import ProducerStats, RemoteDataZMQ

__all__ = ["ProducerStats", "RemoteDataZMQ"]

# name -> module, for the TensorFlow-side classes (imported lazily, see __getattr__)
_LAZY: dict[str, str] = {
    "InputSource": "consumer.input_source",
    "QueueInput": "consumer.queue_input",
    "StagingInput": "consumer.staging",
    "DummyConstantInput": "consumer.dummy",
    "as_dataset": "consumer.dataset",
    "OccupancyMonitor": "consumer.bottleneck",
    "CursorState": "consumer.checkpoint",
    # PyTorch (the ``torch`` extra), imported lazily the same way
    "to_torch": "consumer.torch_input", "RemoteTorchDataset": "consumer.torch_input",
    "CudaPrefetcher": "consumer.torch_prefetch",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'consumer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
