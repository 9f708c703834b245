"""The DataFlow library: sources, transforms and parallel stages, one module each.

Names follow tensorpack's, so its users recognise them. Every stage is a plain iterable
with an optional ``__len__``, ``reset_state()`` and ``close()`` (see
:mod:`feedline.producer.dataflow.base`: also :func:`as_dataflow` for a plain iterable,
:func:`stages`
to walk a pipeline, and the Protocols of what some stages offer).
"""

from feedline.producer.dataflow.base import (
    Counted,
    DataFlow,
    DataFromIterable,
    Indexable,
    ProxyDataFlow,
    Reseedable,
    Shardable,
    as_dataflow,
    stages,
)
from feedline.producer.dataflow.batch_data import BatchData
from feedline.producer.dataflow.count_data import CountData
from feedline.producer.dataflow.data_from_generator import DataFromGenerator
from feedline.producer.dataflow.data_from_list import DataFromList
from feedline.producer.dataflow.errors import SampleError, WorkerError
from feedline.producer.dataflow.fake import FakeData
from feedline.producer.dataflow.filter_data import FilterData
from feedline.producer.dataflow.image_folder import ImageFolder
from feedline.producer.dataflow.lmdb_serializer import LMDBData, LMDBSerializer
from feedline.producer.dataflow.locally_shuffle_data import LocallyShuffleData
from feedline.producer.dataflow.map_data import MapData, MapDataComponent
from feedline.producer.dataflow.multi_process_map_data import MultiProcessMapData
from feedline.producer.dataflow.multi_process_runner import MultiProcessRunner
from feedline.producer.dataflow.multi_thread_map_data import MultiThreadMapData
from feedline.producer.dataflow.parquet import Parquet
from feedline.producer.dataflow.repeated_data import RepeatedData
from feedline.producer.dataflow.test_data_speed import TestDataSpeed
from feedline.producer.dataflow.tfrecord import TFRecord
from feedline.producer.dataflow.webdataset import WebDataset
from feedline.producer.dataflow.worker import WorkerInfo, get_worker, make_rng

# tensorpack's name for the same stage (docs/tensorpack.md): forked whole copies of `ds`,
# their datapoints gathered over ZeroMQ. `MultiProcessRunnerZMQ(ds, num_proc)` runs as it is;
# tensorpack's `hwm=` is `queue_size=` here.
MultiProcessRunnerZMQ = MultiProcessRunner

__all__ = [
    "BatchData",
    "CountData",
    "Counted",
    "DataFlow",
    "DataFromGenerator",
    "DataFromIterable",
    "DataFromList",
    "FakeData",
    "FilterData",
    "ImageFolder",
    "Indexable",
    "LMDBData",
    "LMDBSerializer",
    "LocallyShuffleData",
    "MapData",
    "MapDataComponent",
    "MultiProcessMapData",
    "MultiProcessRunner",
    "MultiProcessRunnerZMQ",
    "MultiThreadMapData",
    "Parquet",
    "ProxyDataFlow",
    "RepeatedData",
    "Reseedable",
    "SampleError",
    "Shardable",
    "TFRecord",
    "TestDataSpeed",
    "WorkerError",
    "WebDataset",
    "WorkerInfo",
    "as_dataflow",
    "get_worker",
    "make_rng",
    "stages",
]
