"""atheris (libFuzzer) harness for the wire decoder: only ``wire.DecodeError`` may escape.

Run (see fuzz/README.md)::

    python fuzz/fuzz_wire.py --make-corpus fuzz/corpus   # seeds from valid messages
    python fuzz/fuzz_wire.py fuzz/corpus -max_total_time=600

Any other exception escaping :func:`feedline.protocol.wire.decode_header`, :func:`decode_batch` or
:func:`decode_tensorpack` is a finding: libFuzzer stops, prints the traceback and writes the
input to ``crash-*``. So is a decoded batch that breaks the decoder's contract (an array
that is not a numeric/bool view of exactly its frame's bytes).

Input layout (so that mutations stay meaningful): byte 0 picks the mode, byte 1 the limits,
the rest is the payload.

- mode 0: payload is a header frame -> ``decode_header``
- mode 1: payload is a tensorpack datapoint -> ``decode_tensorpack``
- mode 2: payload is a multipart message, frames as ``[u16 big-endian length][bytes]``, the
  last frame taking what is left -> ``decode_batch`` (and header-first, as the broker does)
- mode 3: structure-aware batch: the payload drives a header (msgpack) plus array frames
  whose lengths mostly match their shapes, with dtypes, dims and structure from interesting
  and hostile values
- mode 4: structure-aware tensorpack datapoint (msgpack-numpy array maps, nested)
- mode 5: payload is a multipart message as in mode 2, read as a direct-mode trainer reads
  what a producer sends: header first, then ``decode_bundle`` for a BUNDLE (several
  batches in one message, :mod:`feedline.protocol.bundle`), ``decode_batch`` for anything else

The seed corpus is written by ``--make-corpus`` from messages the encoder produced; nothing
binary is committed.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import atheris

with atheris.instrument_imports(include=["feedline"]):
    from feedline.protocol import bundle, messages, wire

import msgpack
import numpy as np

MODES = 6
# Default limits, and tight ones under which every limit is reachable by small inputs.
LIMITS = [
    wire.DEFAULT_LIMITS,
    wire.Limits(max_header_bytes=512, max_arrays=4, max_ndim=4, max_message_bytes=4096,
                max_depth=4, max_id_len=8, max_container_len=16),
]
_U16 = struct.Struct(">H")

_DTYPES = ["|u1", "|i1", "<i4", ">i4", "<i8", "<u2", "<f2", "<f4", ">f8", "<c8", "<c16",
           "|b1", "=f4", "<f16",
           # hostile: objects (pointers), structured, strings, void, datetimes, subarrays
           "|O", "O", "<M8[s]", "|V8", "<U4", "|S3", "(2,)<f4", "[('a', '<i4')]", "",
           "<i4\x00", "f4", "i", "<f4,<f4"]
_DIMS = [0, 1, 2, 3, 7, 64, 255, 256, 4096, 2**31, 2**32 + 1, 2**62, 2**63 - 1, 2**64 - 1,
         -1, -(2**63)]


# ------------------------------------------------------------------------------- builders


def _dim(fdp: atheris.FuzzedDataProvider) -> Any:
    r = fdp.ConsumeIntInRange(0, 9)
    if r < 6:
        return fdp.ConsumeIntInRange(0, 16)
    if r < 9:
        return fdp.PickValueInList(_DIMS)
    return fdp.PickValueInList([None, True, 1.5, "3", b"\x03", [2]])


def _scalar(fdp: atheris.FuzzedDataProvider) -> Any:
    return fdp.PickValueInList([
        None, True, False, 0, -1, 2**63 - 1, 2**64 - 1, -(2**63), 1.5, float("nan"), "",
        "x", b"", b"\x00", msgpack.ExtType(1, b"\0\0\0\0"), msgpack.ExtType(1, b"\xff" * 4),
        msgpack.ExtType(1, b"\0"), msgpack.ExtType(2, b"\0\0\0\0"),
    ])


def _structure(fdp: atheris.FuzzedDataProvider, narrays: int, depth: int) -> Any:
    r = fdp.ConsumeIntInRange(0, 7)
    if depth > 20 or r == 0:
        return _scalar(fdp)
    if r <= 3 and narrays:
        return msgpack.ExtType(1, struct.pack(">I", fdp.ConsumeIntInRange(0, narrays)))
    n = fdp.ConsumeIntInRange(0, 4)
    if r <= 5:
        return [_structure(fdp, narrays, depth + 1) for _ in range(n)]
    return {fdp.ConsumeUnicodeNoSurrogates(3): _structure(fdp, narrays, depth + 1)
            for _ in range(n)}


def _nbytes(shape: list[Any], dt: Any) -> int | None:
    """The byte size a shape claims, or None when it is not a list of ints. Not
    ``np.prod(shape, dtype=object)``: with a str among huge ints that multiplies the string
    (a 4 GB "3333..." from a 22-byte input, which libFuzzer reported as an out-of-memory of
    the decoder; the decoder itself refused that header at once)."""
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        return None
    try:
        itemsize = np.dtype(dt).itemsize
    except Exception:
        return None
    n = itemsize
    for d in shape:
        n *= d
    return n


def _rare(fdp: atheris.FuzzedDataProvider, n: int) -> bool:
    """True once in ``n``; False when the input is used up, so short inputs stay valid."""
    return fdp.ConsumeIntInRange(0, n - 1) == n - 1


def _batch(fdp: atheris.FuzzedDataProvider) -> list[Any]:
    """A batch header (msgpack) and frames, near-valid unless the input says otherwise.

    Choices come first and frame bytes last: a used-up input means valid choices, not
    hostile ones, so the fuzzer spends its time past the first checks.
    """
    narrays = fdp.ConsumeIntInRange(0, 6)
    specs: list[Any] = []
    sizes: list[int] = []
    for _ in range(narrays):
        dt = _scalar(fdp) if _rare(fdp, 8) else fdp.PickValueInList(_DTYPES)
        shape = [_dim(fdp) for _ in range(fdp.ConsumeIntInRange(0, 5))]
        specs.append(_scalar(fdp) if _rare(fdp, 16) else [dt, shape])
        nbytes = _nbytes(shape, dt)
        if nbytes is None:
            nbytes = fdp.ConsumeIntInRange(0, 64)
        if _rare(fdp, 8):  # a frame that lies about its length
            nbytes += fdp.ConsumeIntInRange(-8, 8)
        sizes.append(max(0, min(nbytes, 1 << 16)))
    refs = [msgpack.ExtType(1, struct.pack(">I", i)) for i in range(narrays)]
    header: dict[str, Any] = {
        "v": _scalar(fdp) if _rare(fdp, 16) else wire.PROTOCOL_VERSION,
        "k": fdp.ConsumeIntInRange(-1, 10) if _rare(fdp, 8) else 2,
        "p": "p" * fdp.ConsumeIntInRange(0, 300) if _rare(fdp, 4) else "prod",
        "q": _scalar(fdp) if _rare(fdp, 8) else fdp.ConsumeIntInRange(0, 2**62),
        "s": _scalar(fdp) if _rare(fdp, 8) else fdp.ConsumeIntInRange(0, 2**40),
        "e": _scalar(fdp) if _rare(fdp, 8) else fdp.ConsumeIntInRange(0, 9),
        "c": _scalar(fdp) if _rare(fdp, 8) else fdp.ConsumeIntInRange(0, 4),
        "d": _structure(fdp, narrays, 0) if _rare(fdp, 2) else refs,
        "a": specs,
    }
    for key in list(header):
        if _rare(fdp, 32):
            del header[key]
    extra = fdp.ConsumeIntInRange(-1, 1) if _rare(fdp, 4) else 0
    frames = [fdp.ConsumeBytes(n).ljust(n, b"\0") for n in sizes]
    if extra < 0 and frames:
        frames.pop()  # half a multipart message
    elif extra > 0:
        frames.append(fdp.ConsumeBytes(8))
    return [wire.packb(header), *frames]


def _tp_array(fdp: atheris.FuzzedDataProvider) -> dict[bytes, Any]:
    dt = fdp.PickValueInList(_DTYPES)
    shape = [_dim(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))]
    nbytes = _nbytes(shape, dt)
    if nbytes is None:
        nbytes = fdp.ConsumeIntInRange(0, 64)
    if _rare(fdp, 8):
        nbytes += fdp.ConsumeIntInRange(-8, 8)
    n = max(0, min(nbytes, 1 << 16))
    m: dict[bytes, Any] = {
        b"nd": fdp.PickValueInList([True, True, True, False, None, 1]),
        b"type": dt,
        b"kind": fdp.PickValueInList([b"", b"", b"", "", b"O", b"V", None]),
        b"shape": _scalar(fdp) if _rare(fdp, 16) else shape,
        b"data": fdp.ConsumeBytes(n).ljust(n, b"\0"),
    }
    if _rare(fdp, 16):
        del m[fdp.PickValueInList(list(m))]
    return m


def _tp_node(fdp: atheris.FuzzedDataProvider, depth: int) -> Any:
    r = fdp.ConsumeIntInRange(0, 5)
    if depth > 20 or r == 0:
        return _scalar(fdp)
    if r <= 2:
        return _tp_array(fdp)
    if r == 3:
        return {b"complex": True, b"data": fdp.ConsumeBytes(8)}
    n = fdp.ConsumeIntInRange(0, 4)
    if r == 4:
        return [_tp_node(fdp, depth + 1) for _ in range(n)]
    return {fdp.ConsumeBytes(3): _tp_node(fdp, depth + 1) for _ in range(n)}


def split_frames(payload: bytes) -> list[bytes]:
    """``[u16 length][bytes]...``; the last (or a truncated) frame takes what is left."""
    frames, i = [], 0
    while i + 2 <= len(payload):
        (n,) = _U16.unpack_from(payload, i)
        frames.append(payload[i + 2 : i + 2 + n])
        i += 2 + n
    if i < len(payload):
        frames.append(payload[i:])
    return frames


def join_frames(frames: list[Any]) -> bytes:
    out = b""
    for f in frames:
        b = f.tobytes() if isinstance(f, np.ndarray) else bytes(f)
        out += _U16.pack(len(b)) + b
    return out


# ------------------------------------------------------------------------------ the target


def _arrays(node: Any) -> Iterator[np.ndarray]:
    """Every array in a decoded datapoint, depth first."""
    if isinstance(node, np.ndarray):
        yield node
    elif isinstance(node, (list, tuple)):
        for x in node:
            yield from _arrays(x)
    elif isinstance(node, dict):
        for x in node.values():
            yield from _arrays(x)


def _check_numeric(arrays: list[np.ndarray]) -> None:
    for a in arrays:
        assert a.dtype.kind in "biufc" and not a.dtype.hasobject, a.dtype


def _check_batch(batch: wire.Batch, frames: list[Any]) -> None:
    """What a successful decode promises: numeric/bool views of exactly the frames' bytes."""
    found = list(_arrays(batch.datapoint))
    assert len(found) == len(frames) - 1, "arrays and frames differ in number"
    assert batch.nbytes == sum(a.nbytes for a in found)
    _check_numeric(found)
    for a in found:
        assert a.base is not None, "a decoded array must be a view on its frame"


