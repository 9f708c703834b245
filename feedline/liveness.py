"""Liveness defaults, in one place: every peer heartbeats an idle link at this interval and
gives up on a peer silent for the timeout (the broker, producers, consumers, the CLI flags)."""

from __future__ import annotations

HEARTBEAT_INTERVAL = 1.0  # seconds between heartbeats on an otherwise idle link
HEARTBEAT_TIMEOUT = 5.0  # seconds of silence after which a peer is taken for dead
