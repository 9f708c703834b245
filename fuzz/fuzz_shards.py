"""atheris (libFuzzer) harness for the shard readers: only CorruptRecord and ShardError may
escape.

Run (see fuzz/README.md)::

    python fuzz/fuzz_shards.py --make-corpus fuzz/corpus-shards
    python fuzz/fuzz_shards.py fuzz/corpus-shards -max_total_time=600 -rss_limit_mb=2048

It drives what reads a shard's bytes in a producer and in ``feedline info``: the WebDataset
source's tar reader and its field decoders (:meth:`WebDataset.read_stream`: members grouped
into samples, ``.cls``/``.json``/``.txt`` decoded), the TFRecord source
(:meth:`TFRecord.read_stream`: CRCs, ``tf.train.Example``, features), ``feedline info``'s
count of a shard (:func:`feedline.producer.info_cli.places`), the decoders alone
(:func:`~feedline.producer.shards.tfrecord.parse_example`, which may raise only DataError;
:func:`~feedline.producer.dataflow.shard_fields.wds_field`) and the Parquet source on a file
in memory. A reader yields datapoints or CorruptRecords and may raise ShardError; anything
else escaping is a finding, and so is a result that breaks a contract:

- the reader and ``info`` count the same places (a manifest's count is the reader's);
- a WebDataset datapoint holds at most ``max_sample_bytes`` of member data;
- a TFRecord datapoint is one per record, none larger than ``max_sample_bytes``;
- what the readers yield goes through the batch step as a producer runs it
  (:class:`~feedline.producer.dataflow.BatchData`, ``on_error="skip"``, batches of
  :data:`BATCH` consecutive datapoints, with ``use_list`` and without): it raises nothing but
  the DataError of ragged data, and not even that where more than half of a batch agree on
  each component's kind (:func:`_agree`); every datapoint is batched or skipped; and every
  batch it yields encodes for the wire (:func:`~feedline.protocol.encode.prepare_batch`), but for a
  stacked component of strings or objects, which only ``use_list`` can send. Modes 4 and 5
  batch their one datapoint between two ordinary ones.

Input layout: byte 0 picks the mode, byte 1 the limits (``max_sample_bytes`` 1 MiB, or 300
bytes so that the budget is reached by small inputs), the rest is the payload.

- mode 0: the payload is a tar file;
- mode 1: byte 2 picks a valid seed tar (ustar, GNU long names, pax, JSON, text, many members
  under one key), the rest edits it: ``[u16 truncate-at]`` then ``[u16 position][u8 value]``
  edits, so mutations stay inside real tar structure (a header's checksum is fixed after
  an edit unless the edit's value is 0xFF, so the fields behind it are reached);
- mode 2: the payload is a TFRecord file;
- mode 3: a valid seed TFRecord file, edited as in mode 1 (an edit inside a record's data
  has its CRC fixed unless the value is 0xFF, so ``parse_example`` sees hostile Examples);
- mode 4: the payload is one serialized Example -> ``parse_example`` and the source's
  features;
- mode 5: byte 2 picks a field extension, the payload is the member -> ``wds_field``;
- mode 6: a valid seed Parquet file, edited as in mode 1 -> the Parquet source.

Seeds named ``odd-*`` are the samples issue 53's second round found passing the readers and
killing a producer at the batch step: a ``.cls`` past int64, a ``.json`` deeper than the
wire carries, a TFRecord label of another shape than the others, a Parquet null.
"""

from __future__ import annotations

import io
import logging
import struct
import sys
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import atheris

# This checkout's feedline, not an installed one: the fuzzer runs from any directory.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

with atheris.instrument_imports(include=["feedline.producer.shards",
                                         "feedline.producer.dataflow.batch_data",
                                         "feedline.producer.dataflow.shard_fields",
                                         "feedline.producer.dataflow.webdataset",
                                         "feedline.producer.dataflow.tfrecord",
                                         "feedline.producer.dataflow.parquet",
                                         "feedline.producer.info_cli"]):
    from feedline.errors import DataError, EncodeError
    from feedline.producer import info_cli
    from feedline.producer.dataflow import BatchData, DataFromList, shard_fields
    from feedline.producer.dataflow.tfrecord import TFRecord
    from feedline.producer.dataflow.webdataset import WebDataset
    from feedline.producer.shards.records import CorruptRecord
    from feedline.producer.shards.retry import RetryPolicy, ShardError
    from feedline.producer.shards.tfrecord import (
        encode_example,
        frame,
        masked_crc,
        parse_example,
    )
    from feedline.protocol.encode import prepare_batch

