"""Where shards live: names expanded from a list, a glob or braces, opened through fsspec.

``expand`` turns the ``urls`` of a pipeline file into the ordered list of shards:
``shards-{000000..000127}.tar`` (brace expansion, no listing), ``/data/train-*.tar`` or
``s3://bucket/train-*.tar`` (a glob: one listing of the store, sorted), or a list of either.
A glob matches no hidden name (one that starts with ``.``) unless its own last part does, as
in a shell: ``feedline convert`` writes a shard as ``.NAME.partial-PID`` before renaming it,
and fsspec's glob alone would read one an interrupted conversion left.
A :class:`Location` is the filesystem those names live on (local, ``http(s)://``, ``s3://``,
``gs://``, anything fsspec knows), made in the process that reads (after a fork, a fresh
one: an fsspec client holds sockets and an event loop).

The store clients are extras (``pip install 'feedline[http]'``, ``[s3]``, ``[gcs]``); a
missing one is a one-line error naming the extra.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from braceexpand import braceexpand

from feedline.errors import DataError, Unavailable

EXTRAS = {"http": "http", "https": "http", "s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
_GLOB = set("*?[")


class LocationError(DataError):
    """Shard names that cannot be expanded (a glob that matches nothing, a name given twice);
    the message says which."""


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def basename(url: str) -> str:
    return posixpath.basename(url.rstrip("/"))


def expand(spec: str | Sequence[str], storage_options: Mapping[str, Any] | None = None,
           ) -> list[str]:
    """The shard names ``spec`` stands for, in order (each glob's matches sorted; duplicates
    refused: a shard read twice per epoch is never what was meant)."""
    items = [spec] if isinstance(spec, str) else list(spec)
    if not items or not all(isinstance(s, str) and s for s in items):
        raise LocationError(f"expected a name, a glob, a brace pattern or a list of them, "
                            f"got {spec!r}")
    out: list[str] = []
    for item in items:
        for name in braceexpand(item):
            if _GLOB & set(name.split("://", 1)[-1]):
                loc = Location(protocol_of(name), dict(storage_options or {}))
                found = sorted(loc.fs().glob(name))
                if not basename(name).startswith("."):
                    found = [f for f in found if not basename(f).startswith(".")]
                if not found:
                    raise LocationError(f"{name}: matches no file")
                out += [loc.unstrip(f) for f in found]
            else:
                out.append(name)
    seen: set[str] = set()
    dup = [n for n in out if n in seen or seen.add(n)]  # type: ignore[func-returns-value]
    if dup:
        raise LocationError(f"{dup[0]}: named twice")
    return out


@dataclass
class Location:
    """One filesystem (a protocol and its options), made lazily in the reading process."""

    protocol: str
    options: dict[str, Any] = field(default_factory=dict)
    timeout: float = 30.0
    _fs: Any = field(default=None, repr=False)
    _pid: int = field(default=0, repr=False)
    # Hosts found to answer no byte ranges: their shards are opened as streams at once.
    no_ranges: set[str] = field(default_factory=set, repr=False)

    def fs(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            import fsspec  # here, not at the top: a producer of local files starts without it

            try:
                cls = fsspec.get_filesystem_class(self.protocol)
            except (ImportError, ValueError) as e:
                extra = EXTRAS.get(self.protocol)
                hint = f"pip install 'feedline[{extra}]'" if extra else "install its fsspec driver"
                raise Unavailable(f"{self.protocol}:// needs a package that is not "
                                  f"installed ({hint}): {e}") from None
            self._fs = cls(skip_instance_cache=True, **self._defaults(), **self.options)
            if self.protocol in ("s3", "s3a"):
                self._fs.retries = 1  # s3fs's own retry loop (a class attribute): ours count
            self._pid = os.getpid()
        return self._fs

    def _defaults(self) -> dict[str, Any]:
        """Timeouts on every request (a stalled link becomes a retried failure, not a hang),
        and the stores' own retries off, so that ours are the ones counted; the pipeline's
        ``storage_options`` override these."""
        t = self.timeout
        if self.protocol in ("http", "https") and "client_kwargs" not in self.options:
            import aiohttp

            return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=t, sock_read=t)}}
        if self.protocol in ("s3", "s3a") and "config_kwargs" not in self.options:
            return {"config_kwargs": {"connect_timeout": t, "read_timeout": t,
                                      "retries": {"max_attempts": 1, "mode": "standard"}}}
        return {}

    def unstrip(self, path: str) -> str:
        """A path as the filesystem lists it, as a name the user would write."""
        return path if self.protocol == "file" or "://" in path else \
            f"{self.protocol}://{path}"

    def close(self) -> None:
        self._fs = None
