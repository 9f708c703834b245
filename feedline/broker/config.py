"""The broker's configuration: one frozen dataclass, read from flags only at the entry point."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from feedline.errors import ConfigError
from feedline.exact import MAX_STREAMS, ExactConfig
from feedline.liveness import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
from feedline.protocol import wire
from feedline.protocol.bundle import JOIN_FORWARDED, MAX_BUNDLE
from feedline.protocol.messages import DEFAULT_STREAM
from feedline.security import ServerKeys
from feedline.serving.budget import Budget
from feedline.serving.server import (
    CREDIT_LEASE,
    LINGER_MS,
    MAX_PEERS,
    PRODUCER_WINDOW,
    ServingConfig,
)


@dataclass(frozen=True)
class BrokerConfig:
    """Everything the broker needs to run. Defaults suit one training host."""

    ingress: str = "tcp://0.0.0.0:7878"
    egress: str = "ipc:///tmp/feedline.sock"
    tensorpack_ingress: str | None = None
    tensorpack_stream: str = DEFAULT_STREAM
    max_batches: int = 32  # buffered + in flight to consumers + granted to producers
    max_bytes: int = 1 << 30  # the same, in bytes: the broker's memory budget
    producer_window: int = PRODUCER_WINDOW  # most credit one producer holds at once
    credit_lease: float = CREDIT_LEASE  # credit unused this long is asked back when others wait
    max_peers: int = MAX_PEERS  # registered producers (and, separately, consumers), at most
    heartbeat_interval: float = HEARTBEAT_INTERVAL
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT  # a peer silent this long is dropped
    linger_ms: int = LINGER_MS
    io_threads: int = 1  # libzmq I/O threads: the socket copies happen there
    limits: wire.Limits = field(default_factory=wire.Limits)
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    curve: ServerKeys | None = None  # None: plain TCP
    state_dir: str | None = None  # exact streams' journals (their progress survives restarts)
    sizing_window: float = 10.0  # seconds the producers-wanted estimate averages over
    exact_ephemeral: bool = False  # without state_dir: serve exact streams from memory only
    max_streams: int = MAX_STREAMS  # streams with state (peers naming them, exact coordinators)
    insecure: bool = False  # listen on exposed addresses without CURVE keys (--insecure)
    # Exact streams served by several training hosts: the job's coordinator (`feedline
    # coordinator`) and this host's name in the job (default: hostname and ingress port).
    coordinator: str | None = None
    host_name: str | None = None

    def __post_init__(self) -> None:
        if self.max_batches < 1:
            raise ConfigError("max_batches must be >= 1")
        if self.producer_window < 1:
            raise ConfigError("producer_window must be >= 1")
        if self.max_bytes < 1:
            raise ConfigError("max_bytes must be >= 1")
        if self.max_peers < 1:
            raise ConfigError("max_peers must be >= 1")
        if self.sizing_window <= 0:
            raise ConfigError("sizing_window must be > 0")
        if self.max_streams < 1:
            raise ConfigError("max_streams must be >= 1")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError("heartbeat_timeout must be longer than heartbeat_interval")

    def job_host(self) -> str:
        """This host's name in a job served by several hosts: ``host_name``, or the machine's
        name and the ingress port (stable across restarts, unique per broker)."""
        if self.host_name:
            return self.host_name
        return f"{socket.gethostname()}:{self.ingress.rsplit(':', 1)[-1]}"

    @property
    def budget(self) -> Budget:
        """``max_batches`` and ``max_bytes``, with the shares taken of them."""
        return Budget(self.max_batches, self.max_bytes)

    def serving(self) -> ServingConfig:
        """The serving core's configuration of this broker (the one place it is derived):
        its producers' terms, liveness, limits, keys and tensorpack ingress as given; exact
        streams journalled in ``state_dir``, a restarted broker waiting one heartbeat
        timeout for its consumers' reports; windows counting small batches by their bytes;
        a bundle kept whole, as it is forwarded (``whole``, ``JOIN_FORWARDED``)."""
        return ServingConfig(
            self.ingress, self.budget, producer_window=self.producer_window,
            credit_lease=self.credit_lease, max_peers=self.max_peers,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout, linger_ms=self.linger_ms,
            limits=self.limits, curve=self.curve, tensorpack=self.tensorpack_ingress,
            tensorpack_stream=self.tensorpack_stream,
            exact=ExactConfig(Path(self.state_dir) if self.state_dir else None,
                              self.exact_ephemeral, self.max_streams,
                              grace=self.heartbeat_timeout, idle=4 * self.heartbeat_timeout,
                              coordinator=self.coordinator, host=self.job_host()),
            insecure=self.insecure, by_bytes=True, bundle=MAX_BUNDLE, whole=True,
            join=JOIN_FORWARDED)
