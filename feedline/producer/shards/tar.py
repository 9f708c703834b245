"""WebDataset shards: a streaming tar reader and the grouping of members into samples.

A WebDataset shard is a plain tar file whose consecutive members with the same *key* (the
path up to the first dot of the file name: ``train/n0153/img_0001.jpg`` -> key
``train/n0153/img_0001``, field ``jpg``) make one sample.

The reader walks 512-byte headers itself rather than through :mod:`tarfile`, whose stream
mode takes a bad header after the first member for the end of the archive and silently drops
the rest: here every header's checksum is checked, and a bad one, or a member cut short by
the end of the shard, is a :class:`~feedline.producer.shards.records.CorruptRecord` naming
the shard and the offset. It reads ustar, GNU (``L`` long names) and pax (``path``, ``size``)
headers, which covers what ``tar``, :mod:`tarfile`, the ``webdataset`` library and ``feedline
convert`` write; links, directories and other entries are skipped.

The bytes are hostile: every number in a header must be octal digits (or GNU base-256), a pax
record must be ``LENGTH KEY=VALUE\\n`` with a length that fits, and whatever does not parse
is a CorruptRecord, never another exception. A corrupt pax header loses the member it
describes (its size was sound, so the next header is found); a corrupt 512-byte header loses
the rest of the shard (nothing says where the next one starts).

:func:`samples` is what the source and ``feedline info`` both read, so that a manifest's
count and the reader agree on what a sample is: one place per run of members with one key,
or per corrupt record that stands where one was.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Container, Iterator

from feedline.errors import DataError
from feedline.producer.shards.records import CorruptRecord, Readable

BLOCK = 512
_ZERO = bytes(BLOCK)
_REGULAR = (b"0", b"\0", b"7")
_META_LIMIT = 1 << 20  # a long name or pax header larger than this is not one
_DIGITS = frozenset(b"0123456789")
MAX_UNREAD_NAMES = 64  # the extensions not asked for a sample remembers (for messages)


def _name(raw: bytes) -> str:
    # backslashreplace: a name that is not UTF-8 still groups and is printable in a log
    return raw.decode("utf-8", "backslashreplace")


def _octal(field: bytes, shard: str, at: int) -> int:
    """A header number: NUL/space-terminated octal digits, or GNU base-256 (0x80 first)."""
    if field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB; 0xff (negative) is no size
        if field[0] != 0x80:
            raise CorruptRecord(f"{shard}#{at}", "a negative number in a tar header", False)
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if text.isdigit():  # ASCII digits only: no sign, underscore or space, which int() takes
        try:
            return int(text, 8)
        except ValueError:  # an 8 or a 9
            pass
    raise CorruptRecord(f"{shard}#{at}", f"bad number {text!r} in a tar header", False)


def _pax(data: bytes) -> dict[bytes, bytes]:
    """The records of a pax header, ``LENGTH KEY=VALUE\\n`` each (LENGTH counts the whole
    record); DataError naming what is wrong."""
    out: dict[bytes, bytes] = {}
    i, n = 0, len(data)
    while i < n and data[i] != 0:  # NUL padding ends it, as tarfile reads it
        sp = data.find(b" ", i, i + 21)
        length = data[i:sp] if sp > i else b""
        if not length or not _DIGITS.issuperset(length):
            raise DataError(f"a pax record whose length is not a number "
                             f"({data[i:i + 12]!r})")
        end = i + int(length)
        if end <= sp + 1 or end > n or data[end - 1] != 0x0A:
            raise DataError(f"a pax record of {int(length)} bytes that does not fit")
        key, eq, value = data[sp + 1:end - 1].partition(b"=")
        if not eq or not key:
            raise DataError(f"a pax record without KEY=VALUE ({key[:20]!r})")
        out[key] = value
        i = end
    return out


class _Headers:
    """The regular members of a tar, header by header: :meth:`next` reads headers up to
    the next regular member's and returns ``(name, size)``; then exactly one of
    :meth:`data` / :meth:`skip_data` must be called before the next :meth:`next`. Raises
    CorruptRecord for what loses the rest of the tar; a member that is lost alone (a corrupt
    pax header) is returned with :attr:`bad` saying why."""

    def __init__(self, stream: Readable, shard: str) -> None:
        self.stream, self.shard = stream, shard
        self._size = self._pad = 0
        self._name = ""
        # Why the member :meth:`next` returned cannot be trusted though the tar goes on
        # after it (its pax header is corrupt), or None.
        self.bad: str | None = None

    def next(self) -> tuple[str, int] | None:
        read, skip, shard = self.stream.read, self.stream.skip, self.shard
        long_name: str | None = None
        pax_size: int | None = None
        bad_pax: tuple[int, str] | None = None
        while True:
            at = self.stream.offset
            hdr = read(BLOCK)
            if not hdr or hdr == _ZERO:
                return None  # the end blocks, or an archive that ends without them
            if len(hdr) < BLOCK:
                raise CorruptRecord(f"{shard}#{at}", "the shard ends inside a tar header",
                                    False)
            # The checksum counts its own field as spaces (8 * 32).
            if _octal(hdr[148:156], shard, at) != sum(hdr) - sum(hdr[148:156]) + 256:
                raise CorruptRecord(f"{shard}#{at}", "bad tar header checksum", False)
            size = _octal(hdr[124:136], shard, at)
            typ = hdr[156:157]
            pad = -size % BLOCK
            if typ in (b"L", b"x"):
                if size > _META_LIMIT:
                    raise CorruptRecord(f"{shard}#{at}", f"a {size}-byte tar name header",
                                        False)
                data = read(size)
                if len(data) < size or skip(pad) < pad:
                    raise CorruptRecord(f"{shard}#{at}", "the shard ends inside a tar header",
                                        False)
                if typ == b"L":
                    long_name = _name(data.rstrip(b"\0"))
                    continue
                try:
                    pax = _pax(data)
                    if b"size" in pax:
                        if not pax[b"size"] or not _DIGITS.issuperset(pax[b"size"]):
                            raise DataError(f"a pax size that is not a number "
                                             f"({pax[b'size'][:20]!r})")
                        pax_size = int(pax[b"size"])
                    if b"path" in pax:
                        long_name = _name(pax[b"path"])
                except ValueError as e:  # DataError, or int() of a 5000-digit size
                    bad_pax = (at, str(e))
                continue
            if pax_size is not None:
                size, pad = pax_size, -pax_size % BLOCK
            if typ not in _REGULAR:
                if skip(size + pad) < size + pad:
                    raise CorruptRecord(f"{shard}#{at}", "the shard ends inside a tar entry",
                                        False)
                long_name, pax_size, bad_pax = None, None, None
                continue
            name = long_name
            if name is None:
                name = _name(hdr[:100].split(b"\0", 1)[0])
                if hdr[257:262] == b"ustar" and hdr[345] != 0:
                    prefix = _name(hdr[345:500].split(b"\0", 1)[0])
                    name = f"{prefix}/{name}"
            self._name, self._size, self._pad = name, size, pad
            self.bad = None if bad_pax is None else (
                f"{name}: its pax header (offset {bad_pax[0]}) is corrupt: {bad_pax[1]}")
            return name, size

    def data(self) -> bytes:
        size = self._size
        data = self.stream.read(size)
        if len(data) < size:
            raise CorruptRecord(f"{self.shard}#{self._name}", f"the shard ends inside this "
                                f"member ({len(data)} of {size} bytes)", False)
        if self._pad and self.stream.skip(self._pad) < self._pad:
            raise CorruptRecord(f"{self.shard}#{self._name}", "the shard ends inside this "
                                "member's padding", False)
        return data

    def skip_data(self) -> None:
        n = self._size + self._pad
        got = self.stream.skip(n)
        if got < n:
            raise CorruptRecord(f"{self.shard}#{self._name}", f"the shard ends inside this "
                                f"member ({got} of {n} bytes)", False)


def members(stream: Readable, shard: str, max_member: int = 1 << 30,
            ) -> Iterator[tuple[str, bytes]]:
    """``(name, data)`` for each regular file of the tar on ``stream``, in order. A member
    over ``max_member`` bytes is a resumable CorruptRecord (its header says where the next
    one starts, so the reader goes on after it when called again)."""
    tar = _Headers(stream, shard)
    while True:
        got = tar.next()
        if got is None:
            return
        name, size = got
        if tar.bad is not None:
            tar.skip_data()
            raise CorruptRecord(f"{shard}#{name}", tar.bad, True)
        if size > max_member:
            tar.skip_data()
            raise CorruptRecord(f"{shard}#{name}", f"a {size}-byte member (more than "
                                f"max_sample_bytes)", True)
        yield name, tar.data()


Sample = tuple[str, dict[str, bytes | None]]


def samples(stream: Readable, shard: str, max_sample: int = 1 << 30,
            wanted: Container[str] | None = None) -> Iterator[Sample | CorruptRecord]:
    """:func:`samples_at`'s items without their offsets."""
    for _, item in samples_at(stream, shard, max_sample, wanted):
        yield item


