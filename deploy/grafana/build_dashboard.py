"""Writes deploy/grafana/dashboards/feedline.json, the provisioned Grafana dashboard.

The JSON is generated so that panels stay consistent (one datasource uid, one layout grid,
the verdict thresholds of ``feedline top``). Edit this file, run it, commit both:

    python3 deploy/grafana/build_dashboard.py

tests/ops/test_ops_deploy.py checks that the committed JSON is what this script writes, and runs
every panel's query against a live Prometheus.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# The thresholds of every verdict (feedline top, OccupancyMonitor): one definition.
from feedline.verdict import (
    INPUT_BOUND_BELOW,
    MODEL_BOUND_ABOVE,
    WAIT_SHARE_INPUT_BOUND,
    WINDOW_SECONDS,
)

DATASOURCE = {"type": "prometheus", "uid": "feedline-prometheus"}
OUT = Path(__file__).resolve().parent / "dashboards" / "feedline.json"

RI = "$__rate_interval"
# The dashboard's stream variable (a regex: All is ".*"), in a label matcher of the per-stream
# panels. A test evaluates a panel's query as Grafana sends it with every stream selected:
# $__rate_interval -> a duration, $stream -> ".*".
S = 'stream=~"$stream"'
STREAM_VARIABLE = {
    "name": "stream",
    "label": "stream",
    "type": "query",
    "datasource": DATASOURCE,
    "definition": "label_values(feedline_broker_stream_peers, stream)",
    "query": {"query": "label_values(feedline_broker_stream_peers, stream)",
              "refId": "PrometheusVariableQueryEditor-VariableQuery"},
    "refresh": 2,  # on time range change: streams come and go
    "sort": 1,
    "multi": True,
    "includeAll": True,
    "allValue": ".*",
    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    "options": [],
    "hide": 0,
}

# Occupancy forced to 0 ("input-bound") when the loop waits for data >= 10% of its time:
# the rule of commands.top verdict (feedline.verdict), in PromQL, over the same window as
# top's (the hysteresis of feedline.verdict.VerdictTracker has no PromQL form: the window's
# length is what keeps this panel steady).
W = f"[{WINDOW_SECONDS}s]"
VERDICT = (
    f"avg(avg_over_time(feedline_consumer_local_queue_batches{W})"
    f" / avg_over_time(feedline_consumer_window_batches{W}))"
    f" * (avg(rate(feedline_consumer_wait_seconds_sum{W})) < bool {WAIT_SHARE_INPUT_BOUND})"
)


def target(expr: str, legend: str = "", ref: str = "A") -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref,
            "range": True, "instant": False}


def panel(pid: int, kind: str, title: str, desc: str, grid: tuple[int, int, int, int],
          targets: list[tuple[str, str]], unit: str = "short", **field: Any) -> dict[str, Any]:
    x, y, w, h = grid
    defaults: dict[str, Any] = {"unit": unit, **field}
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": ({"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                     "colorMode": "background", "graphMode": "area", "textMode": "auto"}
                    if kind == "stat" else
                    {"legend": {"displayMode": "table", "placement": "bottom",
                                "calcs": ["mean", "lastNotNull"]},
                     "tooltip": {"mode": "multi", "sort": "desc"}}),
    }


def thresholds(*steps: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute",
            "steps": [{"value": v, "color": c} for v, c in steps]}


def stream_panels() -> list[dict[str, Any]]:
    """Per named stream (the ``stream`` variable picks them): what the broker forwards,
    buffers, who is connected, the trainers' queues, and exact streams' epoch progress."""
    return [
        panel(17, "timeseries", "Throughput by stream (batches/s)",
              "Batches the broker hands to training processes per second, by stream (at most "
              "64 named streams; beyond: 'other').",
              (0, 44, 12, 8),
              [(f"sum by (stream) (rate(feedline_broker_stream_forwarded_batches_total{{{S}}}"
                f"[{RI}]))", "{{stream}}")]),
        panel(18, "timeseries", "Buffered by stream (batches)",
              "Batches waiting in the broker, by stream: a stream that stays full has "
              "training processes slower than its producers.",
              (12, 44, 12, 8),
              [(f"sum by (stream) (feedline_broker_stream_buffer_batches{{{S}}})",
                "{{stream}}")], decimals=0),
        panel(19, "timeseries", "Peers by stream",
              "Producers and training processes registered with the broker, by stream: a "
              "stream with consumers and no producers gets nothing.",
              (0, 52, 12, 8),
              [(f"sum by (stream, role) (feedline_broker_stream_peers{{{S}}})",
                "{{stream}} {{role}}s")], decimals=0),
        panel(20, "timeseries", "Consumer queue occupancy by stream",
              "Mean of local queue / window over the training processes of each stream "
              "(joined on feedline_consumer_stream_info). Near 100%: that stream is "
              "model-bound; near 0%: input-bound.",
              (12, 52, 12, 8),
              [("avg by (stream) (feedline_consumer_local_queue_batches"
                " / feedline_consumer_window_batches"
                f" * on (instance, job) group_left (stream) feedline_consumer_stream_info{{{S}}})",
                "{{stream}}")],
              unit="percentunit", min=0, max=1),
        panel(21, "stat", "Exact epoch",
              "Exact-delivery streams: the epoch the broker is serving (it moves on when every "
              "batch of every work unit of the epoch was taken by a training process).",
              (0, 60, 6, 8),
              [(f"max by (stream) (feedline_broker_exact_epoch{{{S}}})", "{{stream}}")],
              decimals=0),
        panel(22, "timeseries", "Exact units done",
              "Exact-delivery streams: work units of the current epoch whose batches were all "
              "taken, and the units of the epoch in all. Done reaches total, then the epoch "
              "moves on and done starts again from 0.",
              (6, 60, 18, 8),
              [(f'sum by (stream) (feedline_broker_exact_units{{{S},state="done"}})',
                "{{stream}} done"),
               (f'sum by (stream) (feedline_broker_exact_units{{{S},state="total"}})',
                "{{stream}} total")], decimals=0),
    ]


def sizing_panels() -> list[dict[str, Any]]:
    """Per stream, the broker's sizing: producers wanted against connected, what the trainers
    would take against what the producers can give, the reason, and supervisors' shares."""
    reason = panel(
        25, "stat", "Sizing reason by stream",
        "Why the broker wants the producers it wants: input-bound (the trainers wait for data: "
        "more producers), model-bound (batches wait for the trainers: fewer would do), "
        "balanced, idle (no trainer reads the stream).",
        (0, 76, 6, 8),
        [(f"max by (stream, verdict) (feedline_broker_stream_bottleneck{{{S}}} == 1)",
          "{{stream}}: {{verdict}}")])
    reason["options"]["textMode"] = "name"
    reason["options"]["colorMode"] = "none"
    return [
        panel(23, "timeseries", "Producers wanted by stream",
              "feedline_broker_stream_producers_wanted (what feedline fleet, an HPA or KEDA "
              "follows; it rises after a fifth of --sizing-window of evidence and falls after "
              "all of it) against the producers connected.",
              (0, 68, 12, 8),
              [(f"max by (stream) (feedline_broker_stream_producers_wanted{{{S}}})",
                "{{stream}} wanted"),
               (f'sum by (stream) (feedline_broker_stream_peers{{{S},role="producer"}})',
                "{{stream}} connected")], decimals=0),
        panel(24, "timeseries", "Demand and supply by stream (batches/s)",
              "Demand: what the stream's trainers would take if they never waited for data. "
              "Supply: what its connected producers can deliver (one producer's rate when "
              "credit does not hold it back, times their number). Supply below demand: "
              "input-bound.",
              (12, 68, 12, 8),
              [(f"max by (stream) (feedline_broker_stream_demand_batches_per_second{{{S}}})",
                "{{stream}} demand"),
               (f"max by (stream) (feedline_broker_stream_supply_batches_per_second{{{S}}})",
                "{{stream}} supply")]),
        reason,
        panel(26, "timeseries", "Supervisors' shares",
              "Producers each supervisor (feedline fleet --id) runs, against its share of the "
              "stream's number (equal shares in the order of the ids, within each one's "
              "--max).",
              (6, 76, 18, 8),
              [(f"max by (stream, fleet) (feedline_broker_fleet_producers_wanted{{{S}}})",
                "{{stream}} {{fleet}} share"),
               (f"max by (stream, fleet) (feedline_broker_fleet_producers{{{S}}})",
                "{{stream}} {{fleet}} running")], decimals=0),
    ]


