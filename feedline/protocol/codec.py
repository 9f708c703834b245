"""What every feedline decoder shares: the limits, the two errors, safe msgpack, dtypes.

Nothing received from the network is ever unpickled: :func:`unpackb` is msgpack's own
unpacker, bound here so that ``msgpack_numpy.patch()`` (which tensorpack calls at import, and
which makes msgpack unpickle object arrays) cannot change it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

# Defined with the rest of the hierarchy; imported from here by the protocol's modules.
from feedline.errors import DecodeError as DecodeError
from feedline.errors import EncodeError as EncodeError

PROTOCOL_VERSION = 2


class Kind(enum.IntEnum):
    """Message kinds. Values are part of the protocol: never renumber. The control messages'
    classes, fields and directions are in :mod:`feedline.protocol.messages`."""

    PRODUCER_HELLO = 1
    BATCH = 2
    GRANT = 3
    HEARTBEAT = 4
    EOS = 5
    ERROR = 6
    RESET = 7
    DELIVER = 8
    BYE = 9
    CONSUMER_HELLO = 10
    TAKEN = 11
    WELCOME = 12
    REFUSED = 13
    WANT = 14
    REVOKE = 15
    RETURNED = 16
    UNIT_REQUEST = 17
    UNIT = 18
    UNIT_WAIT = 19
    UNIT_DONE = 20
    EPOCH_END = 21
    BUNDLE = 22  # several batches of one layout in one message (feedline.protocol.bundle)


CONTAINER_LIST, CONTAINER_TUPLE, CONTAINER_DICT, CONTAINER_BARE = 0, 1, 2, 3


try:
    from msgpack._cmsgpack import Packer as _Packer
    from msgpack._cmsgpack import Unpacker as Unpacker  # re-exported: msgpack's own
    from msgpack._cmsgpack import unpackb as _unpackb
except ImportError:  # pure-Python msgpack build
    from msgpack.fallback import Packer as _Packer  # type: ignore[assignment]
    from msgpack.fallback import Unpacker as Unpacker  # type: ignore[assignment]
    from msgpack.fallback import unpackb as _unpackb  # type: ignore[assignment]


def packb(obj: Any, default: Any = None) -> bytes:
    """msgpack-encode with msgpack's own packer (immune to msgpack_numpy.patch)."""
    return _Packer(use_bin_type=True, default=default).pack(obj)


def unpackb(buf: Any, **kwargs: Any) -> Any:
    """msgpack-decode with msgpack's own unpacker (never msgpack_numpy's, which unpickles).

    For bytes from outside the process, pass the ``max_*_len`` limits too.
    """
    return _unpackb(buf, **kwargs)


# Containers inside each other in one datapoint (a batch: its list of components is level 0),
# at most: what every decoder refuses past and every encoder checks before it sends. The
# shard readers bound what they decode by it (a ``.json`` field nests at most this less the
# levels a batch puts above a field: feedline.producer.dataflow.shard_fields).
MAX_DEPTH = 16


@dataclass(frozen=True)
class Limits:
    """Bounds every decoder enforces on what it receives, and every encoder before it sends
    (a message the receiver would refuse is refused at the sender, with the limit named)."""

    max_header_bytes: int = 64 * 1024
    max_arrays: int = 1024
    max_ndim: int = 32
    max_message_bytes: int = 1 << 30  # total array bytes in one message (1 GiB)
    max_depth: int = MAX_DEPTH  # nesting of containers in a datapoint
    max_id_len: int = 256  # producer and consumer ids
    # Entries of one msgpack list or map. msgpack preallocates what a list *claims*: without
    # this, 3 bytes per level of nesting claim 64 K slots each (a 60 KB header took 80 MB).
    # Worst case now: 1024 levels (msgpack's own stack limit) x this x 8 bytes, transient.
    max_container_len: int = 2048
    max_window: int = 4096  # batches one consumer may hold undelivered to its model
    max_stream_len: int = 64  # stream names
    max_text_len: int = 4096  # error messages and details
    max_traceback_len: int = 16384

    @property
    def max_frames(self) -> int:
        """Frames in one message, at most: envelope + header + arrays."""
        return self.max_arrays + 2


DEFAULT_LIMITS = Limits()

# The dtypes on the wire: what TensorFlow and PyTorch take, each with one byte layout on every
# platform. Byte-order char, then kind and size. No long double (f16/c32: 80-bit on x86, 128 on
# aarch64), no structured, object, string, void or datetime dtypes.
_DTYPE_RE = re.compile(r"^[<>|=]?(?:b1|[iu](?:1|2|4|8)|f(?:2|4|8)|c(?:8|16))$")


def check_dtype(s: object) -> np.dtype:
    """Return the dtype for an allowed dtype string, else raise DecodeError."""
    if not isinstance(s, str) or not _DTYPE_RE.match(s):
        raise DecodeError("bad_dtype", repr(s)[:64])
    dt = np.dtype(s)
    if dt.kind not in "biufc" or dt.hasobject or dt.fields is not None or dt.subdtype:
        raise DecodeError("bad_dtype", s)
    return dt


def sendable_dtype(dt: np.dtype) -> bool:
    """True if arrays of ``dt`` may be sent (the decoder's allow-list, applied by encoders)."""
    return bool(_DTYPE_RE.match(dt.str)) and dt.fields is None and not dt.hasobject


def check_bools(arr: np.ndarray) -> None:
    """A bool array's bytes must be 0 or 1: TensorFlow and NumPy disagree about the others
    (``tf.logical_not`` of byte 2 is not ``not True``), so they are refused, not passed on."""
    if arr.size and arr.view(np.uint8).max() > 1:
        raise DecodeError("bad_bool", "bool bytes other than 0 and 1")
