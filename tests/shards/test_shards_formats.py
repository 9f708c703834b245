"""The shard formats, read by feedline's own readers: WebDataset tar (as ``tar``, tarfile and
feedline write it), TFRecord (as TensorFlow writes it, CRCs checked) and tf.train.Example
(against TensorFlow's parser), Parquet (pyarrow); and what each does with corrupt input:
counted, named, the rest of the shard read where it can be found."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedline.producer.dataflow.parquet import Parquet
from feedline.producer.dataflow.tfrecord import TFRecord
from feedline.producer.dataflow.webdataset import WebDataset
from feedline.producer.shards.records import CorruptRecord
from feedline.producer.shards.tar import members
from feedline.producer.shards.tfrecord import encode_example, frame, masked_crc, parse_example
from tests.support.shard_support import make_tfrecords, make_wds, payload


class Bytes:
    """An in-memory Readable."""

    def __init__(self, data: bytes) -> None:
        self.f = io.BytesIO(data)

    @property
    def offset(self) -> int:
        return self.f.tell()

    def read(self, n: int) -> bytes:
        return self.f.read(n)

    def skip(self, n: int) -> int:
        return len(self.f.read(n))


def read_all(ds) -> list:
    ds.reset_state()
    return list(ds)


def ids(ds) -> list[int]:
    return [int(dp[1]) for dp in read_all(ds)]


def test_webdataset_groups_members_by_key_in_order(tmp_path: Path):
    make_wds(tmp_path, shards=3, per_shard=7)
    ds = WebDataset(str(tmp_path / "train-{000000..000002}.tar"), fields=["bin", "cls"],
                    shuffle=False, read_ahead=1)
    got = read_all(ds)
    assert [int(i) for _, i in got] == list(range(21))
    assert all(d.tobytes() == payload(int(i)) for d, i in got)
    assert got[3][0].path.endswith("train-000000.tar#00000003.bin")  # a decoder names it
    assert ds.stats.shards_read == 3 and ds.stats.corrupt_records == 0


def test_shards_are_shuffled_per_epoch_and_interleaved(tmp_path: Path):
    make_wds(tmp_path, shards=6, per_shard=4)
    ds = WebDataset(str(tmp_path / "*.tar"), fields=["bin", "cls"], seed=1, read_ahead=2)
    ds.reset_state()
    e0, e1 = [int(i) for _, i in ds], [int(i) for _, i in ds]
    assert sorted(e0) == sorted(e1) == list(range(24))
    assert e0 != e1  # another shard order in the next epoch
    # two shards open at once: their samples alternate
    assert e0[0] // 4 != e0[1] // 4 and e0[0] // 4 == e0[2] // 4


def test_static_shard_of_the_shard_list(tmp_path: Path):
    make_wds(tmp_path, shards=5, per_shard=2)
    parts = [sorted(ids(WebDataset(str(tmp_path / "*.tar"), fields=["bin", "cls"],
                                   shard=(k, 2)))) for k in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(10)) and not set(parts[0]) & set(parts[1])


def test_tar_written_by_gnu_tar_with_long_names_and_pax(tmp_path: Path):
    d = tmp_path / ("a" * 90) / ("b" * 60)
    d.mkdir(parents=True)
    for i in range(3):
        (d / f"s{i}.bin").write_bytes(payload(i, 700))
        (d / f"s{i}.cls").write_text(str(i))
    for fmt in ("gnu", "pax", "ustar"):
        shard = tmp_path / f"{fmt}.tar"
        r = subprocess.run(["tar", f"--format={fmt}", "-cf", str(shard), "-C", str(tmp_path),
                            "--sort=name", str(d.relative_to(tmp_path))], capture_output=True)
        if fmt == "ustar" and r.returncode:
            continue  # the path is over ustar's 255 characters: tar refuses it
        assert r.returncode == 0, r.stderr
        got = read_all(WebDataset(str(shard), fields=["bin", "cls"], shuffle=False))
        assert [int(i) for _, i in got] == [0, 1, 2], fmt
        assert got[2][0].tobytes() == payload(2, 700)


def tar_bytes(n: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for i in range(n):
            for ext, data in (("bin", payload(i, 1500)), ("cls", b"%d" % i)):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_bad_header_checksum_is_named_and_ends_the_shard(tmp_path: Path):
    data = bytearray(tar_bytes(6))
    names = [n for n, _ in members(Bytes(bytes(data)), "x")]
    # the header of sample 3's first member: 3 samples of 2 members before it
    at = sum(512 + 1536 if n.endswith(".bin") else 1024 for n in names[:6])
    data[at + 10] ^= 0xFF
    (tmp_path / "bad.tar").write_bytes(bytes(data))
    ds = WebDataset(str(tmp_path / "bad.tar"), fields=["bin", "cls"])
    assert sorted(ids(ds)) == [0, 1, 2]  # tarfile's stream mode would end here silently
    assert ds.stats.corrupt_records == 1 and list(ds.stats.corrupt) == [f"{tmp_path}/bad.tar#{at}"]


def test_a_truncated_member_is_named_and_the_samples_before_it_kept(tmp_path: Path):
    data = tar_bytes(5)
    last_bin = 4 * (512 + 1536 + 1024)  # sample 4's .bin header: 4 samples before it
    (tmp_path / "cut.tar").write_bytes(data[:last_bin + 512 + 700])  # half its data
    ds = WebDataset(str(tmp_path / "cut.tar"), fields=["bin", "cls"])
    assert ids(ds) == [0, 1, 2, 3]
    assert ds.stats.corrupt_records == 1
    assert ds.stats.corrupt[0] == f"{tmp_path}/cut.tar#0004.bin"


def test_an_oversized_member_is_skipped_and_the_next_sample_read(tmp_path: Path):
    (tmp_path / "big.tar").write_bytes(tar_bytes(4))
    ds = WebDataset(str(tmp_path / "big.tar"), fields=["bin", "cls"], max_sample_bytes=1000)
    assert ids(ds) == []  # every .bin is 1500 bytes: four corrupt samples, each named
    assert ds.stats.corrupt_records == 4  # one per sample: its place, not one per member
    assert [c.rsplit("#", 1)[1] for c in ds.stats.corrupt] == ["0000", "0001", "0002", "0003"]


def test_a_sample_without_a_field_or_with_a_bad_label_is_corrupt(tmp_path: Path):
    with tarfile.open(tmp_path / "f.tar", "w") as t:
        for key, ext, data in (("a", "bin", b"x"), ("a", "cls", b"1"), ("b", "bin", b"y"),
                               ("c", "bin", b"z"), ("c", "cls", b"nope"),
                               ("d", "bin", b"w"), ("d", "cls", b"4"), ("d", "json", b"{}")):
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    ds = WebDataset(str(tmp_path / "f.tar"), fields=["bin", "cls"], shuffle=False)
    assert ids(ds) == [1, 4]
    assert ds.stats.corrupt_records == 2
    assert [c.rsplit("#", 1)[1] for c in ds.stats.corrupt] == ["b", "c.cls"]
    ds = WebDataset(str(tmp_path / "f.tar"), fields=["json;cls"], shuffle=False)
    assert [dp[0] for dp in read_all(ds)] == [1, {}]  # json where there is one, else cls


@pytest.mark.tf
def test_tfrecords_written_by_tensorflow_read_with_crcs_checked(tmp_path: Path):
    tf = pytest.importorskip("tensorflow")
    path = tmp_path / "tf.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as w:
        for i in range(5):
            ex = tf.train.Example(features=tf.train.Features(feature={
                "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[payload(i, 500)])),
                "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(
                    value=[i - 2]))}))
            w.write(ex.SerializeToString())
    got = read_all(TFRecord(str(path), shuffle=False))
    assert [lbl for _, lbl in got] == [-2, -1, 0, 1, 2]
    assert got[4][0].tobytes() == payload(4, 500)
    # and ours, read by TensorFlow
    mine = tmp_path / "mine.tfrecord"
    mine.write_bytes(b"".join(frame(encode_example({"x": [i, 7]})) for i in range(3)))
    back = [tf.train.Example.FromString(r.numpy()) for r in tf.data.TFRecordDataset(str(mine))]
    assert [list(e.features.feature["x"].int64_list.value) for e in back] == [[0, 7], [1, 7],
                                                                              [2, 7]]


def test_masked_crc_matches_the_known_value():
    # TensorFlow's crc32c masking of b"foo" (tensorflow/core/lib/hash/crc32c_test: Mask())
    import google_crc32c

    crc = google_crc32c.value(b"123456789")
    assert crc == 0xE3069283  # the CRC-32C check value
    assert masked_crc(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def test_a_bad_data_crc_loses_one_record_a_bad_length_crc_the_rest(tmp_path: Path):
    make_tfrecords(tmp_path, files=1, per_file=6, nbytes=100)
    path = next(tmp_path.glob("*.tfrecord"))
    data = bytearray(path.read_bytes())
    rec = len(data) // 6
    data[2 * rec + 12 + 40] ^= 1  # record 2's data
    path.write_bytes(bytes(data))
    ds = TFRecord(str(path), fields=["image/encoded", "image/class/label"])
    assert ids(ds) == [0, 1, 3, 4, 5] and ds.stats.corrupt_records == 1
    assert ds.stats.corrupt[0] == f"{path}#{2 * rec}"
    data[4 * rec + 2] ^= 1  # record 4's length
    path.write_bytes(bytes(data))
    ds = TFRecord(str(path), fields=["image/encoded", "image/class/label"])
    assert ids(ds) == [0, 1, 3] and ds.stats.corrupt_records == 2


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(
    st.text(min_size=1, max_size=12),
    st.one_of(st.lists(st.binary(max_size=40), min_size=1, max_size=3),
              st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=4),
              st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=4)),
    max_size=5))
def test_examples_round_trip_and_agree_with_protobuf(features):
    tf_pb = pytest.importorskip("tensorflow.core.example.example_pb2")
    raw = encode_example(features)
    parsed = parse_example(raw)
    ex = tf_pb.Example.FromString(raw)
    for k, v in features.items():
        f = ex.features.feature[k]
        if isinstance(v[0], bytes):
            assert parsed[k] == v == list(f.bytes_list.value)
        elif isinstance(v[0], int):
            assert parsed[k] == v == list(f.int64_list.value)
        else:
            assert np.array_equal(parsed[k], np.asarray(v, np.float32))
            assert list(parsed[k]) == list(f.float_list.value)
    # and TensorFlow's own serialization (packed, another field order) parses the same
    assert parse_example(ex.SerializeToString()).keys() == parsed.keys()


@given(st.binary(max_size=200))
def test_garbage_is_a_value_error_never_a_crash(data):
    try:
        parse_example(data)
    except ValueError:
        pass


def test_parquet_row_groups_and_selected_columns(tmp_path: Path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for f in range(2):
        rows = range(f * 10, f * 10 + 10)
        table = pa.table({"image": [payload(i, 200) for i in rows], "label": list(rows),
                          "unused": [str(i) for i in rows]})
        pq.write_table(table, tmp_path / f"p-{f}.parquet", row_group_size=3)
    ds = Parquet(str(tmp_path / "p-*.parquet"), shuffle=False, read_ahead=1)
    got = read_all(ds)
    assert [lbl for _, lbl in got] == list(range(20))
    assert got[13][0].tobytes() == payload(13, 200)
    assert ds.samples() == 0 and ds.units() == 2 and ds.samples() == 20  # from the footers


def test_corrupt_record_names_its_place():
    e = CorruptRecord("s.tar#42", "bad tar header checksum", False)
    assert str(e) == "s.tar#42: bad tar header checksum" and not e.resumable
