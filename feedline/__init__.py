"""feedline: serve preprocessed training batches over the network.

One import name. The components are subpackages: :mod:`feedline.producer` (DataFlow pipelines
and sending), :mod:`feedline.broker` (the fan-in broker), :mod:`feedline.consumer`
(``RemoteDataZMQ`` and the TensorFlow / PyTorch input sources) and :mod:`feedline.commands`
(the ``feedline`` command line); the modules directly under ``feedline`` are the kernel they
share (the wire protocol, links, security, flags).

The names most programs need are importable from here::

    from feedline import ConsumerOptions, RemoteDataZMQ, send_dataflow

They are resolved on first use, so ``import feedline`` (or any kernel module) imports neither
ZeroMQ's consumers nor TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from feedline.version import __version__

# name -> the module that defines it (imported on first use: see __getattr__)
_EXPORTS: dict[str, str] = {
    "RemoteDataZMQ": "feedline.consumer.remote",
    "ConsumerOptions": "feedline.consumer.remote",
    "ProducerStats": "feedline.consumer.remote",
    "QueueInput": "feedline.consumer.queue_input",
    "StagingInput": "feedline.consumer.staging",
    "DummyConstantInput": "feedline.consumer.dummy",
    "CursorState": "feedline.consumer.checkpoint",
    "as_dataset": "feedline.consumer.dataset",
    "OccupancyMonitor": "feedline.consumer.bottleneck",
    "RemoteTorchDataset": "feedline.consumer.torch_input",
    "to_torch": "feedline.consumer.torch_input",
    "CudaPrefetcher": "feedline.consumer.torch_prefetch",
    "send_dataflow": "feedline.producer.sender",
    "send_dataflow_zmq": "feedline.producer.sender",  # tensorpack's name for it
    "Sender": "feedline.producer.sender",
    "Broker": "feedline.broker.core",
    "BrokerConfig": "feedline.broker.config",
    "ClientKeys": "feedline.security",
    "ServerKeys": "feedline.security",
    "Cursor": "feedline.exact",
    "FeedlineError": "feedline.errors",
}

__all__ = [
    "Broker", "BrokerConfig", "ClientKeys", "ConsumerOptions", "CudaPrefetcher", "Cursor",
    "CursorState", "DummyConstantInput", "FeedlineError", "OccupancyMonitor", "ProducerStats",
    "QueueInput", "RemoteDataZMQ", "RemoteTorchDataset", "Sender", "ServerKeys", "StagingInput",
    "__version__", "as_dataset", "send_dataflow", "send_dataflow_zmq", "to_torch",
]

if TYPE_CHECKING:  # for type checkers and editors; at run time __getattr__ imports
    from feedline.broker.config import BrokerConfig
    from feedline.broker.core import Broker
    from feedline.consumer.bottleneck import OccupancyMonitor
    from feedline.consumer.checkpoint import CursorState
    from feedline.consumer.dataset import as_dataset
    from feedline.consumer.dummy import DummyConstantInput
    from feedline.consumer.queue_input import QueueInput
    from feedline.consumer.remote import ConsumerOptions, ProducerStats, RemoteDataZMQ
    from feedline.consumer.staging import StagingInput
    from feedline.consumer.torch_input import RemoteTorchDataset, to_torch
    from feedline.consumer.torch_prefetch import CudaPrefetcher
    from feedline.errors import FeedlineError
    from feedline.exact import Cursor
    from feedline.producer.sender import Sender, send_dataflow, send_dataflow_zmq
    from feedline.security import ClientKeys, ServerKeys


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'feedline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once resolved, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
