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
- a TFRecord datapoint is one per record, none larger than ``max_sample_bytes``.

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
"""

from __future__ import annotations

import io
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
                                         "feedline.producer.dataflow.shard_fields",
                                         "feedline.producer.dataflow.webdataset",
                                         "feedline.producer.dataflow.tfrecord",
                                         "feedline.producer.dataflow.parquet",
                                         "feedline.producer.info_cli"]):
    from feedline.errors import DataError
    from feedline.producer import info_cli
    from feedline.producer.dataflow import shard_fields
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

import numpy as np

MODES = 7
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


TAR_SEEDS, TF_SEEDS, PQ_SEEDS = _tar_seeds(), _tfrecord_seeds(), _parquet_seeds()
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


def _tar_input(data: bytes, limit: int) -> str:
    counted, _, corrupt = info_cli.places(Bytes(data), "fuzz.tar", "webdataset")
    out = []
    for wds in _sources(limit)[0]:
        n, bad = _drain(wds.read_stream(Bytes(data), "fuzz.tar"), limit)
        assert counted == n, f"info counts {counted} samples, the reader {n}"
        out.append("corrupt" if bad else "ok")
    return out[0] if not corrupt else "corrupt"


def _tfrecord_input(data: bytes, limit: int) -> str:
    _, tfr = _sources(limit)
    n, bad = _drain(tfr.read_stream(Bytes(data), "fuzz.tfrecord"), limit)
    counted, _, corrupt = info_cli.places(Bytes(data), "fuzz.tfrecord", "tfrecord")
    assert counted == n, f"info counts {counted} records, the reader {n}"
    return "corrupt" if bad or corrupt else "ok"


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
    return out


def _field_input(ext: str, data: bytes) -> str:
    try:
        shard_fields.wds_field(ext, data, f"fuzz.tar#k.{ext}")
    except CorruptRecord:
        return "corrupt"
    return "ok"


def _parquet_input(data: bytes, limit: int) -> str:
    from feedline.producer.dataflow.parquet import Parquet

    class InMemory(Parquet):
        def _open(self, url: str) -> Any:
            import pyarrow.parquet as pq

            f = io.BytesIO(data)
            return pq.ParquetFile(f), f

    src = InMemory(["fuzz.parquet"], max_sample_bytes=limit, retry=RetryPolicy(attempts=1))
    n, _ = _drain(src._read("fuzz.parquet"), 1 << 62)
    return f"rows:{n}"


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
        for i, t in enumerate(TAR_SEEDS):
            out[f"tar-{i}-{lim}"] = bytes([0, lim]) + t
            out[f"tar-edit-{i}-{lim}"] = bytes([1, lim, i, 0, 0])
        for i, t in enumerate(TF_SEEDS):
            out[f"tfrecord-{i}-{lim}"] = bytes([2, lim]) + t
            out[f"tfrecord-edit-{i}-{lim}"] = bytes([3, lim, i, 0, 0])
        for i, ex in enumerate(EXAMPLE_SEEDS):
            out[f"example-{i}-{lim}"] = bytes([4, lim]) + ex
        for i in range(len(PQ_SEEDS)):
            out[f"parquet-{i}-{lim}"] = bytes([6, lim, i, 0, 0])
    for i, ext in enumerate(EXTS):
        out[f"field-{ext}"] = bytes([5, 0, i]) + b'{"a": [1, "b"]}'
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
