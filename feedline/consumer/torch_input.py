"""PyTorch input: batches from the broker as tensors that share memory with the received frames.

``to_torch`` maps a datapoint (nested lists, tuples and dicts of numpy arrays) to the same
structure of tensors with ``torch.from_numpy``: no copy. A tensor keeps its array alive, the
array its ``memoryview``, the view the ``zmq.Frame``: the frame's memory lives as long as the
tensor does, whatever the consumer does with the batch afterwards.

Those tensors are **read-only by contract**. PyTorch has no read-only tensors, so it cannot
refuse an in-place operation; one (``x.div_(255)``, ``x[0] = 0``) would write into the received
message. Nothing here ever writes into a frame; code that must modify a batch in place asks for
``copy=True`` (or calls ``.clone()``). ``torch.from_numpy`` warns once per process when an array
is flagged non-writable; ``to_torch`` silences exactly that warning for its own call (the
contract above is the answer to it), and nothing else.

``RemoteTorchDataset`` is a ``torch.utils.data.IterableDataset`` over ``RemoteDataZMQ``: it
holds the constructor's arguments, not a connection, and opens one connection in the process
(and DataLoader worker) that iterates it. Each connection gets its own share of the stream
from the broker: one per ``torch.distributed`` rank gives each rank different batches, with
no sharding to configure.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from feedline.consumer.torch_extra import TorchMissing, is_torch_missing

try:
    import torch
    import torch.distributed as dist
    from torch.utils.data import IterableDataset, get_worker_info
except ModuleNotFoundError as e:  # one line naming the extra, not "No module named 'torch'"
    if not is_torch_missing(e):
        raise
    raise TorchMissing() from None

from feedline.consumer.remote import ConsumerOptions, RemoteDataZMQ, moved_options
from feedline.exact import Cursor
from feedline.protocol import wire
from feedline.protocol.messages import DEFAULT_STREAM
from feedline.security import ClientKeys, ServerKeys

log = logging.getLogger(__name__)

# What torch.from_numpy says about a non-writable array (a regex for warnings.filterwarnings).
_NOT_WRITABLE = r"The given NumPy array is not writable"


def to_torch(datapoint: Any, *, copy: bool = False) -> Any:
    """The datapoint with every numpy array replaced by a tensor; other leaves as they are.

    Lists stay lists, tuples tuples (namedtuples keep their type), mappings become dicts with
    the same keys. ``copy=False``: each tensor shares memory with its array (for batches from
    ``RemoteDataZMQ``, with the received frame) and is read-only by contract (module
    docstring). ``copy=True``: writable tensors that own their memory. Arrays in non-native
    byte order are the one exception to zero-copy (PyTorch cannot view them; they are
    converted). A dtype PyTorch lacks (float128, complex256) raises ``TypeError``.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
        return _convert(datapoint, copy, "batch")


def _convert(node: Any, copy: bool, path: str) -> Any:
    if isinstance(node, np.ndarray):
        return _tensor(node, copy, path)
    if isinstance(node, np.generic):
        return _tensor(np.asarray(node), copy, path)
    if isinstance(node, Mapping):
        return {k: _convert(v, copy, f"{path}[{k!r}]") for k, v in node.items()}
    if isinstance(node, tuple):
        items = [_convert(v, copy, f"{path}[{i}]") for i, v in enumerate(node)]
        return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
    if isinstance(node, list):
        return [_convert(v, copy, f"{path}[{i}]") for i, v in enumerate(node)]
    return node


def _tensor(a: np.ndarray, copy: bool, path: str) -> torch.Tensor:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))  # PyTorch refuses to view swapped bytes
    try:
        t = torch.from_numpy(a)
    except TypeError as e:
        raise TypeError(f"{path}: PyTorch has no dtype for {a.dtype} ({e})") from None
    return t.clone() if copy else t


def default_consumer_id() -> str:
    """``HOST-PID``, then ``-rankR`` when ``torch.distributed`` is initialised, then ``-workerW``
    inside a DataLoader worker: the broker's log then says which rank holds which connection."""
    name = f"{socket.gethostname()}-{os.getpid()}"
    if dist.is_available() and dist.is_initialized():
        name += f"-rank{dist.get_rank()}"
    info = get_worker_info()
    if info is not None:
        name += f"-worker{info.id}"
    return name


class RemoteTorchDataset(IterableDataset):
    """Batches from the broker at ``addr`` as tensors (``to_torch``), one connection per iterator.

    The keywords are :class:`RemoteDataZMQ`'s, passed on to it (``timeout``, ``curve``,
    ``options=ConsumerOptions(window=8)``, ...); ``options.consumer_id`` defaults to
    :func:`default_consumer_id`, resolved when iteration starts. With ``return_meta=True``
    each item is a :class:`feedline.protocol.wire.Batch` whose ``datapoint`` holds tensors.

    Use it with ``DataLoader(ds, batch_size=None)``: a producer batch is one item, the
    DataLoader adds no batching. ``num_workers=0`` is the intended setting: the producers did
    the work already, and a worker process would send each tensor to the main process through
    shared memory (a copy, and the zero-copy path is lost). With ``num_workers > 0`` every
    worker opens its own connection and so receives its own share of batches (none twice); a
    warning says so once per worker. The stream is endless: bound a loop by steps.
    """

    def __init__(
        self,
        addr: str,
        *,
        copy: bool = False,
        stream: str = DEFAULT_STREAM,
        resume: Cursor | dict | bytes | None = None,
        timeout: float | None = None,
        return_meta: bool = False,
        curve: ClientKeys | ServerKeys | None = None,
        bind: bool = False,
        options: ConsumerOptions | None = None,
        **moved: Any,
    ) -> None:
        super().__init__()
        self.addr, self.copy = addr, copy
        self.options = moved_options("RemoteTorchDataset", options, moved)
        self.remote_kwargs: dict[str, Any] = dict(
            stream=stream, resume=resume, timeout=timeout, return_meta=return_meta, curve=curve,
            bind=bind)

    def connect(self) -> RemoteDataZMQ:
        """A new :class:`RemoteDataZMQ` for the calling process, named for its rank/worker."""
        options = self.options
        if options.consumer_id is None:
            options = dataclasses.replace(options, consumer_id=default_consumer_id())
        info = get_worker_info()
        if options.ledger is not None and info is not None:
            # A ledger per DataLoader worker: two processes' buffered appends to one file
            # could interleave within a line.
            options = dataclasses.replace(options, ledger=f"{options.ledger}.worker{info.id}")
        return RemoteDataZMQ(self.addr, **self.remote_kwargs, options=options)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None:
            log.warning(
                "feedline: DataLoader worker %d of %d opens its own broker connection; "
                "num_workers=0 keeps batches zero-copy and saves %d processes "
                "(see docs/pytorch.md)", info.id, info.num_workers, info.num_workers)
        with self.connect() as remote:
            for item in remote:
                if isinstance(item, wire.Batch):
                    yield dataclasses.replace(
                        item, datapoint=to_torch(item.datapoint, copy=self.copy))
                else:
                    yield to_torch(item, copy=self.copy)