def _check_tensorpack(node: Any) -> None:
    _check_numeric(list(_arrays(node)))


def one_input(data: bytes) -> str:
    """Decode ``data`` as the layout above says; return ``"ok"`` or ``"rejected:REASON"``.

    Raises anything that is not a DecodeError: that is the finding.
    """
    if len(data) < 2:
        return "rejected:short"
    mode, limits, payload = data[0] % MODES, LIMITS[data[1] % len(LIMITS)], data[2:]
    try:
        if mode == 0:
            header = wire.decode_header(payload, limits)
            if header["k"] != wire.Kind.BATCH:  # a control message: its typed decoder
                messages.from_map(header, limits)
        elif mode == 5:
            _bundle_input(split_frames(payload), limits)
        elif mode in (1, 4):
            if mode == 4:
                fdp = atheris.FuzzedDataProvider(payload)
                payload = wire.packb(_tp_node(fdp, 0))
            _check_tensorpack(wire.decode_tensorpack(payload, limits))
        else:
            if mode == 2:
                frames: list[Any] = split_frames(payload)
            else:
                frames = _batch(atheris.FuzzedDataProvider(payload))
            # Twice, as both callers do: whole (consumer), and header first (broker).
            first: Exception | None = None
            try:
                _check_batch(wire.decode_batch(frames, limits), frames)
            except wire.DecodeError as e:
                first = e
            if frames:
                try:
                    header = wire.decode_header(frames[0], limits)
                    _check_batch(wire.decode_batch(frames, limits, header=header), frames)
                except wire.DecodeError:
                    assert first is not None, "header-first refused what decode_batch took"
                else:
                    assert first is None, "header-first took what decode_batch refused"
            if first is not None:
                raise first
    except wire.DecodeError as e:
        return f"rejected:{e.reason}"
    return "ok"