import numpy as np

MODES = 7
BATCH = 3  # datapoints per batch (two agree: a majority)
LIMITS = [1 << 20, 300]  # max_sample_bytes
EXTS = ["cls", "json", "txt", "bin", "jpg", "id", "seg.json", "text"]
_EDIT = struct.Struct(">HB")
_CUT = struct.Struct(">H")


class Bytes:
    """An in-memory Readable (what ChunkStream is to a shard)."""

    def __init__(self, data: bytes) -> None:
        self.f = io.BytesIO(data)

    @property
    def offset(self) -> int:
        return self.f.tell()

    def read(self, n: int) -> bytes:
        return self.f.read(n)

    def skip(self, n: int) -> int:
        here = self.f.tell()
        end = min(here + n, len(self.f.getbuffer()))
        self.f.seek(end)
        return end - here


# ---------------------------------------------------------------------------------- seeds


def _tar(fmt: int, members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _tar_seeds() -> list[bytes]:
    plain = [(f"{i:04d}.{ext}", data) for i in range(3)
             for ext, data in (("bin", bytes(range(40))), ("cls", b"%d" % i))]
    long = [(f"{'d' * 110}/é{i}.{ext}", data) for i in range(2)
            for ext, data in (("bin", b"x" * 30), ("json", b'{"a": [1, 2]}'), ("cls", b"4"))]
    fields = [("k.json", b'{"k": [[1], {"z": null}]}'), ("k.txt", "é".encode()),
              ("k.cls", b" 7\n"), ("k.id", b"12"), ("k.seg.json", b"[]"), ("k.bin", b"\0" * 9)]
    many = [(f"m.e{i:02d}", bytes(100)) for i in range(8)] + [("m.cls", b"1")]
    return [_tar(tarfile.USTAR_FORMAT, plain), _tar(tarfile.GNU_FORMAT, long),
            _tar(tarfile.PAX_FORMAT, long), _tar(tarfile.PAX_FORMAT, fields),
            _tar(tarfile.USTAR_FORMAT, many)]


def _tfrecord_seeds() -> list[bytes]:
    a = b"".join(frame(encode_example({"image/encoded": bytes(range(i, i + 20)),
                                       "image/class/label": i})) for i in range(3))
    b = b"".join(frame(encode_example({"image/encoded": [b"p", b"q"], "image/class/label":
                                       [i, -1], "f": [0.5, 1.5]})) for i in range(2))
    return [a, b]


def _parquet_seeds() -> list[bytes]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return []
    out = []
    for kw in ({"row_group_size": 2}, {"row_group_size": 3, "compression": "none"}):
        buf = io.BytesIO()
        pq.write_table(pa.table({"image": [bytes([i]) * 10 for i in range(5)],
                                 "label": list(range(5))}), buf, **kw)
        out.append(buf.getvalue())
    return out


def _odd_tar_seeds() -> list[bytes]:
    """A ``.cls`` past int64; a ``.json`` 20 deep (the reader took 64, the wire carries 16)."""
    def sample(i: int, cls: bytes, js: bytes) -> list[tuple[str, bytes]]:
        return [(f"{i:04d}.bin", bytes(range(20))), (f"{i:04d}.cls", cls),
                (f"{i:04d}.json", js)]
    big = [m for i in range(3) for m in sample(i, b"%d" % (2**70 if i == 1 else i), b"[]")]
    deep = [m for i in range(3) for m in sample(i, b"1", b"[" * 20 + b"]" * 20 if i == 1
                                                else b"[1]")]
    return [_tar(tarfile.USTAR_FORMAT, big), _tar(tarfile.USTAR_FORMAT, deep)]


def _odd_tfrecord_seeds() -> list[bytes]:
    """Three records; the middle one's label two ints, the others' one."""
    return [b"".join(frame(encode_example({"image/encoded": bytes(range(i, i + 20)),
                                           "image/class/label": [i, i] if i == 1 else i}))
                     for i in range(3))]


def _odd_parquet_seeds() -> list[bytes]:
    """A null in the label column."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return []
    buf = io.BytesIO()
    pq.write_table(pa.table({"image": [bytes([i]) * 10 for i in range(5)],
                             "label": [None if i == 2 else i for i in range(5)]}), buf,
                   row_group_size=5)
    return [buf.getvalue()]


TAR_SEEDS, TF_SEEDS, PQ_SEEDS = _tar_seeds(), _tfrecord_seeds(), _parquet_seeds()
# the odd seeds go after the others: the edited modes pick a seed by index (byte 2)
ODD_TAR, ODD_TF, ODD_PQ = len(TAR_SEEDS), len(TF_SEEDS), len(PQ_SEEDS)
TAR_SEEDS += _odd_tar_seeds()
TF_SEEDS += _odd_tfrecord_seeds()
PQ_SEEDS += _odd_parquet_seeds()
EXAMPLE_SEEDS = [encode_example({"image/encoded": b"abc", "image/class/label": 3}),
                 encode_example({"image/encoded": [b"p", b"q"], "f": [0.5, -1.0],
                                 "image/class/label": [1, -(2**63)]})]


def _fix_tar(data: bytearray, pos: int) -> None:
    """The checksum of the 512-byte header ``pos`` falls in, as a writer would set it."""
    at = pos - pos % 512
    hdr = data[at:at + 512]
    if len(hdr) < 512 or not hdr[257:262].startswith(b"ustar"):
        return
    hdr[148:156] = b" " * 8
    data[at + 148:at + 156] = b"%06o\0 " % sum(hdr)


def _fix_tfrecord(data: bytearray) -> None:
    """Every record's CRCs, where the lengths still frame the file."""
    i = 0
    while i + 12 <= len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        if i + 16 + n > len(data):
            return
        data[i + 8:i + 12] = struct.pack("<I", masked_crc(bytes(data[i:i + 8])))
        data[i + 12 + n:i + 16 + n] = struct.pack("<I", masked_crc(bytes(data[i + 12:i + 12 + n])))
        i += 16 + n


def _edited(seeds: list[bytes], payload: bytes, fix: Callable[[bytearray, int], None] | None,
            ) -> bytes:
    if not seeds:
        return payload
    if not payload:
        return seeds[0]
    data = bytearray(seeds[payload[0] % len(seeds)])
    rest = payload[1:]
    if len(rest) >= _CUT.size:
        (cut,) = _CUT.unpack_from(rest)
        if cut and cut < len(data):
            del data[cut:]
        rest = rest[_CUT.size:]
    for i in range(0, len(rest) - _EDIT.size + 1, _EDIT.size):
        pos, value = _EDIT.unpack_from(rest, i)
        if data:
            data[pos % len(data)] = value
            if fix is not None and value != 0xFF:
                fix(data, pos % len(data))
    return bytes(data)


# ----------------------------------------------------------------------------- the target

_SOURCES: dict[int, tuple[list[WebDataset], TFRecord]] = {}


def _sources(limit: int) -> tuple[list[WebDataset], TFRecord]:
    """The sources under ``limit``: two WebDatasets (bytes and a label; JSON and text or a
    label), a TFRecord."""
    if limit not in _SOURCES:
        kw: dict[str, Any] = {"max_sample_bytes": limit, "retry": RetryPolicy(attempts=1)}
        _SOURCES[limit] = (
            [WebDataset(["fuzz.tar"], fields=["bin;jpg;e00", "cls;id"], **kw),
             WebDataset(["fuzz.tar"], fields=["json", "txt;cls"], **kw)],
            TFRecord(["fuzz.tfrecord"], fields=["image/encoded", "image/class/label"], **kw))
    return _SOURCES[limit]


def _nbytes(node: Any) -> int:
    if isinstance(node, np.ndarray):
        return int(node.nbytes)
    if isinstance(node, (bytes, str)):
        return len(node)
    if isinstance(node, (list, tuple)):
        return sum(_nbytes(x) for x in node)
    return 0


def _drain(items: Iterator[Any], limit: int) -> tuple[int, int]:
    """(places, corrupt) of a reader's output; checks each datapoint's size."""
    n = bad = 0
    for item in items:
        n += 1
        if isinstance(item, CorruptRecord):
            bad += 1
            continue
        assert isinstance(item, list), f"a reader yielded {type(item).__name__}"
        # .json objects are not member bytes; everything else is at most the sample's
        assert _nbytes([x for x in item if isinstance(x, np.ndarray)]) <= limit, \
            "a datapoint over max_sample_bytes"
    return n, bad


def _kind(x: Any) -> tuple[Any, ...]:
    """What must agree for values to stack: an array's dtype and shape, a scalar's type."""
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape)
    for name, types in (("bool", (bool, np.bool_)), ("int", (int, np.integer)),
                        ("float", (float, np.floating))):
        if isinstance(x, types):
            return (name,)
    return (type(x).__name__,)


