"""The DataFlow library: sources, transforms and parallel stages, one module each."""

from producer.dataflow.base import DataFlow, ProxyDataFlow
from producer.dataflow.fake import FakeData

__all__ = ["DataFlow", "FakeData", "ProxyDataFlow"]
