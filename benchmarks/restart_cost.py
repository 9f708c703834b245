"""What the restart markers of a prepared JPEG's crop cost libjpeg-turbo: the upper bound of
a marker-free prepared format (benchmarks/NOTES.md, "What the restart markers cost").

A prepared JPEG has a restart marker after every MCU; the fused decoder hands libjpeg-turbo a
synthetic JPEG of the crop's MCUs, markers included, and libjpeg-turbo's Huffman decoder
takes its slow path for every MCU of a scan with a restart interval (jdhuff.c, decode_mcu:
``usefast = 0`` whenever ``cinfo->restart_interval`` is set). This measures what removing
them would buy, before anyone builds it: for ``--files`` photos of FOLDER, prepared in
memory, and ``--crops`` RandomResizedCrop boxes each (``ImageNetTrain(224)``'s draws), it
writes the synthetic JPEG the extension builds (checked: decoded as the extension's
``decode`` request it gives the extension's pixels), then ``restart_cost.c`` (built here
with the system C compiler against libjpeg) makes marker-free copies of the same
coefficients and times libjpeg-turbo decoding both, rounds alternating, on one core.

    python benchmarks/restart_cost.py data/bench-jpeg-hr --files 128 --crops 4 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prepare_jpegs import one_core  # noqa: E402
from feedline.producer.image import ImageNetTrain, turbo  # noqa: E402
from feedline.producer.image.prepared import prepare_jpeg  # noqa: E402

HERE = Path(__file__).resolve().parent


def mcu_rect(index: tuple[int, int, int, int, int], p: turbo.Plan,
             cols: tuple[int, int]) -> tuple[int, int, int, int]:
    """The MCUs ``(r0, r1, c0, c1)`` the extension puts in a crop's synthetic JPEG: the
    request's rows and columns ``cols`` plus one scaled pixel each side, at least two MCUs
    each way (``synthetic()`` in _jpegturbo.c; the caller checks the pixels agree)."""
    n_cols, n_rows, mw, mh, _ = index
    smw, smh = mw * p.scale // 8, mh * p.scale // 8
    sh, sw = p.scaled_hw
    ya, yb = max(p.r0 - 1, 0), min(p.r1 + 1, sh)
    xa, xb = max(cols[0] - 1, 0), min(cols[1] + 1, sw)
    r0, r1, c0, c1 = ya // smh, -(-yb // smh), xa // smw, -(-xb // smw)
    if c1 - c0 < 2 and n_cols >= 2:
        c1, c0 = (c1 + 1, c0) if c1 < n_cols else (c1, c0 - 1)
    if r1 - r0 < 2 and n_rows >= 2:
        r1, r0 = (r1 + 1, r0) if r1 < n_rows else (r1, r0 - 1)
    return r0, r1, c0, c1


def write_crops(folder: Path, out: Path, files: int, crops: int, seed: int,
                rounds: int) -> int:
    """Writes the synthetic JPEGs and ``list.txt`` (see restart_cost.c) and prints what
    building them costs the extension today; the crop count."""
    from feedline.producer.image import _jpegturbo  # type: ignore[attr-defined]

    paths = sorted(folder.rglob("*.jpg"))
    paths = paths[::max(1, len(paths) // files)][:files]
    pre = ImageNetTrain(224, seed=seed)
    lines: list[str] = []
    made: list[tuple[np.ndarray, tuple[int, int, int, int]]] = []
    for path in paths:
        data = np.frombuffer(prepare_jpeg(path.read_bytes()), np.uint8)
        index = _jpegturbo.index_info(data)
        if index is None:
            continue  # not preparable (CMYK, ...): nothing to measure
        h, w = turbo.header(data)
        mw = index[2]
        for _ in range(crops):
            y0, x0, ch, cw = pre.crop.sample_box(h, w, pre.rng)
            p = turbo.plan((h, w), (y0, x0, y0 + ch, x0 + cw), (224, 224))
            qc0 = max(0, p.c0 - turbo.EDGE)
            qc1 = min(p.scaled_hw[1], p.c1 + turbo.EDGE)
            r0, r1, c0, c1 = mcu_rect(index, p, (qc0, qc1))
            syn = _jpegturbo.synthetic(data, r0, r1, c0, c1)
            made.append((data, (r0, r1, c0, c1)))
            y_syn = p.r0 - r0 * index[3] * p.scale // 8
            width = -(-(min(c1 * mw, w) - c0 * mw) * p.scale // 8)
            want = _jpegturbo.decode(data, p.scale, p.r0, qc0, p.r1 - p.r0, qc1 - qc0, False,
                                     1 << 30, turbo.MAX_SCANS)
            got = _jpegturbo.decode(syn, p.scale, y_syn, 0, p.r1 - p.r0, width, False,
                                    1 << 30, turbo.MAX_SCANS)
            if got[0] != want[0]:
                raise SystemExit(f"{path}: the synthetic crop here is not the extension's; "
                                 "mcu_rect() no longer matches _jpegturbo.c")
            name = f"{len(lines):05d}.jpg"
            (out / name).write_bytes(syn)
            lines.append(f"{name} {p.scale} {y_syn} {p.r1 - p.r0} {(r1 - r0) * (c1 - c0)}")
    (out / "list.txt").write_text("".join(f"{x}\n" for x in lines))
    best = float("inf")
    for _ in range(rounds):
        t = time.process_time()
        for data, rect in made:
            _jpegturbo.synthetic(data, *rect)
        best = min(best, time.process_time() - t)
    print(f"{len(lines)} synthetic crops of {folder} written, each checked against the "
          f"extension's decode; building one costs the extension {best / len(made) * 1e6:.1f}"
          f" us today (index checks, memchr and byte copies; best of {rounds})", flush=True)
    return len(lines)


def build(tmp: Path) -> Path:
    """restart_cost.c compiled against the system libjpeg(-turbo)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        raise SystemExit(f"needs a C compiler ({cc}) and the libjpeg-turbo headers")
    exe = tmp / "restart_cost"
    subprocess.run([cc, "-O2", "-o", str(exe), str(HERE / "restart_cost.c"), "-ljpeg"],
                   check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="original JPEGs (prepared here, in memory)")
    ap.add_argument("--files", type=int, default=128)
    ap.add_argument("--crops", type=int, default=4, help="RandomResizedCrop boxes per file")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1)
    args = ap.parse_args()
    one_core(args.core)
    with tempfile.TemporaryDirectory(prefix="restart-cost-") as d:
        tmp = Path(d)
        if write_crops(args.folder, tmp, args.files, args.crops, args.seed, args.rounds) == 0:
            raise SystemExit(f"no preparable JPEGs in {args.folder}")
        subprocess.run([str(build(tmp)), str(tmp), str(args.rounds)], check=True)


if __name__ == "__main__":
    main()
