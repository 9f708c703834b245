"""Parquet: rows of Parquet files, row group by row group, selected columns (pyarrow)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from feedline.errors import ConfigError, Unavailable
from feedline.producer.dataflow.base import Named
from feedline.producer.dataflow.shard_fields import column_value
from feedline.producer.dataflow.sharded import ShardedSource
from feedline.producer.shards.retry import ShardError, is_transient


def _pq() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise Unavailable("parquet needs pyarrow: pip install 'feedline[parquet]'") from None
    return pq


class Parquet(ShardedSource):
    """Yield one datapoint per row: the ``fields`` (columns) in order; binary cells become
    uint8 arrays. Reads one row group of the selected columns at a time, so memory holds one
    row group's columns (choose row groups of a few MB, as ``pyarrow``'s writer does by
    default for image columns), plus the file's footer. A row group that fails is retried
    with the file opened again; the sample count comes from the footers, so exact delivery
    needs no manifest. Needs the ``parquet`` extra (pyarrow)."""

    format = "parquet"

    def __init__(self, urls: str | Sequence[str] | None = None, *,
                 fields: Sequence[str] = ("image", "label"), **kw: Any) -> None:
        _pq()
        super().__init__(urls, fields=fields, **kw)
        if not self.fields:
            raise ConfigError("fields: at least one column")

    def _open(self, url: str) -> Any:
        f = self.location(url).fs().open(url, "rb", block_size=self.chunk_size,
                                         cache_type="readahead")
        return _pq().ParquetFile(f), f

    def _count(self, url: str) -> int | None:
        pf, f = self._retrying(url, lambda: self._open(url))
        try:
            return int(pf.metadata.num_rows)
        finally:
            f.close()

    def _retrying(self, url: str, fn: Any) -> Any:
        failures = 0
        while True:
            try:
                return fn()
            except Exception as e:  # judged: transient ones are retried, the rest raised
                failures += 1
                if not is_transient(e) or failures >= self.retry.attempts:
                    raise ShardError(url, f"{type(e).__name__}: {e}") from None
                self.stats.add(retries=1)
                self.retry.wait(failures, None)

    def _check_columns(self, url: str, pf: Any) -> None:
        """ShardError naming a field the file has no column for (read_row_group would
        leave it out without a word)."""
        try:
            names = list(pf.schema_arrow.names)
        except Exception as e:  # a schema the footer cannot give
            raise ShardError(url, f"no schema: {type(e).__name__}: {e}") from None
        missing = [c for c in self.fields if c not in names]
        if missing:
            raise ShardError(url, f"no column {missing[0]!r} (it has {names[:8]})")

    def _read(self, url: str) -> Iterator[Any]:
        state: dict[str, Any] = {}

        def group(i: int) -> Any:
            if "pf" not in state:
                state["pf"], state["f"] = self._open(url)
            try:
                return state["pf"].read_row_group(i, columns=self.fields)
            except Exception:
                state.pop("pf", None)
                state.pop("f").close()
                raise

        try:
            pf, state["f"] = self._retrying(url, lambda: self._open(url))
            state["pf"] = pf
            self._check_columns(url, pf)
            for i in range(pf.num_row_groups):
                table = self._retrying(url, lambda i=i: group(i))
                self.stats.add(bytes_read=int(table.nbytes))
                try:
                    cols = [table.column(c).to_pylist() for c in self.fields]
                except Exception as e:  # pyarrow's, on a row group its footer misdescribes
                    raise ShardError(url, f"row group {i}: {type(e).__name__}: {e}") from None
                for r in range(table.num_rows):
                    where = f"{url}#{i}:{r}"
                    yield Named([column_value(col[r], where) for col in cols], where)
        finally:
            if "f" in state:
                state["f"].close()
