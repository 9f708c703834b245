"""WebDataset shards: a streaming tar reader and the grouping of members into samples.

A WebDataset shard is a plain tar file whose consecutive members with the same *key* (the
path up to the first dot of the file name: ``train/n0153/img_0001.jpg`` -> key
``train/n0153/img_0001``, field ``jpg``) make one sample.

The reader walks 512-byte headers itself rather than through :mod:`tarfile`, whose stream
mode takes a bad header after the first member for the end of the archive and silently drops
the rest: here every header's checksum is checked, and a bad one, or a member cut short by
the end of the shard, is a :class:`~feedline.producer.shards.records.CorruptRecord` naming
the shard and the offset. It reads ustar, GNU (``L`` long names) and pax (``path``) headers,
which covers what ``tar``, :mod:`tarfile`, the ``webdataset`` library and ``feedline
convert`` write; links, directories and other entries are skipped.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator

from feedline.producer.shards.records import CorruptRecord, Readable

BLOCK = 512
_ZERO = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")
_META_LIMIT = 1 << 20  # a long name or pax header larger than this is not one


def _octal(field: bytes, shard: str, at: int) -> int:
    if field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise CorruptRecord(f"{shard}#{at}", f"bad number {text!r} in a tar header",
                            False) from None


def _pax_path(data: bytes) -> str | None:
    path = None
    while data:
        length, _, rest = data.partition(b" ")
        n = int(length)
        rec = data[len(length) + 1:n]
        key, _, value = rec.rstrip(b"\n").partition(b"=")
        if key == b"path":
            path = value.decode("utf-8", "surrogateescape")
        data = data[n:]
        if n <= 0 or not rest:
            break
    return path


def members(stream: Readable, shard: str, max_member: int = 1 << 30,
            ) -> Iterator[tuple[str, bytes]]:
    """``(name, data)`` for each regular file of the tar on ``stream``, in order. A member
    over ``max_member`` bytes is a resumable CorruptRecord (its header says where the next
    one starts, so the reader goes on after it when called again)."""
    long_name: str | None = None
    read, skip = stream.read, stream.skip
    while True:
        at = stream.offset
        hdr = read(BLOCK)
        if not hdr or hdr == _ZERO:
            return  # the end blocks, or an archive that ends without them
        if len(hdr) < BLOCK:
            raise CorruptRecord(f"{shard}#{at}", "the shard ends inside a tar header", False)
        # The checksum counts its own field as spaces (8 * 32).
        if _octal(hdr[148:156], shard, at) != sum(hdr) - sum(hdr[148:156]) + 256:
            raise CorruptRecord(f"{shard}#{at}", "bad tar header checksum", False)
        size = _octal(hdr[124:136], shard, at)
        typ = hdr[156:157]
        pad = -size % BLOCK
        if typ in (b"L", b"x"):
            if size > _META_LIMIT:
                raise CorruptRecord(f"{shard}#{at}", f"a {size}-byte tar name header", False)
            data = read(size)
            skip(pad)
            if len(data) < size:
                raise CorruptRecord(f"{shard}#{at}", "the shard ends inside a tar header", False)
            long_name = (data.rstrip(b"\0").decode("utf-8", "surrogateescape") if typ == b"L"
                         else _pax_path(data) or long_name)
            continue
        if typ not in _REGULAR:
            skip(size + pad)
            long_name = None
            continue
        name = long_name
        if name is None:
            name = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if hdr[257:262] == b"ustar" and hdr[345] != 0:
                prefix = hdr[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                name = f"{prefix}/{name}"
        long_name = None
        if size > max_member:
            got = skip(size + pad)
            raise CorruptRecord(f"{shard}#{name}", f"a {size}-byte member (more than "
                                f"max_sample_bytes)", got == size + pad)
        data = read(size)
        if len(data) < size:
            raise CorruptRecord(f"{shard}#{name}", f"the shard ends inside this member "
                                f"({len(data)} of {size} bytes)", False)
        if pad:
            skip(pad)
        yield name, data


def split_key(name: str) -> tuple[str, str]:
    """``dir/base.ext1.ext2`` -> (``dir/base``, ``ext1.ext2`` lower-cased)."""
    dot = name.find(".", name.rfind("/") + 1)
    return (name, "") if dot < 0 else (name[:dot], name[dot + 1:].lower())


def write_sample(tar: tarfile.TarFile, key: str, fields: dict[str, bytes]) -> int:
    """Append one sample (members ``key.EXT``, in the order given) with fixed metadata, so
    that the same input always gives the same bytes; returns the bytes written."""
    n = 0
    for ext, data in fields.items():
        info = tarfile.TarInfo(f"{key}.{ext}")
        info.size, info.mode, info.mtime = len(data), 0o644, 0
        tar.addfile(info, io.BytesIO(data))
        n += len(data)
    return n