def _bundle_input(frames: list[Any], limits: wire.Limits) -> None:
    """Mode 5: what a direct-mode trainer does with a producer's message, and what a broker
    checks of it before it forwards it (the two agree)."""
    if not frames:
        raise wire.DecodeError("empty")
    header = wire.decode_header(frames[0], limits)
    if header["k"] != wire.Kind.BUNDLE:
        _check_batch(wire.decode_batch(frames, limits, header=header), frames)
        return
    try:
        checked = bundle.check_bundle(frames, limits, header, bundle.MAX_BUNDLE)
    except wire.DecodeError:
        checked = None
    try:
        batches = bundle.decode_bundle(frames, limits, header, bundle.MAX_BUNDLE)
    except wire.DecodeError:
        assert checked is None, "a broker would forward what its consumers refuse"
        raise
    assert checked == (len(batches), batches[0].nbytes), "a broker refused a good bundle"
    n, per = len(batches), len(header["a"])
    for i, b in enumerate(batches):
        if len(frames) - 1 == per and per > 0:  # joined: each frame holds every batch's
            mine = [memoryview(f)[i * len(f) // n:(i + 1) * len(f) // n] for f in frames[1:]]
        else:
            mine = frames[1 + i * per:1 + (i + 1) * per]
        _check_batch(b, [frames[0], *mine])
    assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))


