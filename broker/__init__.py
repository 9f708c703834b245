"""The feedline broker: fan-in from producers, credit-based fan-out to training processes."""

from broker.config import BrokerConfig
from broker.core import Broker

__all__ = ["Broker", "BrokerConfig"]
