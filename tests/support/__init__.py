"""What the tests share: the repository's root, helpers that start real processes and real
servers, data makers, and the hand-played protocol. Test modules import from here, never from
one another (tests/test_layering.py checks it)."""

from __future__ import annotations

import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tcp_ready(port: int) -> bool:
    """Something accepts TCP connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
