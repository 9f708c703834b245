"""Plot the pipeline benchmark's results (``pipeline.py --json``) into a PNG for docs/.

    python benchmarks/plot_pipeline.py benchmarks/results/pipeline_benchmark.json \\
        docs/pipeline_benchmark.png

Needs matplotlib (``pip install '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def pyplot(script: str) -> Any:
    """matplotlib's pyplot (the Agg backend), imported only to draw: ``--help``, which
    tests/docs/test_docs.py runs for every documented command, needs no matplotlib. Every plot
    script of benchmarks/ takes it from here."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{script} needs matplotlib: pip install '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line every plot script of benchmarks/ starts from: a results JSON file
    and the picture to write (a script adds its own flags)."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="the benchmark's --json file")
    ap.add_argument("out", type=Path, help="the picture to write (.png)")
    return ap


def main() -> None:
    args = plot_parser(__doc__).parse_args()
    plt = pyplot("plot_pipeline.py")
    data = json.loads(args.results.read_text())
    sets = data["sets"]
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    key = "images_per_cpu_s"
    for ax, (name, res) in zip(axes[0], sets.items(), strict=True):
        summary, runs = res["summary"], res["runs"]
        names = list(summary)
        vals = [summary[n][key] for n in names]
        colors = ["#888888" if n == "tf.data" else "#2a6fb0" for n in names]
        ax.bar(names, vals, color=colors)
        for i, n in enumerate(names):
            pts = [r[key] for r in runs if r["variant"] == n]
            ax.scatter([i] * len(pts), pts, color="black", s=10, zorder=3)
            ax.text(i, vals[i], f"{vals[i]:.0f}\n{summary[n]['per_core_vs_tf']:.2f}x",
                    ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{name} photos: images per CPU-second", fontsize=10)
        ax.set_ylim(0, max(vals) * 1.25)
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.suptitle("ImageNet train preprocessing (decode, RandomResizedCrop 224, flip, batch 64):"
                 " median of rounds, dots = rounds, ratio = per core vs tf.data", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