def _agree(window: list[Any]) -> bool:
    """More than half of ``window`` have one structure, and on each component one kind."""
    from collections import Counter

    def most(values: list[Any]) -> tuple[Any, int]:
        return Counter(values).most_common(1)[0]

    n = len(window)
    lengths, k = most([len(dp) for dp in window])
    if 2 * k <= n:
        return False
    rows = [dp for dp in window if len(dp) == lengths]
    return all(2 * most([_kind(dp[c]) for dp in rows])[1] > n for c in range(lengths))


def _sendable(batch: Any) -> bool:
    """A stacked batch the wire can carry as arrays (a stacked str, bytes or object array
    is what use_list is for: not a finding)."""
    return all(not isinstance(c, np.ndarray) or c.dtype.kind in "biufc" for c in batch)


def _batched(items: list[Any], use_list: bool) -> int:
    """Run ``items`` (datapoints, no CorruptRecords) through the batch step in batches of
    BATCH, as a producer under ``on_error: skip`` does; returns how many it skipped. Raises
    (a finding) where it breaks the module docstring's contract."""
    logging.disable(logging.WARNING)  # each skip is logged: not a line per input here
    try:
        return _batched_quietly(items, use_list)
    finally:
        logging.disable(logging.NOTSET)


def _batched_quietly(items: list[Any], use_list: bool) -> int:
    skipped = 0
    for at in range(0, len(items), BATCH):
        window = items[at:at + BATCH]
        b = BatchData(DataFromList(window, shuffle=False), BATCH, remainder=True,
                      use_list=use_list, on_error="skip")
        try:
            batches = list(b)
        except DataError as e:
            if use_list or _agree(window):
                raise AssertionError(f"the batch step refused a batch that agrees: {e}") \
                    from None
            continue  # ragged data: one line saying use_list
        rows = sum(len(batch[0]) for batch in batches)
        assert rows + b.skipped == len(window), \
            f"{len(window)} datapoints, {rows} batched and {b.skipped} skipped"
        skipped += b.skipped
        for batch in batches:
            if use_list or _sendable(batch):
                try:
                    prepare_batch(batch)
                except EncodeError as e:
                    raise AssertionError(f"a batch the wire cannot carry: {e}") from None
    return skipped


