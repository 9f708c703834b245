"""The feedline broker: fan-in from producers, credit-based fan-out to training processes."""

from feedline.broker.config import BrokerConfig
from feedline.broker.core import Broker

__all__ = ["Broker", "BrokerConfig"]
