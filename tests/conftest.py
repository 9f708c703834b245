"""Shared fixtures: real brokers (in a thread or as a process), real producers, leak checks.

Everything binds 127.0.0.1 with ephemeral ports or ipc:// paths under tmp_path. No sleeps to
wait for connections: poll with a timeout (feedline.procs.wait_for).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from feedline.broker import Broker, BrokerConfig
from feedline.procs import Daemon, free_port, stop_all, wait_for
from tests.support import ROOT, tcp_ready  # noqa: F401  (fixtures' modules import them here)


def pytest_configure(config: pytest.Config) -> None:
    """Every process the suite starts (the xdist workers, and through them the daemons,
    producers and ledger consumers) gets one OpenBLAS thread unless the environment says
    otherwise. NumPy's OpenBLAS starts a thread per core at import, and each spins waiting for
    work while the process goes on importing: on two cores a producer's start takes 0.31
    CPU-s with two threads and 0.20 with one (benchmarks/startup.py, docs/performance.md
    'Start-up'), and the suite starts hundreds. Nothing the suite runs does linear algebra that
    more threads would speed up; feedline's daemons leave the setting to the user."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile feedline and tests/ once, before any worker starts. The suite starts
    hundreds of Python processes (daemons, ledger consumers) that import them; where
    ``PYTHONDONTWRITEBYTECODE`` is set (as on the machines this project's CI runs on) each
    of them compiled every module from source again: 0.28 CPU-s a producer-and-broker import
    (1.35 against 1.07). An installed wheel has its bytecode from the install."""
    if hasattr(session.config, "workerinput"):
        return
    import compileall

    for tree in ("feedline", "tests"):
        compileall.compile_dir(ROOT / tree, quiet=1)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``, see pyproject.toml) a module's tests stay on
    one worker, so its module fixtures (a compose stack, a Prometheus server) start once;
    modules that name a group (the fault scenarios) share a worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _no_leaked_processes() -> Iterator[None]:
    """Fail a test that leaves a child process running."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    def leftovers() -> list:
        return [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    try:
        wait_for(lambda: not leftovers(), 10, what="child processes to exit")
    except TimeoutError:
        left = leftovers()
        for p in left:
            p.kill()
        pytest.fail(f"test leaked processes: {[p.cmdline() for p in left]}")


@dataclass
class Endpoints:
    ingress: str
    egress: str
    port: int


@pytest.fixture
def endpoints(tmp_path: Path) -> Endpoints:
    port = free_port()
    return Endpoints(f"tcp://127.0.0.1:{port}", f"ipc://{tmp_path}/egress.sock", port)


class ThreadBroker:
    """A Broker running in a thread of the test process (fast to start; same code path)."""

    def __init__(self, config: BrokerConfig) -> None:
        self.stop = threading.Event()
        self.broker = Broker(config)
        self.thread = threading.Thread(target=self.broker.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "broker thread did not stop"


@pytest.fixture
def thread_broker(endpoints: Endpoints) -> Iterator:
    """Factory: start a broker thread with BrokerConfig overrides; closed at teardown."""
    started: list[ThreadBroker] = []

    def start(**overrides) -> ThreadBroker:
        cfg = BrokerConfig(ingress=endpoints.ingress, egress=endpoints.egress,
                           heartbeat_interval=0.2, heartbeat_timeout=1.5, **overrides)
        b = ThreadBroker(cfg)
        started.append(b)
        return b

    yield start
    for b in started:
        b.close()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator:
    """Factory: start ``python -m MODULE ARGS`` with a log in tmp_path; stopped at teardown."""
    procs: list[Daemon] = []

    def start(module: str, *args: str, name: str | None = None) -> Daemon:
        log = tmp_path / f"{name or module}-{len(procs)}.log"
        # The repo root on the path: configs may name factories in tests/
        # (tests.support.ledger_data).
        d = Daemon(module, [str(a) for a in args], log, env={"PYTHONPATH": str(ROOT)})
        procs.append(d)
        return d

    yield start
    stop_all(procs[::-1], timeout=10)


@pytest.fixture
def broker_proc(daemons, endpoints: Endpoints):
    """Factory: a broker process on ``endpoints`` (fast heartbeats), ready when returned."""

    def start(*extra: str) -> Daemon:
        d = daemons("feedline.broker", "--ingress", endpoints.ingress, "--egress", endpoints.egress,
                    "--metrics-port", "0", "--heartbeat-interval", "0.2",
                    "--heartbeat-timeout", "1.5", *extra, name="broker")
        wait_for(lambda: tcp_ready(endpoints.port) or not d.alive(), 20, what="broker port")
        assert d.alive(), d.log_text()
        return d

    return start


class HostFactory:
    """Starts hosts of one kind (``broker`` or ``direct``): see tests/support/hosts.py."""

    def __init__(self, kind: str, daemons, tmp_path: Path, endpoints: Endpoints) -> None:
        self.kind, self._daemons, self._tmp, self._endpoints = kind, daemons, tmp_path, endpoints
        self.started: list = []

    def __call__(self, *extra: str, **kw):
        from tests.support.hosts import start_host

        h = start_host(self.kind, self._daemons, self._tmp, self._endpoints, *extra, **kw)
        self.started.append(h)
        return h

    def broker_only(self, why: str) -> None:
        """Skip the direct-mode run of a test about what only a broker has."""
        if self.kind != "broker":
            pytest.skip(f"broker only: {why}")


@pytest.fixture(params=["broker", "direct"])
def host(request, daemons, tmp_path: Path, endpoints: Endpoints) -> Iterator[HostFactory]:
    """Factory: a host of the serving core, run once as a broker process and once as a
    direct-mode trainer process (``host(*broker_flags, reading=True)``); closed at teardown."""
    f = HostFactory(request.param, daemons, tmp_path, endpoints)
    yield f
    for h in f.started:
        h.close()