def _through_batches(items: list[Any], use_lists: tuple[bool, ...]) -> str:
    """" skipped:N" for what the batch step skipped (with use_list False), else ""."""
    good = [x for x in items if not isinstance(x, CorruptRecord)]
    n = 0
    for use_list in use_lists:
        k = _batched(good, use_list)
        n = n if use_list else k
    return f" skipped:{n}" if n else ""


def _tar_input(data: bytes, limit: int) -> str:
    counted, _, corrupt = info_cli.places(Bytes(data), "fuzz.tar", "webdataset")
    out = []
    # bytes and a label stack (or go as lists); JSON and text go as lists only
    for wds, use_lists in zip(_sources(limit)[0], ((False, True), (True,)), strict=True):
        items = list(wds.read_stream(Bytes(data), "fuzz.tar"))
        n, bad = _drain(iter(items), limit)
        assert counted == n, f"info counts {counted} samples, the reader {n}"
        out.append(("corrupt" if bad else "ok") + _through_batches(items, use_lists))
    return out[0] if not corrupt else "corrupt"


def _tfrecord_input(data: bytes, limit: int) -> str:
    _, tfr = _sources(limit)
    items = list(tfr.read_stream(Bytes(data), "fuzz.tfrecord"))
    n, bad = _drain(iter(items), limit)
    counted, _, corrupt = info_cli.places(Bytes(data), "fuzz.tfrecord", "tfrecord")
    assert counted == n, f"info counts {counted} records, the reader {n}"
    return ("corrupt" if bad or corrupt else "ok") + _through_batches(items, (False, True))


def _example_input(data: bytes, limit: int) -> str:
    try:
        parse_example(data)
    except DataError:
        out = "rejected"
    else:
        out = "ok"
    _, tfr = _sources(limit)
    item = tfr._example(data, "fuzz.tfrecord#0")
    assert isinstance(item, (list, CorruptRecord)), type(item)
    usual = tfr._example(EXAMPLE_SEEDS[0], "fuzz.tfrecord#1")
    return out + _through_batches([usual, item, usual], (False, True))


