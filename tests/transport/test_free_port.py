"""free_port: ports for servers a test (or the demo) starts, clear of the kernel's client ports.

A port the kernel picked with bind(0) was one of its ephemeral ports, which it also gives to
every outgoing connection: in a suite making thousands of them, one could take the port
before the daemon meant to listen there bound it (the daemon then exits, "address in use").
"""

from __future__ import annotations

import socket

import pytest

from feedline import procs


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    lo, _ = procs._ephemeral_range()
    if lo - procs._LOWEST_PORT < 1000:
        pytest.skip(f"this host's ephemeral range starts at {lo}: no room below it")
    ports = [procs.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports), "each port handed out once"
    assert all(procs._LOWEST_PORT <= p < lo for p in ports), (lo, sorted(ports)[-5:])
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # A narrow range: 1000 ports, 100 of them held by listeners here.
    monkeypatch.setattr(procs, "_ephemeral_range", lambda: (procs._LOWEST_PORT + 1000, 60999))
    held: list[socket.socket] = []
    try:
        for port in range(procs._LOWEST_PORT, procs._LOWEST_PORT + 1000, 10):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()  # something of this host's own
                continue
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        got = [procs.free_port() for _ in range(50)]
        assert not taken & set(got), taken & set(got)
    finally:
        for s in held:
            s.close()


def test_without_room_below_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    lo, hi = procs._ephemeral_range()
    monkeypatch.setattr(procs, "_ephemeral_range", lambda: (procs._LOWEST_PORT + 10, hi))
    port = procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert lo <= port <= hi, "one of the kernel's own"