def dashboard() -> dict[str, Any]:
    ok_bad = thresholds((None, "green"), (1, "red"))
    panels = [
        panel(1, "stat", "Throughput (batches/s)",
              "Batches the broker hands to training processes per second.",
              (0, 0, 4, 4), [(f"sum(rate(feedline_broker_forwarded_batches_total[{RI}]))", "")],
              decimals=1),
        panel(2, "stat", "Throughput (bytes/s)",
              "Array bytes the broker hands to training processes per second.",
              (4, 0, 4, 4), [(f"sum(rate(feedline_broker_forwarded_bytes_total[{RI}]))", "")],
              unit="Bps"),
        panel(3, "stat", "Verdict",
              "Mean fill of the training processes' queues over 1 minute (0 when the loop "
              f"waits for data {WAIT_SHARE_INPUT_BOUND:.0%} of its time or more). Below "
              f"{INPUT_BOUND_BELOW}: INPUT-BOUND, add producers or speed up the pipeline. "
              f"Above {MODEL_BOUND_ABOVE}: MODEL-BOUND, the input keeps up.",
              (8, 0, 6, 4), [(VERDICT, "")], unit="percentunit",
              mappings=[{"type": "range", "options": {
                  "from": lo, "to": hi, "result": {"text": text, "color": color}}}
                  for lo, hi, text, color in (
                      (0, INPUT_BOUND_BELOW, "INPUT-BOUND", "red"),
                      (INPUT_BOUND_BELOW, MODEL_BOUND_ABOVE, "balanced", "yellow"),
                      (MODEL_BOUND_ABOVE, 2, "MODEL-BOUND", "green"))],
              thresholds=thresholds((None, "red"), (INPUT_BOUND_BELOW, "yellow"),
                                    (MODEL_BOUND_ABOVE, "green"))),
        panel(4, "stat", "Peers", "Producers and training processes connected to the broker.",
              (14, 0, 4, 4), [("feedline_broker_peers", "{{role}}")]),
        # Totals since the broker started, not increase(): a reason's series appears with its
        # first reject, and increase() would miss that first one.
        panel(5, "stat", "Batches lost",
              "Batches missing from producers' sequences since the broker started (a "
              "producer died with batches in flight, or the network dropped them).",
              (18, 0, 3, 4), [("sum(feedline_broker_lost_batches_total)", "")],
              thresholds=ok_bad, decimals=0),
        panel(6, "stat", "Rejected",
              "Messages the broker refused since it started (malformed, oversized, no "
              "credit, unknown peer); the reasons are in 'Losses and rejects'.",
              (21, 0, 3, 4), [("sum(feedline_broker_rejected_messages_total)", "")],
              thresholds=ok_bad, decimals=0),
        panel(7, "timeseries", "Throughput per producer (batches/s)",
              "Batches received by the broker per second, by producer id.",
              (0, 4, 12, 8),
              [(f"sum by (producer) (rate(feedline_broker_received_batches_total[{RI}]))",
                "{{producer}}"),
               (f"sum(rate(feedline_broker_received_batches_total[{RI}]))", "total")]),
        panel(8, "timeseries", "Throughput per producer (bytes/s)",
              "Array bytes received by the broker per second, by producer id.",
              (12, 4, 12, 8),
              [(f"sum by (producer) (rate(feedline_broker_received_bytes_total[{RI}]))",
                "{{producer}}"),
               (f"sum(rate(feedline_broker_received_bytes_total[{RI}]))", "total")],
              unit="Bps"),
        panel(9, "timeseries", "Broker buffer",
              "Batches waiting in the broker, its capacity, and credit granted to producers "
              "but not yet used. A full buffer with idle consumers cannot happen; a full "
              "buffer means the trainers are slower than the producers.",
              (0, 12, 12, 8),
              [("feedline_broker_buffer_batches", "buffered"),
               ("feedline_broker_buffer_capacity_batches", "capacity"),
               ("feedline_broker_credit_outstanding_batches", "credit outstanding")]),
        panel(10, "timeseries", "Consumer queue occupancy",
              "Batches waiting in each training process / its window. Near 100%: "
              "model-bound. Near 0%: input-bound.",
              (12, 12, 12, 8),
              [("feedline_consumer_local_queue_batches / feedline_consumer_window_batches",
                "{{instance}}")],
              unit="percentunit", min=0, max=1,
              thresholds=thresholds((None, "red"), (INPUT_BOUND_BELOW, "yellow"),
                                    (MODEL_BOUND_ABOVE, "green")),
              custom={"thresholdsStyle": {"mode": "line"}}),
        panel(11, "timeseries", "Where the time goes (share of each second)",
              "Training loop waiting for data (input-bound); producers waiting for credit "
              "(model-bound); producers waiting for their own pipeline (preprocessing-bound).",
              (0, 20, 12, 8),
              [(f"rate(feedline_consumer_wait_seconds_sum[{RI}])",
                "trainer waits for data {{instance}}"),
               (f"rate(feedline_producer_credit_wait_seconds_sum[{RI}])",
                "producer waits for credit {{instance}}"),
               (f"rate(feedline_producer_pipeline_seconds_total[{RI}])",
                "producer waits for its pipeline {{instance}}")],
              unit="percentunit", min=0),
        panel(12, "timeseries", "Wait per batch, p99",
              "99th percentile of the training loop's wait for a batch and of a producer's "
              "wait for credit.",
              (12, 20, 12, 8),
              [("histogram_quantile(0.99, sum by (le) "
                f"(rate(feedline_consumer_wait_seconds_bucket[{RI}])))", "trainer, data"),
               ("histogram_quantile(0.99, sum by (le) "
                f"(rate(feedline_producer_credit_wait_seconds_bucket[{RI}])))",
                "producers, credit")],
              unit="s"),
        panel(13, "timeseries", "Losses and rejects",
              "Lost batches by producer, messages refused by reason, peers dropped by reason "
              "(per scrape interval).",
              (0, 28, 12, 8),
              [(f"sum by (producer) (increase(feedline_broker_lost_batches_total[{RI}]))",
                "lost {{producer}}"),
               ("sum by (reason) "
                f"(increase(feedline_broker_rejected_messages_total[{RI}]))",
                "rejected {{reason}}"),
               ("sum by (role, reason) "
                f"(increase(feedline_broker_dropped_peers_total[{RI}]))",
                "dropped {{role}} ({{reason}})")],
              decimals=0),
        panel(14, "timeseries", "Peers connected",
              "Peers registered with the broker, and producer metrics endpoints up.",
              (12, 28, 12, 8),
              [("feedline_broker_peers", "{{role}}"),
               ('count(up{job=~"producer|producer-remote"} == 1)', "producer endpoints up")],
              decimals=0),
        panel(15, "timeseries", "Pipeline stage rates",
              "Datapoints per second out of each stage of the producers' pipelines, all "
              "producers together (stage: step index and kind from the pipeline file). A "
              "filter far below its input drops much; source / batch is the batch size.",
              (0, 36, 12, 8),
              [("sum by (stage) "
                f"(rate(feedline_producer_stage_datapoints_total[{RI}]))", "{{stage}}")],
              unit="ops"),
        panel(16, "timeseries", "Skipped samples",
              "Samples dropped by on_error: skip (corrupt images), per producer and stage, "
              "per scrape interval; the total is in each producer's rate line. Map stages "
              "export it (0 included); a pipeline without one has nothing to skip.",
              (12, 36, 12, 8),
              [("sum by (instance, stage) "
                f"(increase(feedline_producer_skipped_datapoints_total[{RI}]))",
                "{{stage}} {{instance}}")],
              decimals=0),
        *stream_panels(),
        *sizing_panels(),
    ]
    return {
        "uid": "feedline",
        "title": "feedline",
        "description": "Throughput, buffers, bottleneck verdict, losses (docs/operations.md).",
        "tags": ["feedline"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "5s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": [STREAM_VARIABLE]},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    sys.stdout.write(f"wrote {OUT}\n")
