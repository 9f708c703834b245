"""Sharded datasets where they live: locations (fsspec), bounded streaming reads with
retries, and the record formats (WebDataset tar, TFRecord, Parquet), one module each.

The DataFlow sources built on these are in :mod:`feedline.producer.dataflow.sharded` and its
per-format modules; ``feedline convert`` and ``feedline info`` write and list shards.
"""