def samples_at(stream: Readable, shard: str, max_sample: int = 1 << 30,
               wanted: Container[str] | None = None,
               ) -> Iterator[tuple[int, Sample | CorruptRecord]]:
    """Each item with the byte of the stream where it starts: a sample's first member's
    header, a corrupt place's header (where a reader that starts at that item seeks to).

    The samples of the tar on ``stream``, in order: ``(key, {ext: data})`` for each run
    of consecutive members with one key, or a CorruptRecord in the place of one.

    Memory: a sample holds only the members whose extension is in ``wanted`` (None: every
    one); the others are skipped unread and stand in the dict as ``None`` (at most
    :data:`MAX_UNREAD_NAMES`, for messages). If the members it holds would pass
    ``max_sample`` bytes, the sample is a resumable CorruptRecord (``shard#key``) and the
    rest of its members are skipped, so a sample never holds more than ``max_sample``.

    A member whose pax header is corrupt makes its sample a resumable CorruptRecord (its
    size was sound: the tar goes on). A corrupt header or a member cut short is a place of
    its own after the sample read so far (which stands if it has its fields), and ends the
    shard.
    """
    tar = _Headers(stream, shard)
    key: str | None = None
    fields: dict[str, bytes | None] = {}
    held = unread = 0
    over = 0  # the bytes the sample's wanted members claim, once past max_sample
    broken: str | None = None  # why a member of the sample was lost (the tar goes on)
    key_at = at = stream.offset  # where the sample being gathered / the next header starts

    def finish() -> Sample | CorruptRecord:
        assert key is not None
        if broken is not None:
            return CorruptRecord(f"{shard}#{key}", broken, True)
        if over:
            return CorruptRecord(f"{shard}#{key}", f"a sample of more than max_sample_bytes "
                                 f"({over} > {max_sample} bytes in its fields)", True)
        return key, fields

    while True:
        at = stream.offset
        try:
            got = tar.next()
            if got is None:
                break
            name, size = got
            k, ext = split_key(name)
            if k != key:
                if key is not None:
                    yield key_at, finish()
                key_at = at
                key, fields, held, unread, over, broken = k, {}, 0, 0, 0, None
            if tar.bad is not None or broken is not None:
                broken = broken or tar.bad  # one member lost: the sample is, in its place
                fields, held = {}, 0
                tar.skip_data()
            elif wanted is not None and ext not in wanted:
                tar.skip_data()
                if ext not in fields and unread < MAX_UNREAD_NAMES:
                    fields[ext], unread = None, unread + 1
            elif over:
                over += size
                tar.skip_data()
            else:
                have = held
                if ext in fields:  # the same extension again: it replaces the first
                    have -= len(fields[ext] or b"")
                if have + size > max_sample:
                    tar.skip_data()  # first: a member cut short ends the shard as in info
                    over = have + size
                    fields, held = {}, 0  # drop what it held: the sample is corrupt
                else:
                    fields[ext] = tar.data()
                    held = have + size
        except CorruptRecord as e:
            if key is not None and (fields or over or broken):  # members of it were read
                yield key_at, finish()
            key, fields, held, unread, over, broken = None, {}, 0, 0, 0, None
            yield at, e
            if not e.resumable:
                return
    if key is not None:
        yield key_at, finish()


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
