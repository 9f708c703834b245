"""The two hosts' serving configurations come from one set of defaults, each derived by one
constructor: a broker's by ``BrokerConfig.serving()``, a direct-mode trainer's by
``DirectConfig.serving(...)``.

What producers get from a host (the producers' window, the credit lease, the registrations
at most, liveness, limits) is written once, in ``feedline/serving/server.py`` (and
``feedline/liveness.py``, the stream limit in ``feedline.exact``): a broker with its flags'
defaults and a trainer with ``DirectConfig()`` serve on exactly those, and the hosts built
for real (a broker on 127.0.0.1, a trainer's direct-mode I/O role binding 127.0.0.1) run on
what their constructor derives. A literal copy of one of those defaults anywhere in the
package fails the last test here, with the file and line.
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import zmq
from prometheus_client import CollectorRegistry

from feedline.broker import Broker, BrokerConfig
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.consumer.direct import DirectConfig, DirectIO
from feedline.consumer.io import Shared
from feedline.exact import MAX_STREAMS
from feedline.liveness import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT
from feedline.procs import free_port
from feedline.protocol.bundle import JOIN_FORWARDED, MAX_BUNDLE
from feedline.protocol.codec import Limits
from feedline.protocol.messages import DEFAULT_STREAM
from feedline.security import ServerKeys
from feedline.serving.budget import Budget
from feedline.serving.metrics import BrokerMetrics
from feedline.serving.server import (
    BROKER,
    CREDIT_LEASE,
    DIRECT,
    LINGER_MS,
    MAX_PEERS,
    PRODUCER_WINDOW,
    ServingConfig,
)
from feedline.transport.link import LinkConfig
from tests.support.package_source import modules

# What a host serves its producers with, and the one constant each defaults to.
ONE_PLACE = {"producer_window": PRODUCER_WINDOW, "credit_lease": CREDIT_LEASE,
             "max_peers": MAX_PEERS, "heartbeat_interval": HEARTBEAT_INTERVAL,
             "heartbeat_timeout": HEARTBEAT_TIMEOUT, "limits": Limits(),
             "tensorpack_stream": DEFAULT_STREAM, "bundle": MAX_BUNDLE, "by_bytes": True}


def _direct(cfg: DirectConfig, addr: str = "tcp://127.0.0.1:1",
            link: LinkConfig | None = None, keys: ServerKeys | None = None) -> ServingConfig:
    return cfg.serving(addr, Budget(4, 1 << 30), DEFAULT_STREAM, link or LinkConfig(), keys)


def test_a_broker_and_a_direct_trainer_serve_producers_on_the_same_defaults() -> None:
    """Claim: built from their defaults, a broker's and a trainer's ServingConfig agree on
    every term they give producers, and each is the one constant (ServingConfig's own default
    too): change the constant and all three follow."""
    broker, direct = BrokerConfig().serving(), _direct(DirectConfig())
    own = {f.name: f.default for f in fields(ServingConfig)}
    for name, constant in ONE_PLACE.items():
        assert getattr(broker, name) == getattr(direct, name) == constant, name
        if name in own and name not in ("limits", "bundle", "by_bytes"):
            assert own[name] == constant, name
    assert broker.linger_ms == LINGER_MS and direct.linger_ms == 0  # a leaving trainer: none
    assert broker.exact.max_streams == MAX_STREAMS == BrokerConfig().max_streams
    assert (BrokerConfig().producer_window, BrokerConfig().credit_lease,
            BrokerConfig().max_peers) == (DirectConfig().producer_window,
                                          DirectConfig().credit_lease,
                                          DirectConfig().max_producers)


def test_each_host_s_serving_config_is_what_its_own_config_says(tmp_path: Path) -> None:
    """Claim: the constructors carry every setting over (a name differing between a host's
    config and ServingConfig included: ``tensorpack_ingress``, ``max_producers``), and each
    host's own choices are its constructor's (a broker keeps bundles whole and journals exact
    streams; a trainer serves its one stream with the consumer's link and budget)."""
    b = BrokerConfig(ingress="tcp://127.0.0.1:9", producer_window=7, credit_lease=3.5,
                     max_peers=9, heartbeat_interval=0.5, heartbeat_timeout=2.5, linger_ms=7,
                     limits=Limits(max_message_bytes=1 << 20), tensorpack_ingress="ipc://tp",
                     tensorpack_stream="tp", state_dir=str(tmp_path), max_streams=5,
                     insecure=True, max_batches=11, max_bytes=1 << 25).serving()
    assert (b.ingress, b.budget, b.producer_window, b.credit_lease, b.max_peers) == \
        ("tcp://127.0.0.1:9", Budget(11, 1 << 25), 7, 3.5, 9)
    assert (b.heartbeat_interval, b.heartbeat_timeout, b.linger_ms, b.limits) == \
        (0.5, 2.5, 7, Limits(max_message_bytes=1 << 20))
    assert (b.tensorpack, b.tensorpack_stream, b.insecure, b.how) == \
        ("ipc://tp", "tp", True, BROKER)
    assert (b.exact.state_dir, b.exact.max_streams, b.exact.grace, b.exact.idle) == \
        (tmp_path, 5, 2.5, 10.0)
    assert (b.stream, b.whole, b.join) == (None, True, JOIN_FORWARDED)

    link = LinkConfig(heartbeat_interval=0.5, heartbeat_timeout=2.5,
                      limits=Limits(max_message_bytes=1 << 20))
    d = DirectConfig(producer_window=7, credit_lease=3.5, max_producers=9,
                     tensorpack="ipc://tp").serving(
        "tcp://127.0.0.1:9", Budget(11, 1 << 25), "val", link, None, insecure=True)
    assert (d.ingress, d.budget, d.producer_window, d.credit_lease, d.max_peers) == \
        ("tcp://127.0.0.1:9", Budget(11, 1 << 25), 7, 3.5, 9)
    assert (d.heartbeat_interval, d.heartbeat_timeout, d.limits) == \
        (0.5, 2.5, Limits(max_message_bytes=1 << 20))
    assert (d.tensorpack, d.stream, d.insecure, d.how, d.whole) == \
        ("ipc://tp", "val", True, DIRECT, False)


def test_the_hosts_run_on_what_their_constructor_derives(tmp_path: Path) -> None:
    """Claim: a real broker, and a trainer's real direct-mode I/O role, each bound on
    127.0.0.1, serve with exactly the ServingConfig their constructor gives."""
    cfg = BrokerConfig(ingress=f"tcp://127.0.0.1:{free_port()}",
                       egress=f"ipc://{tmp_path}/egress", producer_window=3)
    broker = Broker(cfg)
    try:
        assert broker.server is not None and broker.server.cfg == cfg.serving()
    finally:
        broker.close()

    addr = f"tcp://127.0.0.1:{free_port()}"
    remote = RemoteDataZMQ(addr, bind=True, stream="val",
                           options=ConsumerOptions(window=6, direct=DirectConfig(credit_lease=1.5)))
    shared: Shared = remote._shared
    ctx = zmq.Context()
    io = DirectIO(ctx, addr, remote.link_config, None, shared, remote.direct,
                  BrokerMetrics(CollectorRegistry()))
    try:
        assert io.server.cfg == remote.direct.serving(
            addr, Budget(6, remote.config.max_bytes), "val", remote.link_config, None)
    finally:
        io.on_close()
        ctx.term()
        remote.close()


# Settings whose default is a constant of the one place above: as a dataclass field, a
# parameter, or a flag's default.
NAMES = {"producer_window", "credit_lease", "max_peers", "max_producers", "max_streams",
         "heartbeat_interval", "heartbeat_timeout"}
FLAGS = {"--" + n.replace("_", "-") for n in NAMES}


def _literal(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and \
        not isinstance(node.value, bool)


def test_no_default_of_the_one_place_is_copied_as_a_literal() -> None:
    """Claim: nowhere in the package does a producer window, credit lease, peer or stream
    limit or heartbeat default to a number written out (each names its constant, or the
    config it comes from), so changing the constant changes every host.

    Before: ``IngressConfig.heartbeat_timeout = 5.0`` and ``max_streams = 64`` in both
    ``BrokerConfig`` and ``ExactConfig``."""
    bad = []
    for mod in modules():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    node.target.id in NAMES and _literal(node.value):
                bad.append(f"{mod.rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = [*args.posonlyargs, *args.args]
                pairs = [*zip(positional[len(positional) - len(args.defaults):],
                              args.defaults, strict=True),
                         *zip(args.kwonlyargs, args.kw_defaults, strict=True)]
                bad += [f"{mod.rel}:{node.lineno}: {node.name}({a.arg}={ast.unparse(d)})"
                        for a, d in pairs if a.arg in NAMES and d is not None and _literal(d)]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == \
                    "add_argument" and node.args and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value in FLAGS:
                bad += [f"{mod.rel}:{node.lineno}: {ast.unparse(node)}"
                        for k in node.keywords if k.arg == "default" and _literal(k.value)]
    assert not bad, "defaults written out again (name the constant):\n" + "\n".join(bad)
