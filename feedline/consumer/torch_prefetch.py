"""CudaPrefetcher: the host->device copy of the next batches runs while the model works.

Per batch: the frame's bytes are copied into a page-locked (pinned) staging buffer on the host
(a plain memcpy; the CPU is free while the GPU runs the step queued before), then
``.to(device, non_blocking=True)`` on a side CUDA stream starts the DMA and returns at once.
An event recorded on the side stream after the copy is what the model's stream waits for
before it uses the batch, so the model never reads a half-copied tensor and never waits for a
copy it does not need yet. ``depth`` batches are in flight at a time.

Pinned buffers are kept per slot (``depth + 1`` slots) and reused while the batch's shapes and
dtypes stay the same (pinning memory is slow; a new batch layout allocates once). A slot is
refilled only after the host has seen its previous copy's event complete, and the slot holds
its buffers until then: the DMA never reads memory that was freed or overwritten. The device
tensors are allocated on the side stream and handed to the model's stream with
``record_stream``, so the caching allocator does not reuse them while the model still reads.

Without CUDA the prefetcher is a pass-through (decided: a training script written for a GPU
runs unchanged on a CPU machine, its batches zero-copy as ``to_torch`` gives them); asking for
a CUDA device on a machine without one is an error at construction.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from feedline.consumer.torch_extra import TorchMissing, is_torch_missing

try:
    import torch
except ModuleNotFoundError as e:  # one line naming the extra, as torch_input says it
    if not is_torch_missing(e):
        raise
    raise TorchMissing() from None

from feedline.consumer.torch_input import to_torch
from feedline.errors import ConfigError, Unavailable
from feedline.producer.dataflow.base import as_dataflow

log = logging.getLogger(__name__)


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """``None``: ``cuda`` (the current device) if CUDA is available, else ``cpu``.

    Raises ``Unavailable`` for a CUDA device when CUDA is not available, ``ConfigError`` for
    a device type other than ``cuda`` or ``cpu``.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise Unavailable(
            f"CudaPrefetcher: device {dev} asked for, but CUDA is not available here "
            f"(torch {torch.__version__}); pass device=None to fall back to the CPU")
    if dev.type not in ("cuda", "cpu"):
        raise ConfigError(f"CudaPrefetcher: device type {dev.type!r} is not supported")
    return dev


def _map_tensors(node: Any, fn: Callable[[torch.Tensor, int], torch.Tensor], k: list[int]) -> Any:
    """``node`` with each tensor ``t`` replaced by ``fn(t, index)``, indices in walk order."""
    if isinstance(node, torch.Tensor):
        k[0] += 1
        return fn(node, k[0] - 1)
    if isinstance(node, dict):
        return {key: _map_tensors(v, fn, k) for key, v in node.items()}
    if isinstance(node, tuple):
        items = [_map_tensors(v, fn, k) for v in node]
        return type(node)(*items) if hasattr(node, "_fields") else tuple(items)
    if isinstance(node, list):
        return [_map_tensors(v, fn, k) for v in node]
    return node


class _Slot:
    """One batch's host staging buffers and the event that says their copy is done."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.event: Any = None

    def buffer(self, i: int, like: torch.Tensor, pin: bool) -> torch.Tensor:
        if i < len(self.buffers):
            b = self.buffers[i]
            if b.shape == like.shape and b.dtype == like.dtype:
                return b
            self.buffers[i] = b = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
            return b
        b = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
        self.buffers.append(b)
        return b


class _Staging:
    """The copy engine: host staging buffer -> side stream -> event, device-agnostic.

    Written against ``torch.get_device_module``: on ``cuda`` that is streams, events and pinned
    memory; on ``cpu`` PyTorch's stand-ins, so the CPU tests run this same code (unpinned).
    """

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.mod: Any = torch.get_device_module(device.type)
        self.stream = self.mod.Stream(device=device) if self.cuda else self.mod.Stream()
        self.slots = [_Slot() for _ in range(slots)]
        self.next_slot = 0

    def issue(self, datapoint: Any) -> tuple[Any, Any]:
        """Start copying ``datapoint`` to the device; returns (device datapoint, event)."""
        slot = self.slots[self.next_slot]
        self.next_slot = (self.next_slot + 1) % len(self.slots)
        if slot.event is not None:
            slot.event.synchronize()  # its last DMA has read the buffers: they may be reused
        host = to_torch(datapoint)

        def stage(t: torch.Tensor, i: int) -> torch.Tensor:
            buf = slot.buffer(i, t, pin=self.cuda)
            buf.copy_(t)  # frame -> staging buffer: the one host copy
            # copy=True: a new device tensor per batch, on the CPU too (never the buffer)
            return buf.to(self.device, non_blocking=True, copy=True)

        with self.mod.stream(self.stream):
            out = _map_tensors(host, stage, [0])
            event = self.mod.Event()
            event.record(self.stream)
        slot.event = event
        return out, event

    def hand_over(self, out: Any, event: Any) -> Any:
        """Make the model's (current) stream wait for ``event``; the batch is then usable."""
        current = self.mod.current_stream(self.device) if self.cuda else self.mod.current_stream()
        current.wait_event(event)
        if self.cuda:
            def keep(t: torch.Tensor, i: int) -> torch.Tensor:
                t.record_stream(current)  # allocated on the side stream, used on this one
                return t
            _map_tensors(out, keep, [0])
        return out


class CudaPrefetcher:
    """Iterate ``iterable`` (batches of numpy arrays or tensors) with batches already on ``device``.

    ``device``: a CUDA device (``None``: ``cuda`` when available, else the CPU, logged once).
    On the CPU it yields ``to_torch(batch)`` as it comes (a documented no-op: no staging, no
    copy). ``depth``: batches copied ahead of the one the model uses (1..64). Device tensors are
    new per batch and writable; the frames and staging buffers are not exposed. Iterate from
    the thread that runs the model (its current stream is the one that waits). Closing it (or
    leaving ``with``) closes ``iterable`` as a DataFlow
    (:func:`~feedline.producer.dataflow.base.as_dataflow`: its ``close()``, where it has one).
    """

    def __init__(self, iterable: Iterable[Any], device: torch.device | str | int | None = None,
                 depth: int = 2) -> None:
        if not 1 <= depth <= 64:
            raise ConfigError("depth must be in 1..64")
        self.iterable, self.depth = iterable, depth
        self._flow = as_dataflow(iterable)  # its close() is ours
        self.device = resolve_device(device)
        if device is None and self.device.type == "cpu":
            log.info("CudaPrefetcher: no CUDA device; batches pass through on the CPU")

    def __iter__(self) -> Iterator[Any]:
        if self.device.type != "cuda":
            for batch in self.iterable:
                yield to_torch(batch)
            return
        yield from _prefetch(iter(self.iterable), _Staging(self.device, self.depth + 1),
                             self.depth)

    def close(self) -> None:
        self._flow.close()

    def __enter__(self) -> CudaPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _prefetch(it: Iterator[Any], staging: _Staging, depth: int) -> Iterator[Any]:
    """Keep ``depth`` batches' copies in flight; yield each once its copy is usable."""
    pending: deque[tuple[Any, Any]] = deque()
    for batch in it:
        pending.append(staging.issue(batch))
        if len(pending) >= depth:
            break
    while pending:
        out, event = pending.popleft()
        # The next copy is queued before the model gets this batch: it overlaps the step.
        nxt = next(it, _END)
        if nxt is not _END:
            pending.append(staging.issue(nxt))
        yield staging.hand_over(out, event)


_END = object()
