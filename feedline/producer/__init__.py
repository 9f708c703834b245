"""feedline producers: DataFlow pipelines and sending their batches to a broker."""

from feedline.producer.sender import Sender, SendStats, send_dataflow, send_dataflow_zmq

__all__ = ["SendStats", "Sender", "send_dataflow", "send_dataflow_zmq"]
