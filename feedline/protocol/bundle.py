"""Several batches in one message: what a broker or a direct-mode trainer takes from its
producers, and what a broker forwards to a consumer that takes them.

A batch of 16 KB costs both ends more in per-message work (a read, a header to decode and
check, a turn of the loop) than in bytes. When a producer holds several batches of one layout
(a batching pipeline yields nothing else) and its credit covers them all, it sends them as one
*bundle*, if the host said in WELCOME that it takes bundles (``bundle`` > 1: the most
batches in one). The header is decoded and checked once for all of them::

    {"v": 2, "k": 22,            # Kind.BUNDLE
     "p": ..., "q": ..., "e": ...,  # producer id, session, epoch: as a batch's
     "s": 41,                     # the first batch's sequence number; the others follow
     "n": 8,                      # batches in the bundle (2 .. the host's WELCOME.bundle)
     "c": ..., "d": ..., "a": ...}  # container, structure, array specs: one batch's

followed by the arrays, in one of two layouts the frame count tells apart: *joined*
(batches of at most the host's WELCOME ``join`` bytes of arrays: :data:`JOIN_BYTES` for a
direct-mode trainer, :data:`JOIN_FORWARDED` for a broker), ``len(a)`` frames, the i-th
holding the i-th array of every batch in turn; or ``n x len(a)`` frames, batch by batch
(larger batches: joining them would copy them). A frame costs each end about as much as a
small batch's bytes, so joined, a bundle of 64 batches of 16 KB is 3 frames, not 129. Every
batch is the same layout; a bundle never carries exact delivery's batches (their unit
fields differ), which go one by one. The host counts each batch of a bundle against the
producer's credit as if it had come alone, the header's bytes with the first:
``len(header) + its arrays``, then each other's arrays, which is what the producer counts
as sent.

Trust: :func:`decode_bundle` applies every check of :func:`feedline.protocol.wire.decode_batch` (the
same limits, the header's checks once, every frame's length) and bounds ``n`` by the
host's own maximum; a bundle beyond it, or with frames that do not divide into ``n``
batches, is refused whole (:class:`~feedline.protocol.codec.DecodeError`). :func:`check_bundle` is
what a broker checks before it forwards one: the same verdict, without building batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from feedline.protocol.codec import (
    CONTAINER_LIST,
    PROTOCOL_VERSION,
    DecodeError,
    Kind,
    Limits,
    check_bools,
    packb,
    unpackb,
)
from feedline.protocol.encode import Prepared, sender_fields, uint
from feedline.protocol.wire import (
    Batch,
    _arrays_from_frames,
    _bytes_of,
    _in_order,
    check_batch_header,
    datapoint,
)

MAX_BUNDLE = 64  # batches in one bundle, at most (a host may say fewer)
_U63 = (1 << 63) - 1  # what a batch's sequence number may be, at most
BUNDLE_BYTES = 4 << 20  # a producer fills a bundle up to this many wire bytes
# A bundle of batches of at most this many array bytes is sent joined to a direct-mode
# trainer (or a host whose WELCOME says nothing): each array of the layout one frame, every
# batch's in turn. Joining copies the batches on the producer, and saves each end a frame
# per array of each batch. One 224x224x3 image (150 KB) gains from it (direct mode +7-28%,
# via a broker +37-60%), 190 KB breaks even in direct mode, 300 KB loses there
# (docs/performance.md); larger batches go a frame per array each.
JOIN_BYTES = 192 << 10
# What a broker asks for in its WELCOME (``join``) instead: it forwards each frame (its
# ingress, its egress and the consumer pay for each), so joining gains up to larger batches
# there: 300 KB +11-20%, 450-600 KB level (docs/performance.md).
JOIN_FORWARDED = 384 << 10
_V_K = packb("v") + packb(PROTOCOL_VERSION) + packb("k") + packb(int(Kind.BUNDLE))


def bundle_frames(prepared: Sequence[Prepared], *, producer: bytes, session: int, seq: int,
                  epoch: int, join: int = 0) -> list[Any]:
    """``[header, array frames...]``; every ``Prepared`` of one layout (the same header
    tail), ``producer`` packed (:func:`packb`). Batches of at most ``join`` bytes of arrays
    (what the host's WELCOME says; 0, as a host that says nothing: :data:`JOIN_BYTES`)
    travel joined (one frame per array of the layout); larger ones a frame per array each."""
    first = prepared[0]
    head = b"\x8a" + _V_K + sender_fields(producer, session, seq, epoch) + b"\xa1n" \
        + uint(len(prepared))
    frames: list[Any] = [head + first.tail]
    if first.nbytes <= (join or JOIN_BYTES):
        for j in range(len(first.arrays)):
            frames.append(b"".join([p.arrays[j].data for p in prepared]))
    else:
        for p in prepared:
            frames.extend(p.arrays)
    return frames


def _parts(frames: Sequence[Any], limits: Limits, header: dict, most: int) -> tuple:
    """The checks made once per bundle: its count (``2..most``), no exact fields, the frames
    (one per array of the layout, or one per array of each batch), the header's specs, the
    sequence numbers' range. Returns (count, arrays per batch, specs, joined)."""
    n = header.get("n")
    if type(n) is not int or not 2 <= n <= most:
        raise DecodeError("bad_header", f"a bundle of {n!r} batches (this host takes 2..{most})")
    if "u" in header:
        raise DecodeError("bad_header", "exact delivery's batches travel one by one")
    specs_in = header.get("a")
    per = len(specs_in) if type(specs_in) is list else -1
    if per < 0 or len(frames) - 1 not in (per, n * per):
        raise DecodeError("frame_count", f"{len(frames) - 1} frames for {n} batches")
    specs = check_batch_header(header, per, limits)
    if header["s"] + n - 1 > _U63:
        raise DecodeError("bad_header", "sequence numbers beyond 2**63 - 1")
    return n, per, specs, len(frames) - 1 == per and per > 0


def _slots(frames: Sequence[Any], specs: Sequence[tuple], n: int) -> list[tuple[Any, int]]:
    """A joined bundle's frames as (a view of the frame, one batch's bytes of it); each
    frame ``n`` times its array's bytes, or DecodeError."""
    out = []
    for (dt, shape), f in zip(specs, frames[1:], strict=True):
        size = dt.itemsize
        for d in shape:
            size *= d
        buf = memoryview(_bytes_of(f))
        if len(buf) != n * size:
            raise DecodeError("shape_mismatch", f"{n} x {shape} {dt.str} != {len(buf)} bytes")
        out.append((buf, size))
    return out


def _joined_arrays(frames: Sequence[Any], specs: Sequence[tuple], n: int,
                   limits: Limits) -> tuple[list[list[np.ndarray]], int]:
    """A joined bundle's arrays, batch by batch, and one batch's array bytes. Each frame is
    made one read-only array of the ``n`` batches' (its length checked by :func:`_slots`,
    all ``n`` batches' bytes within the message limit, a bool array's bytes checked at once)
    and indexed, a view for each batch: what :func:`_arrays_from_frames` gives for each
    batch's slices of the frames, for one ndarray and one check per array of the layout, not
    per array of each batch."""
    slots = _slots(frames, specs, n)
    nbytes = sum(size for _, size in slots)
    if n * nbytes > limits.max_message_bytes:
        raise DecodeError("message_too_large", f"> {limits.max_message_bytes} bytes")
    columns = []
    for (dt, shape), (buf, _) in zip(specs, slots, strict=True):
        arr = np.ndarray((n, *shape), dt, buf)
        arr.flags.writeable = False  # a view on a received frame: never written through
        if dt.kind == "b":
            check_bools(arr)
        columns.append(arr)
    return [[c[i, ...] for c in columns] for i in range(n)], nbytes


def _batch(frames: Sequence[Any], specs: Sequence[tuple], header: dict, limits: Limits,
           in_order: bool) -> tuple[Any, int]:
    """One batch's datapoint (array views on ``frames``, the structure checked) and bytes."""
    arrays, nbytes = _arrays_from_frames(specs, frames, limits)
    # The container is checked with the first batch (datapoint).
    return datapoint(header.get("d"), arrays, header.get("c", CONTAINER_LIST), limits,
                     in_order), nbytes


def decode_bundle(frames: Sequence[Any], limits: Limits, header: dict,
                  most: int) -> list[Batch]:
    """The batches of ``[header, array frames...]`` (``header`` decoded already, kind
    BUNDLE), each array a read-only view on its frame; raises DecodeError.

    ``most``: the most batches the host takes in one (what its WELCOME said)."""
    n, per, specs, joined = _parts(frames, limits, header, most)
    in_order = _in_order(header.get("d"), per)
    pid, session, seq0, epoch = header["p"], header["q"], header["s"], header["e"]
    header_bytes = len(_bytes_of(frames[0]))
    total = 0
    out = []
    structure, container = header.get("d"), header.get("c", CONTAINER_LIST)
    by_batch, nbytes = _joined_arrays(frames, specs, n, limits) if joined else ([], 0)
    for i in range(n):
        if joined:
            # The container is checked with the first batch (datapoint).
            dp = datapoint(structure, by_batch[i], container, limits, in_order)
        else:
            dp, nbytes = _batch(frames[1 + i * per:1 + (i + 1) * per], specs, header, limits,
                                in_order)
        total += nbytes
        if total > limits.max_message_bytes:
            raise DecodeError("message_too_large", f"> {limits.max_message_bytes} bytes")
        batch = object.__new__(Batch)  # as decode_batch builds it: no frozen __init__
        batch.__dict__.update(
            producer=pid, session=session, seq=seq0 + i, epoch=epoch, datapoint=dp,
            nbytes=nbytes, wire_bytes=nbytes + (header_bytes if i == 0 else 0),
            unit=-1, index=-1, last=False, pipeline=0, pipeline_file=0,
            code="")
        out.append(batch)
    return out


def check_bundle(frames: Sequence[Any], limits: Limits, header: dict,
                 most: int) -> tuple[int, int]:
    """What :func:`decode_bundle` checks, for a host that forwards a bundle rather than
    reading it (a broker): the first batch is decoded; every other one has the first's
    layout, so only its frames' lengths (and a bool array's bytes) are left to check.
    Returns (the batches, one batch's array bytes); raises DecodeError."""
    n, per, specs, joined = _parts(frames, limits, header, most)
    slots = _slots(frames, specs, n) if joined else []
    first = [buf[:size] for buf, size in slots] if joined else frames[1:1 + per]
    _, nbytes = _batch(first, specs, header, limits, _in_order(header.get("d"), per))
    if n * nbytes > limits.max_message_bytes:
        raise DecodeError("message_too_large", f"> {limits.max_message_bytes} bytes")
    if joined:
        for (dt, _), (buf, _) in zip(specs, slots, strict=True):
            if dt.kind == "b":  # every batch's at once
                check_bools(np.frombuffer(buf, np.bool_))
        return n, nbytes
    lengths = [len(_bytes_of(f)) for f in frames]
    if lengths[1:] != lengths[1:1 + per] * n:  # each batch's frames as long as the first's
        i = next(i for i in range(1, len(frames)) if lengths[i] != lengths[1 + (i - 1) % per])
        dt, shape = specs[(i - 1) % per]
        raise DecodeError("shape_mismatch", f"{shape} {dt.str}: != {lengths[i]}")
    for j, (dt, shape) in enumerate(specs):
        if dt.kind == "b":
            for i in range(1, n):
                check_bools(np.ndarray(shape, dt, _bytes_of(frames[1 + i * per + j])))
    return n, nbytes


def split(frames: Sequence[Any], limits: Limits, sizes: Sequence[int]) -> list[list[Any]]:
    """A bundle (checked already: a broker's) as messages of ``sizes`` batches each, in
    order (``sizes`` sums to its count): ``[header, arrays...]`` per part, a part of one
    batch a plain batch; a joined bundle's parts are views of its frames (no copy). A broker
    splits a bundle for a consumer that takes fewer batches in one delivery than it holds
    (an older one: none), or that has room for fewer."""
    # Re-packed as it came (ext types as they are): the broker checked it at its ingress.
    header = unpackb(_bytes_of(frames[0]), raw=False, strict_map_key=False)
    n = header.pop("n")
    seq, per = header["s"], len(header["a"])
    joined = len(frames) - 1 == per and per > 0
    slots = [memoryview(_bytes_of(f)) for f in frames[1:]] if joined else []
    out = []
    at = 0
    for k in sizes:
        part = dict(header, s=seq, k=int(Kind.BUNDLE if k > 1 else Kind.BATCH))
        if k > 1:
            part["n"] = k
        if joined:
            arrays = [buf[at * (len(buf) // n):(at + k) * (len(buf) // n)] for buf in slots]
        else:
            arrays = list(frames[1 + at * per:1 + (at + k) * per])
        out.append([packb(part), *arrays])
        seq, at = seq + k, at + k
    return out
