"""Plot the transport sweep (``transport.py --json``) into a PNG for docs/: GB/s against the
batch size for each variant, and the consumer process's CPU-seconds per GB beside it.

    python benchmarks/plot_transport.py benchmarks/results/transport.json docs/transport.png

Needs matplotlib (``pip install '.[bench]'``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.plot_pipeline import plot_parser, pyplot  # noqa: E402

STYLE = {  # variant: (colour, line style); feedline's own in colour, the anchors in grey
    "direct": ("#2a6fb0", "-"),
    "feedline": ("#d0671f", "-"),
    "direct-before": ("#2a6fb0", ":"),
    "before": ("#d0671f", ":"),
    "raw": ("#222222", "--"),
    "relay": ("#777777", "--"),
    "tensorpack": ("#2e9e4a", "--"),
    "raw-threads": ("#aaaaaa", "-."),
    "raw-credit": ("#aaaaaa", ":"),
}
LABEL = {"feedline": "feedline via the broker", "direct": "feedline direct mode",
         "before": "via the broker, before", "direct-before": "direct mode, before",
         "raw": "raw PUSH -> PULL", "relay": "PUSH -> zmq.proxy -> PULL",
         "tensorpack": "tensorpack's direct path"}


def main() -> None:
    ap = plot_parser(__doc__)
    ap.add_argument("--only", nargs="*", default=None,
                    help="variants to draw (default: feedline's, before, and the anchors)")
    args = ap.parse_args()
    sizes = json.loads(args.results.read_text())["sizes"]
    order = sorted(sizes, key=lambda s: sizes[s]["bytes"])
    xs = [sizes[s]["bytes"] for s in order]
    variants = [v for v in args.only or STYLE if v in sizes[order[0]]["median"]]
    plt = pyplot("plot_transport.py")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in variants:
        colour, line = STYLE.get(v, ("#9467bd", "-"))
        med = [sizes[s]["median"].get(v) for s in order]
        gbps = [m["gbps"] if m else float("nan") for m in med]
        cpu = [m["cpu_s_per_gb"] if m else float("nan") for m in med]
        kw = {"color": colour, "linestyle": line, "marker": "o", "markersize": 4,
              "label": LABEL.get(v, v)}
        left.plot(xs, gbps, **kw)
        right.plot(xs, cpu, **kw)
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xticks(xs, order)
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.grid(True, alpha=0.3)
    left.set_yscale("log")
    right.set_yscale("log")
    left.set_ylabel("GB/s (median of rounds)")
    left.set_title("Throughput, one producer process -> one consumer process", fontsize=10)
    right.set_ylabel("consumer CPU-seconds per GB received")
    right.set_title("What the receiving (training) process spends per GB", fontsize=10)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
