"""The broker's Prometheus metrics, registered on a registry that is passed in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from feedline.metrics import BoundedLabel, OwnedCounter, OwnedCounters
from feedline.serving.sizing import VERDICTS

# Reasons a registration ends that lose nothing: the peer said goodbye, or registered again
# on its connection. feedline_broker_dropped_peers_total counts them beside the drops, by
# reason; what speaks of "dropped peers" leaves them out.
DEPARTED = ("bye", "registered_again")


class BrokerMetrics:
    def __init__(self, registry: CollectorRegistry, max_producer_labels: int = 64) -> None:
        r = registry
        self.producer_label = BoundedLabel(max_producer_labels, on_evict=self._forget_producer)
        # Counted for every batch by the loop thread alone: without prometheus_client's lock.
        self.received_batches = OwnedCounters(
            "feedline_broker_received_batches", "Batches received from producers.",
            ["producer"], r)
        self.received_bytes = OwnedCounters(
            "feedline_broker_received_bytes", "Array bytes received from producers.",
            ["producer"], r)
        self.forwarded_batches = OwnedCounter(
            "feedline_broker_forwarded_batches", "Batches handed to consumers.", r)
        self.forwarded_bytes = OwnedCounter(
            "feedline_broker_forwarded_bytes", "Array bytes handed to consumers.", r)
        self.split_bundles = OwnedCounter(
            "feedline_broker_split_bundles",
            "Bundles split into smaller parts for a consumer that takes fewer batches in one "
            "delivery (an older consumer, or a small window).", r)
        self.lost_batches = Counter(
            "feedline_broker_lost_batches",
            "Batches missing from producer sequences (lost between producer and broker).",
            ["producer"], registry=r)
        self.unconfirmed = Counter(
            "feedline_broker_unconfirmed_batches",
            "Batches in flight with a peer dropped without BYE (timeout, protocol breach): a "
            "producer's unused credit, a consumer's delivered but unacknowledged batches. An "
            "upper bound on what was lost with that peer.",
            ["role"], registry=r)
        for role in ("producer", "consumer"):
            self.unconfirmed.labels(role)
        self.rejected = Counter(
            "feedline_broker_rejected_messages", "Messages refused, by reason.",
            ["reason"], registry=r)
        self.refused = Counter(
            "feedline_broker_refused_batches",
            "Batches refused and answered with REFUSED (their credit returns), by producer "
            "and reason.", ["producer", "reason"], registry=r)
        self.duplicates = Counter(
            "feedline_broker_duplicate_batches",
            "Exact delivery: batches dropped because the broker had them already (a unit "
            "produced again after its producer was lost), by stream.", ["stream"], registry=r)
        self.cut_off = Counter(
            "feedline_broker_cut_off_connections",
            "Connections the broker closed on a peer that broke the rules, by role and reason.",
            ["role", "reason"], registry=r)
        self.curve_denied = Counter(
            "feedline_broker_curve_denied",
            "CURVE handshakes refused: the client's public key is not in --curve-allowed.",
            registry=r)
        self.dropped_peers = Counter(
            "feedline_broker_dropped_peers",
            "Registrations that ended, by role and reason. bye (the peer said goodbye) and "
            "registered_again (replaced by its own next registration) lose nothing: they are "
            "departures, not drops; every other reason is a drop (timeout: silent past the "
            "heartbeat timeout, no_credit, over_credit, revoke_unanswered, unreachable, ...).",
            ["role", "reason"], registry=r)
        self.buffer_batches = Gauge(
            "feedline_broker_buffer_batches",
            "Batches waiting in the broker (a bundle counts as the batches in it).", registry=r)
        self.buffer_bytes = Gauge(
            "feedline_broker_buffer_bytes",
            "Bytes of the batches waiting in the broker (headers included).", registry=r)
        self.inflight_bytes = Gauge(
            "feedline_broker_inflight_bytes",
            "Bytes delivered to consumers and not yet reported taken (counted against "
            "--max-bytes: they sit in the broker's socket queues or the network).", registry=r)
        self.inflight_batches = Gauge(
            "feedline_broker_inflight_batches",
            "Batches delivered to consumers and not yet reported taken (counted against "
            "--max-batches).", registry=r)
        self.reserved_bytes = Gauge(
            "feedline_broker_reserved_bytes",
            "Bytes of credit granted to producers and not yet used.", registry=r)
        self.buffer_capacity_batches = Gauge(
            "feedline_broker_buffer_capacity_batches",
            "What --max-batches bounds now: batches buffered, in flight to consumers and "
            "granted to producers, together, counted for the largest batches of the producers "
            "registered (batches under 8 MiB count by their bytes: up to 128 per batch of "
            "--max-batches). What was granted while only smaller batches were produced may "
            "exceed it until taken; no credit is granted meanwhile.",
            registry=r)
        self.buffer_capacity_bytes = Gauge(
            "feedline_broker_buffer_capacity_bytes", "Configured byte limit.", registry=r)
        self.credit_outstanding = Gauge(
            "feedline_broker_credit_outstanding_batches",
            "Credit granted to producers and not yet used.", registry=r)
        self.peers = Gauge(
            "feedline_broker_peers", "Connected peers, by role.", ["role"], registry=r)
        # Per stream (at most 64 named; beyond: "other"), set every tick by the loop.
        self.stream_label = BoundedLabel(64, on_evict=self._forget_stream)
        self.stream_batches = OwnedCounters(
            "feedline_broker_stream_forwarded_batches",
            "Batches handed to consumers, by stream.", ["stream"], r)
        self.stream_buffer = Gauge(
            "feedline_broker_stream_buffer_batches", "Batches waiting in the broker, by stream.",
            ["stream"], registry=r)
        self.stream_peers = Gauge(
            "feedline_broker_stream_peers", "Connected peers, by stream and role.",
            ["stream", "role"], registry=r)
        self.evicted = Counter(
            "feedline_broker_evicted_batches",
            "Batches of a stream nobody reads dropped so that another stream gets room "
            "(with several streams, an unread one keeps half its share), by stream.",
            ["stream"], registry=r)
        self.replaced = Counter(
            "feedline_broker_replaced_batches",
            "Batches left in the buffer by a producer that left, dropped because a pipeline "
            "with another fingerprint produces their stream now (its end and error messages "
            "too, not counted here), by stream.", ["stream"], registry=r)
        self.exact_epoch = Gauge(
            "feedline_broker_exact_epoch", "Exact streams: the epoch being served.",
            ["stream"], registry=r)
        self.exact_units = Gauge(
            "feedline_broker_exact_units",
            "Exact streams: work units of the epoch, done and in all.", ["stream", "state"],
            registry=r)
        self.exact_durable = Gauge(
            "feedline_broker_exact_durable",
            "Exact streams: 1 while the journal in --state-dir holds the stream's progress, 0 "
            "when writing it fails (disk full: the broker says why) or there is none.",
            ["stream"], registry=r)
        self.exact_streams = Gauge(
            "feedline_broker_exact_streams",
            "Exact streams whose state the broker holds (at most --max-streams; an unused "
            "one's state is reclaimed).", registry=r)
        self.consumer_credit = Gauge(
            "feedline_broker_consumer_credit_batches",
            "Batches consumers are ready to take now (demand not met by the buffer).",
            registry=r)
        # Sizing (feedline.serving.sizing): per stream, what the trainers need and how many
        # producers that takes; per supervisor (`feedline fleet`), its share.
        self.demand = Gauge(
            "feedline_broker_stream_demand_batches_per_second",
            "Batches/s the stream's consumers would take if they never waited for data "
            "(NaN until known).", ["stream"], registry=r)
        self.capacity = Gauge(
            "feedline_broker_stream_producer_capacity_batches_per_second",
            "Batches/s one producer of the stream delivers when credit does not hold it back "
            "(learnt; NaN until measured).", ["stream"], registry=r)
        self.supply = Gauge(
            "feedline_broker_stream_supply_batches_per_second",
            "Batches/s the connected producers can deliver: capacity x producers.",
            ["stream"], registry=r)
        self.consumer_wait = Gauge(
            "feedline_broker_stream_consumer_wait_ratio",
            "Share of time the stream's consumers waited for data over the sizing window.",
            ["stream"], registry=r)
        self.producers_wanted = Gauge(
            "feedline_broker_stream_producers_wanted",
            "Producers the stream needs (with hysteresis): what autoscalers follow.",
            ["stream"], registry=r)
        self.bottleneck = Gauge(
            "feedline_broker_stream_bottleneck",
            "1 for the stream's verdict: input-bound, balanced, model-bound or idle.",
            ["stream", "verdict"], registry=r)
        self.fleet_producers = Gauge(
            "feedline_broker_fleet_producers",
            "Producers connected that a supervisor (`feedline fleet --id`) started.",
            ["stream", "fleet"], registry=r)
        self.fleet_wanted = Gauge(
            "feedline_broker_fleet_producers_wanted",
            "A supervisor's share of the stream's producers wanted.", ["stream", "fleet"],
            registry=r)
        self.fleet_max = Gauge(
            "feedline_broker_fleet_producers_max",
            "A supervisor's --max (0: none), as its producers declared it.",
            ["stream", "fleet"], registry=r)
        self.fleet_label = BoundedLabel(64)

    def _forget_stream(self, label: str) -> None:
        for metric in (self.stream_batches, self.stream_buffer, self.evicted, self.replaced,
                       self.demand, self.capacity, self.supply, self.consumer_wait,
                       self.producers_wanted):
            try:
                metric.remove(label)
            except KeyError:
                pass
        for role in ("producer", "consumer"):
            try:
                self.stream_peers.remove(label, role)
            except KeyError:
                pass
        self.forget_exact(label)

    def forget_exact(self, label: str) -> None:
        """An exact stream's state was reclaimed: its exact series go."""
        for metric in (self.exact_epoch, self.exact_durable):
            try:
                metric.remove(label)
            except KeyError:
                pass
        for state in ("done", "total"):
            try:
                self.exact_units.remove(label, state)
            except KeyError:
                pass
        for verdict in VERDICTS:
            try:
                self.bottleneck.remove(label, verdict)
            except KeyError:
                pass

    def _per_producer(self) -> tuple[Counter | OwnedCounters, ...]:
        return (self.received_batches, self.received_bytes, self.lost_batches)

    def _forget_producer(self, label: str) -> None:
        """A departed producer's label was given to a new one: its series go."""
        for counter in self._per_producer():
            try:
                counter.remove(label)
            except KeyError:
                pass

    def init_producer(self, label: str) -> None:
        """Expose a new producer's series at 0, so that rates and "no losses" show at once
        (a labelled series otherwise appears only when first incremented)."""
        for counter in self._per_producer():
            counter.labels(label)
