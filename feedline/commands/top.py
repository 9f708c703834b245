"""``feedline top``: a live terminal view of a running system, read from its /metrics.

Give it the metrics endpoints of the broker, the producers and the training processes (in any
order: each endpoint is recognised by the metrics it serves). Every ``--interval`` seconds it
scrapes them all and shows, from the difference between two scrapes:

- per producer (as the broker counts them, by producer id): batches/s and MB/s;
- per named stream (as the broker serves it): batches/s forwarded, batches buffered,
  producers and consumers connected and, for an exact stream, the epoch and its work units
  done out of all;
- per producer endpoint: how much of its time it waits for credit (the trainer is slower) or
  for its own pipeline (preprocessing is slower);
- the broker's buffer, what its batch budget holds against its limit in force (and why, when
  over it), peers, losses and rejects;
- per stream, the broker's sizing: its trainers' demand, its producers' supply, the producers
  it needs (``feedline_broker_stream_producers_wanted``) and why (the stream's verdict), and
  each supervisor's share (``feedline fleet``);
- each consumer's queue occupancy and the share of time the model waited for data;
- the verdict: input-bound, model-bound or balanced (see :func:`verdict`), judged over the
  scrapes of the last ``feedline.verdict.WINDOW_SECONDS`` and held until the evidence is
  clear (:class:`feedline.verdict.VerdictTracker`): a steady run does not flap.

An endpoint serving several components' metrics is listed under each: a direct-mode trainer
(``RemoteDataZMQ(addr, bind=True)``) serves its producers as a broker does and is a training
process too, so it shows as a broker and as a consumer, and its queue counts in the verdict.

:func:`render` is pure (snapshots in, text out) so that tests can call it on live figures.
``--once`` exits 1 when an endpoint is down, naming each on stderr.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence

from feedline.flags import HelpFormatter, stop_on_signals
from feedline.scrape import Labels, Scrape, normalize_url, scrape
from feedline.serving.metrics import DEPARTED
from feedline.verdict import WINDOW_SECONDS, VerdictTracker
from feedline.verdict import verdict as _verdict  # the dashboard's thresholds too

Snapshot = Mapping[str, Scrape]  # url -> scrape


def snapshot(urls: Iterable[str], timeout: float = 2.0) -> dict[str, Scrape]:
    return {u: scrape(u, timeout) for u in urls}


def _rate(prev: Scrape | None, cur: Scrape, name: str, labels: Labels = ()) -> float:
    """Per-second increase of a counter between two scrapes (0 after a restart or if new)."""
    if prev is None or prev.error or cur.error or cur.time <= prev.time:
        return 0.0
    a = prev.samples.get((name, labels))
    b = cur.samples.get((name, labels))
    if a is None or b is None or b < a:
        return 0.0
    return (b - a) / (cur.time - prev.time)


def verdict(occupancy: float | None, wait_share: float | None,
            tracker: VerdictTracker | None = None) -> str:
    """The bottleneck, from the consumers' mean queue occupancy (0..1) and wait share (0..1).

    Input-bound when the model waits for data (a queue near empty, or waiting a tenth of the
    time or more); model-bound when the queue stays near full; balanced in between. With a
    ``tracker`` the verdict it holds (this sample counts as one more of its samples).
    """
    if occupancy is None:
        return "unknown (no consumer metrics)"
    word = tracker.update(occupancy, wait_share) if tracker is not None \
        else _verdict(occupancy, wait_share)
    return {
        "input-bound": "INPUT-BOUND: the model waits for data; add producers or make the "
                       "pipeline faster",
        "model-bound": "MODEL-BOUND: batches wait for the model; the input keeps up",
        "balanced": "balanced: the input just keeps up with the model",
    }[word]


ROLES = ("broker", "producer", "consumer")


def roles(s: Scrape) -> list[str]:
    """Every component whose metrics ``s`` serves (a direct-mode trainer: broker and
    consumer), in :data:`ROLES` order."""
    names = {n for n, _ in s.samples}
    return [r for r in ROLES if any(n.startswith(f"feedline_{r}_") for n in names)]


def _mb(x: float) -> str:
    return f"{x / 1e6:8.1f}"


def _budget_lines(b: Scrape, direct: bool) -> list[str]:
    """What the broker's batch budget holds against its limit in force, saying what both
    count: ``--max-batches`` bounds the batches buffered, in flight to consumers and granted
    to producers together, counted for the largest batches registered (smaller ones by their
    bytes: feedline.serving.budget.depth). Held above the limit (granted while only smaller
    batches were produced) is said so, on a line of its own, not shown as a fill over 100%.
    ``direct``: a direct-mode trainer, whose count is its ``window``."""
    cap = b.get("feedline_broker_buffer_capacity_batches") or 0.0
    buffered = b.get("feedline_broker_buffer_batches") or 0.0
    inflight = b.get("feedline_broker_inflight_batches") or 0.0
    granted = b.get("feedline_broker_credit_outstanding_batches") or 0.0
    held = buffered + inflight + granted
    over = bool(cap) and held > cap
    fill = "over it" if over else f"{100 * held / cap:.0f}%" if cap else "none known"
    flag = "window" if direct else "--max-batches"
    lines = [f"        held {held:.0f} batches of {cap:.0f} ({fill}; {flag} for the "
             f"largest batches): {buffered:.0f} buffered, {inflight:.0f} in flight, "
             f"{granted:.0f} granted"]
    if over:
        lines.append("          over it: granted while only smaller batches were produced "
                     "(they count by their bytes); no credit until they are taken")
    return lines


def render(prev: Snapshot, cur: Snapshot, width: int = 120,
           history: Sequence[Snapshot] = (), tracker: VerdictTracker | None = None) -> str:
    """The screen for two successive snapshots of the same endpoints (pure but for
    ``tracker``, which the verdict updates). The rates are between ``prev`` and ``cur``; the
    verdict is over ``history`` (older snapshots, oldest first, ending with ``prev``) and
    ``cur``, or over ``prev`` and ``cur`` alone."""
    lines: list[str] = []
    by_role: dict[str, list[Scrape]] = {"broker": [], "producer": [], "consumer": []}
    down = [s for s in cur.values() if s.error]
    for s in cur.values():
        for role in roles(s) if not s.error else ():
            by_role[role].append(s)
    interval = max((s.time - prev[u].time for u, s in cur.items() if u in prev), default=0.0)
    lines.append(f"feedline top   {time.strftime('%H:%M:%S')}   "
                 f"{len(cur) - len(down)}/{len(cur)} endpoints up, {interval:.1f}s between scrapes")

    for b in by_role["broker"]:
        p = prev.get(b.url)
        lines.append("")
        direct = "consumer" in roles(b)  # a trainer serving its producers: direct mode
        who = f"direct-mode trainer {b.url}" if direct else f"broker {b.url}"
        lines.append(f"PRODUCERS (as {who} receives them)")
        lines.append(f"  {'producer':<32} {'batches/s':>10} {'MB/s':>8} {'lost':>6}")
        tot_b = tot_y = 0.0
        for labels in sorted(b.series("feedline_broker_received_batches_total")):
            pid = dict(labels).get("producer", "?")
            rb = _rate(p, b, "feedline_broker_received_batches_total", labels)
            ry = _rate(p, b, "feedline_broker_received_bytes_total", labels)
            lost = b.samples.get(("feedline_broker_lost_batches_total", labels), 0.0)
            tot_b, tot_y = tot_b + rb, tot_y + ry
            lines.append(f"  {pid[:32]:<32} {rb:>10.1f} {_mb(ry)} {lost:>6.0f}")
        lines.append(f"  {'total':<32} {tot_b:>10.1f} {_mb(tot_y)}")
        fill = b.get("feedline_broker_buffer_batches") or 0.0
        fill_b = b.get("feedline_broker_buffer_bytes") or 0.0
        fwd = _rate(p, b, "feedline_broker_forwarded_batches_total")
        lines.append("")
        lines.append(
            f"BROKER{' (direct mode)' if direct else ''}  buffer {fill:.0f} batches"
            f" {fill_b / 2**20:.1f} MiB   forwarded"
            f" {fwd:.1f} batches/s   peers: "
            f"{b.get('feedline_broker_peers', role='producer') or 0:.0f} producers, "
            f"{b.get('feedline_broker_peers', role='consumer') or 0:.0f} consumers")
        lines += _budget_lines(b, direct)
        ended = b.series("feedline_broker_dropped_peers_total")
        left = sum(v for lab, v in ended.items() if dict(lab).get("reason") in DEPARTED)
        lines.append(
            f"        lost {b.total('feedline_broker_lost_batches_total'):.0f}   rejected "
            f"{b.total('feedline_broker_rejected_messages_total'):.0f}   dropped peers "
            f"{sum(ended.values()) - left:.0f}" + (f" ({left:.0f} left cleanly)"
                                                  if left else ""))
        lines += _streams(p, b, who)
        lines += _sizing(b)

    if by_role["producer"]:
        lines.append("")
        lines.append("PRODUCER ENDPOINTS  (time share waiting for credit: trainer slower; "
                     "for the pipeline: preprocessing slower)")
        lines.append(f"  {'endpoint':<32} {'batches/s':>10} {'MB/s':>8} {'credit':>7} "
                     f"{'pipeline':>9}")
        for s in sorted(by_role["producer"], key=lambda s: s.url):
            p = prev.get(s.url)
            rb = _rate(p, s, "feedline_producer_sent_batches_total")
            ry = _rate(p, s, "feedline_producer_sent_bytes_total")
            # A wait is counted when it ends, so a short interval can see more than 100%.
            cw = min(1.0, _rate(p, s, "feedline_producer_credit_wait_seconds_sum"))
            pl = min(1.0, _rate(p, s, "feedline_producer_pipeline_seconds_total"))
            lines.append(f"  {_short(s.url):<32} {rb:>10.1f} {_mb(ry)} {100 * cw:>6.0f}% "
                         f"{100 * pl:>8.0f}%")

    if by_role["consumer"]:
        lines.append("")
        lines.append("CONSUMERS (training processes)")
        lines.append(f"  {'endpoint':<32} {'batches/s':>10} {'MB/s':>8} {'queue':>9} "
                     f"{'waiting':>8} {'lost':>6}  stream")
        for s in sorted(by_role["consumer"], key=lambda s: s.url):
            p = prev.get(s.url)
            q = s.get("feedline_consumer_local_queue_batches") or 0.0
            w = s.get("feedline_consumer_window_batches") or 0.0
            if p is not None and not p.error:
                # Mean of both scrapes: one instant of a queue is noisy.
                q = (q + (p.get("feedline_consumer_local_queue_batches") or 0.0)) / 2
            rb = _rate(p, s, "feedline_consumer_received_batches_total")
            ry = _rate(p, s, "feedline_consumer_received_bytes_total")
            ws = min(1.0, _rate(p, s, "feedline_consumer_wait_seconds_sum"))
            lost = s.get("feedline_consumer_lost_batches_total") or 0.0
            stream = ",".join(sorted(s.by_label("feedline_consumer_stream_info", "stream")))
            lines.append(f"  {_short(s.url):<32} {rb:>10.1f} {_mb(ry)} {q:>4.1f}/{w:<4.0f}"
                         f"{100 * ws:>7.0f}% {lost:>6.0f}  {stream or '?'}")
    occ, wait = _window_figures([*(history or [prev]), cur], by_role["consumer"])
    lines.append("")
    lines.append("VERDICT  " + verdict(occ, wait, tracker))
    for s in down:
        lines.append(f"  down: {s.url} ({s.error})")
    return "\n".join(line[:width] for line in lines)


def _streams(prev: Scrape | None, b: Scrape, who: str) -> list[str]:
    """The broker's per-stream lines (none when it exports no per-stream series: a broker
    older than streams, or a direct-mode trainer)."""
    peers = b.series("feedline_broker_stream_peers")
    buffered = b.by_label("feedline_broker_stream_buffer_batches", "stream")
    forwarded = b.series("feedline_broker_stream_forwarded_batches_total")
    names = sorted({dict(lab).get("stream", "?") for lab in (*peers, *forwarded)}
                   | set(buffered))
    if not names:
        return []
    epoch = b.by_label("feedline_broker_exact_epoch", "stream")
    out = ["", f"STREAMS (as {who} serves them)",
           f"  {'stream':<24} {'batches/s':>10} {'buffered':>9} {'producers':>10} "
           f"{'consumers':>10} {'exact epoch':>12} {'units done':>12} {'duplicates':>11}"]
    for name in names:
        lab: dict[str, str] = {"stream": name}
        rate = _rate(prev, b, "feedline_broker_stream_forwarded_batches_total",
                     tuple(sorted(lab.items())))
        producers = b.get("feedline_broker_stream_peers", stream=name, role="producer") or 0
        consumers = b.get("feedline_broker_stream_peers", stream=name, role="consumer") or 0
        ep, units = "-", "-"
        if name in epoch:
            done = b.get("feedline_broker_exact_units", stream=name, state="done") or 0
            total = b.get("feedline_broker_exact_units", stream=name, state="total") or 0
            ep, units = f"{epoch[name]:.0f}", f"{done:.0f}/{total:.0f}"
        dup = b.get("feedline_broker_duplicate_batches_total", stream=name)
        out.append(f"  {name[:24]:<24} {rate:>10.1f} {buffered.get(name, 0):>9.0f} "
                   f"{producers:>10.0f} {consumers:>10.0f} {ep:>12} {units:>12} "
                   f"{'-' if dup is None else f'{dup:.0f}':>11}")
    return out


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None or math.isnan(x) else format(x, fmt)


def _sizing(b: Scrape) -> list[str]:
    """Per stream: what its trainers would take, what its producers can give, how many
    producers that takes and why; then each supervisor's share (none: a broker older than
    sizing, or a direct-mode trainer)."""
    wanted = b.by_label("feedline_broker_stream_producers_wanted", "stream")
    if not wanted:
        return []
    out = ["", "SIZING (how many producers each stream needs: feedline_broker_stream_"
           "producers_wanted)",
           f"  {'stream':<24} {'demand/s':>9} {'supply/s':>9} {'each/s':>7} {'producers':>10} "
           f"{'wanted':>7} {'waiting':>8}  reason"]
    verdicts = b.series("feedline_broker_stream_bottleneck")
    for name in sorted(wanted):
        reason = next((dict(lab)["verdict"] for lab, v in verdicts.items()
                       if v == 1 and dict(lab).get("stream") == name), "measuring")
        wait = b.get("feedline_broker_stream_consumer_wait_ratio", stream=name)
        producers = b.get("feedline_broker_stream_peers", stream=name, role="producer") or 0
        out.append(
            f"  {name[:24]:<24} "
            f"{_num(b.get('feedline_broker_stream_demand_batches_per_second', stream=name)):>9} "
            f"{_num(b.get('feedline_broker_stream_supply_batches_per_second', stream=name)):>9} "
            f"{_num(b.get('feedline_broker_stream_producer_capacity_batches_per_second', stream=name)):>7} "  # noqa: E501
            f"{producers:>10.0f} {wanted[name]:>7.0f} "
            f"{'-' if wait is None or math.isnan(wait) else f'{100 * wait:.0f}%':>8}  {reason}")
        fleets = b.series("feedline_broker_fleet_producers_wanted")
        mine = sorted((dict(lab)["fleet"], v) for lab, v in fleets.items()
                      if dict(lab).get("stream") == name)
        if mine:
            out.append("    supervisors (running/share): " + ", ".join(
                f"{f} {b.get('feedline_broker_fleet_producers', stream=name, fleet=f) or 0:.0f}"
                f"/{v:.0f}" for f, v in mine))
    return out


def _window_figures(window: Sequence[Snapshot], consumers: list[Scrape]
                    ) -> tuple[float | None, float | None]:
    """The consumers' mean occupancy over every snapshot of ``window`` and their mean share of
    time waiting from its first snapshot to its last (None, None without consumers)."""
    occupancies: list[float] = []
    waits: list[float] = []
    for c in consumers:
        scrapes = [snap[c.url] for snap in window if c.url in snap and not snap[c.url].error]
        ratios = [(s.get("feedline_consumer_local_queue_batches") or 0.0) / win
                  for s in scrapes if (win := s.get("feedline_consumer_window_batches") or 0.0)]
        if ratios:
            occupancies.append(min(1.0, sum(ratios) / len(ratios)))
        if len(scrapes) >= 2:
            waits.append(min(1.0, _rate(scrapes[0], scrapes[-1],
                                        "feedline_consumer_wait_seconds_sum")))
    occ = sum(occupancies) / len(occupancies) if occupancies else None
    wait = sum(waits) / len(waits) if waits else None
    return occ, wait


def _short(url: str) -> str:
    return url.removeprefix("http://").removesuffix("/metrics")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "top",
        help="live terminal view of a running system, from its metrics endpoints",
        description="Scrape the metrics endpoints given (broker, producers, training "
        "processes; host:port or URLs)\nand show throughput, buffer and queue fill, and "
        "whether the input or the model is the bottleneck.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("targets", nargs="+", metavar="HOST:PORT",
                   help="metrics endpoints, e.g. localhost:9500 localhost:9400")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true",
                   help="print one screen (two scrapes --interval apart) and exit; exit "
                   "status 1 when an endpoint is down")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise SystemExit("feedline top: --interval must be > 0")
    urls = [normalize_url(t) for t in args.targets]
    stop = stop_on_signals()
    prev = snapshot(urls)
    # The verdict's window: the scrapes of the last WINDOW_SECONDS (at least two).
    history: collections.deque[dict[str, Scrape]] = collections.deque(
        [prev], maxlen=max(1, int(WINDOW_SECONDS / args.interval)))
    tracker = VerdictTracker()
    while not stop.wait(args.interval):
        cur = snapshot(urls)
        screen = render(prev, cur, history=list(history), tracker=tracker)
        if args.once:
            print(screen)
            return _report_down(cur)
        # Home the cursor and clear the screen: a plain redraw, no curses needed.
        sys.stdout.write("\x1b[H\x1b[2J" + screen + "\n")
        sys.stdout.flush()
        prev = cur
        history.append(cur)
    return 0


def _report_down(cur: Snapshot) -> int:
    """1 and a line on stderr naming each endpoint that is down; 0 when all answered."""
    down = [s for s in cur.values() if s.error]
    if not down:
        return 0
    print(f"feedline top: {len(down)} of {len(cur)} endpoints down: "
          + ", ".join(f"{s.url} ({s.error})" for s in down)
          + "; is the daemon running, and is that its --metrics-port?", file=sys.stderr)
    return 1