USUAL = {"cls": b"7", "id": b"12", "json": b'{"a": [1, "b"]}', "seg.json": b"[1]",
         "txt": b"text", "text": b"text"}  # a field's ordinary value (else: bytes)


def _field_input(ext: str, data: bytes) -> str:
    try:
        value = shard_fields.wds_field(ext, data, f"fuzz.tar#k.{ext}")
    except CorruptRecord:
        return "corrupt"
    usual = shard_fields.wds_field(ext, USUAL.get(ext, b"bytes"), f"fuzz.tar#u.{ext}")
    dps = [[usual], [value], [usual]]
    return "ok" + _through_batches(dps, (False, True))


def _parquet_input(data: bytes, limit: int) -> str:
    from feedline.producer.dataflow.parquet import Parquet

    class InMemory(Parquet):
        def _open(self, url: str) -> Any:
            import pyarrow.parquet as pq

            f = io.BytesIO(data)
            return pq.ParquetFile(f), f

    src = InMemory(["fuzz.parquet"], max_sample_bytes=limit, retry=RetryPolicy(attempts=1))
    items: list[Any] = []
    try:
        for item in src._read("fuzz.parquet"):
            items.append(item)
    except ShardError:
        return "shard-error"  # the rows before it were served: batched below only whole
    n, _ = _drain(iter(items), 1 << 62)
    return f"rows:{n}" + _through_batches(items, (False, True))


def one_input(data: bytes) -> str:
    """Read one input as the layout above says; the outcome as a short string (``ok``,
    ``corrupt``, ``rejected``, ``shard-error``, ``rows:N``). Raises on a finding."""
    if len(data) < 2:
        return "short"
    mode, limit, payload = data[0] % MODES, LIMITS[data[1] % len(LIMITS)], data[2:]
    try:
        if mode in (0, 1):
            tar = payload if mode == 0 else _edited(TAR_SEEDS, payload, _fix_tar)
            return _tar_input(tar, limit)
        if mode in (2, 3):
            tfr = payload if mode == 2 else _edited(
                TF_SEEDS, payload, lambda d, _pos: _fix_tfrecord(d))
            return _tfrecord_input(tfr, limit)
        if mode == 4:
            return _example_input(payload, limit)
        if mode == 5:
            if not payload:
                return "short"
            return _field_input(EXTS[payload[0] % len(EXTS)], payload[1:])
        if not PQ_SEEDS:
            return "short"
        return _parquet_input(_edited(PQ_SEEDS, payload, None), limit)
    except ShardError:
        return "shard-error"


def _target(data: bytes) -> None:
    one_input(data)


def seeds() -> dict[str, bytes]:
    """Valid shards in every mode, under both limits (name -> bytes)."""
    out: dict[str, bytes] = {}
    for lim in range(len(LIMITS)):
        for i, t in enumerate(TAR_SEEDS[:ODD_TAR]):
            out[f"tar-{i}-{lim}"] = bytes([0, lim]) + t
            out[f"tar-edit-{i}-{lim}"] = bytes([1, lim, i, 0, 0])
        for i, t in enumerate(TF_SEEDS[:ODD_TF]):
            out[f"tfrecord-{i}-{lim}"] = bytes([2, lim]) + t
            out[f"tfrecord-edit-{i}-{lim}"] = bytes([3, lim, i, 0, 0])
        for i, ex in enumerate(EXAMPLE_SEEDS):
            out[f"example-{i}-{lim}"] = bytes([4, lim]) + ex
        for i in range(ODD_PQ):
            out[f"parquet-{i}-{lim}"] = bytes([6, lim, i, 0, 0])
    for i, ext in enumerate(EXTS):
        out[f"field-{ext}"] = bytes([5, 0, i]) + b'{"a": [1, "b"]}'
    for i in range(ODD_TAR, len(TAR_SEEDS)):
        out[f"odd-tar-{i - ODD_TAR}"] = bytes([1, 0, i, 0, 0])
    for i in range(ODD_TF, len(TF_SEEDS)):
        out[f"odd-tfrecord-{i - ODD_TF}"] = bytes([3, 0, i, 0, 0])
    for i in range(ODD_PQ, len(PQ_SEEDS)):
        out[f"odd-parquet-{i - ODD_PQ}"] = bytes([6, 0, i, 0, 0])
    out["odd-field-cls"] = bytes([5, 0, EXTS.index("cls")]) + b"%d" % 2**64
    out["odd-field-json"] = bytes([5, 0, EXTS.index("json")]) + b"[" * 20 + b"]" * 20
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
