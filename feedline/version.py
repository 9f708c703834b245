"""The version, in one place (``feedline.__version__`` re-exports it), and the code version a
batch's lineage names (:func:`code_version`)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__version__ = "0.1.0"

# The sources whose bytes make a batch: Python, and the C of the image extensions.
_SOURCES = ("*.py", "*.c", "*.h")


@functools.cache
def code_version() -> str:
    """``VERSION+HASH``: the release and 12 hex digits of a hash of the package's sources
    (every ``.py``, ``.c`` and ``.h`` file under ``feedline/``, by path and bytes), made once
    per process (about 10 ms). Two producers with the same one run the same code, whatever
    the release number says; an edited checkout has another. At most 64 characters (what
    the wire takes)."""
    root = Path(__file__).resolve().parent
    h = hashlib.blake2b(digest_size=6)
    files = sorted({p for pattern in _SOURCES for p in root.rglob(pattern)})
    for p in files:
        try:
            data = p.read_bytes()
        except OSError:  # unreadable: its name still counts
            data = b""
        name = p.relative_to(root).as_posix().encode()
        h.update(len(name).to_bytes(8, "big") + name + len(data).to_bytes(8, "big") + data)
    return f"{__version__}+{h.hexdigest()}"[:64]