def _target(data: bytes) -> None:
    one_input(data)


# ---------------------------------------------------------------------------- the corpus


def _control_seeds() -> list[messages.Message]:
    """One valid message of every control kind."""
    return [
        messages.ProducerHello(producer="seed", session=1, next_seq=3, max_batch_bytes=9,
                               stream="val", last_broker=5, registration=2),
        messages.ConsumerHello(consumer="c", session=1, window=4, max_bytes=1 << 20,
                               registration=1),
        messages.Welcome(broker=7, registration=1, max_batch_bytes=1 << 20),
        messages.Grant(broker=7, batches=4, nbytes=4096, registration=1),
        messages.Want(sent=3, sent_bytes=300, size=100, registration=1),
        messages.Revoke(broker=7, registration=1),
        messages.Returned(sent=3, sent_bytes=300, registration=1),
        messages.Taken(taken=5, registration=1),
        messages.Deliver(broker=7, gap=2, registration=1),
        messages.Eos(producer="seed", seq=9, epochs=1),
        messages.Error(producer="seed", message="boom", traceback="tb"),
        messages.Refused(broker=7, reason="bad_dtype", seq=4, limit=1, detail="x"),
        messages.Reset(broker=7),
        messages.Heartbeat(broker=7),
        messages.Bye(),
    ]


def seeds() -> dict[str, bytes]:
    """Valid messages from the encoders, in the input layout above (name -> bytes)."""
    import msgpack_numpy  # packing only: its unpacking (pickle) is never used

    rng = np.random.default_rng(0)
    datapoints: list[Any] = [
        [rng.integers(0, 255, (2, 4, 4, 3), dtype=np.uint8), np.arange(2, dtype=np.int32)],
        (np.float32(1.5), np.zeros((0, 3), np.float64), "label", None),
        {"image": np.ones((3, 3), np.bool_), "meta": {"id": 7, "tags": [b"a", 1.0]}},
        np.arange(6, dtype=">f8").reshape(2, 3),
        [np.array([1 + 2j], np.complex64), [[np.zeros(1, np.float16)]]],
    ]
    out: dict[str, bytes] = {}
    for i, dp in enumerate(datapoints):
        frames = wire.encode_batch(dp, producer="seed", session=i, seq=i, epoch=1)
        for lim in range(len(LIMITS)):
            out[f"batch-{i}-{lim}"] = bytes([2, lim]) + join_frames(frames)
            out[f"header-{i}-{lim}"] = bytes([0, lim]) + frames[0]
        out[f"tensorpack-{i}"] = bytes([1, 0]) + msgpack_numpy.packb(dp, use_bin_type=True)
        prepared = wire.prepare_batch(dp)
        frames = bundle.bundle_frames([prepared] * 3, producer=wire.packb("seed"), session=i,
                                      seq=i, epoch=1)
        out[f"bundle-{i}"] = bytes([5, 0]) + join_frames(frames)
    for msg in _control_seeds():
        out[f"control-{type(msg).__name__}"] = bytes([0, 0]) + messages.encode(msg)
    for mode in (3, 4):
        for lim in range(len(LIMITS)):
            out[f"structured-{mode}-{lim}"] = bytes([mode, lim]) + bytes(range(64)) * 4
    return out


def make_corpus(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in seeds().items():
        (directory / name).write_bytes(data)
    return len(seeds())


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[1] == "--make-corpus":
        print(f"wrote {make_corpus(Path(argv[2]))} seeds to {argv[2]}")
        return
    run: Callable[[bytes], None] = _target
    atheris.Setup(argv, run)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
