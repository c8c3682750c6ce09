"""Read MergeComp's published scaling-factor bar charts off their images (bench/data/mergecomp_v100.json).

    python bench/data/digitize_mergecomp.py resnet50_results.png resnet101_results.png [--json OUT]

The authors' repository (github.com/zhuangwang93/Cupcake, formerly MergeComp; data/resnet50_results.png
and data/resnet101_results.png) has the figures only as images, three panels each (2, 4, 8 GPUs), so the
numbers are read from pixels, not typed in by eye:

- the y axis: the tick marks left of each panel's frame (0, 20, ..., 100 %), fitted by least squares;
- a bar: a run of columns of one bar colour (blue: layer-wise, orange: MergeComp) just above the x axis,
  its top the first row, from the top, of that colour in a column a quarter of the bar's width in from
  its left edge (the error bar is drawn at the centre);
- a baseline (FP32, dashed): the row with the most pixels of the line's colour, separately inside the
  shaded NVLink group and over the PCIe groups.

Bars are at most a pixel (0.25 points) off the true value; what the authors plotted (means of a few runs,
with error bars) is what is read.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from PIL import Image

GROUPS = ["fp16 (NVLink)", "fp16", "dgc", "topk", "randomk", "qsgd", "efsignsgd", "signsgd", "onebit", "signum"]
GPUS = [2, 4, 8]
BLUE, ORANGE = np.array([58, 117, 175]), np.array([237, 130, 52])


def frames(im):
    gray = (np.ptp(im, axis=2) < 25) & (im.mean(2) < 200)
    cols = [x for x in range(im.shape[1]) if gray[:, x].sum() > 300]
    out, i = [], 0
    while i < len(cols):  # pairs of frame sides ~30% of the image apart
        j = next((j for j in range(i + 1, len(cols)) if 0.25 < (cols[j] - cols[i]) / im.shape[1] < 0.35), None)
        if j is None:
            i += 1
            continue
        out.append((cols[i], cols[j]))
        i = j + 1
    rows = [y for y in range(im.shape[0]) if gray[y, out[0][0] + 5:out[0][1] - 5].sum() > 0.5 * (out[0][1] - out[0][0])]
    return out, min(rows), max(rows)


def y_axis(im, left, top, bottom):
    """Pixel row -> percent, from the tick marks just left of the frame."""
    x = left - 2
    dark = [y for y in range(top - 3, bottom + 4) if im[y, x].mean() < 215]
    ticks = []
    for y in dark:  # merge adjacent rows of one tick, weighted by darkness
        if ticks and y - ticks[-1][-1] <= 1:
            ticks[-1].append(y)
        else:
            ticks.append([y])
    centres = [sum(t * (255 - im[t, x].mean()) for t in g) / sum(255 - im[t, x].mean() for t in g) for g in ticks]
    if len(centres) != 6:
        raise SystemExit(f"expected 6 y ticks left of x={left}, found {len(centres)}")
    vals = np.array([100, 80, 60, 40, 20, 0], float)
    a, b = np.polyfit(centres, vals, 1)
    return lambda y: a * y + b


def close(px, ref, tol):
    return np.abs(px - ref).sum(-1) < tol


def bars(im, left, right, bottom):
    """(x0, x1, colour) of every bar, left to right, from the row just above the x axis."""
    row = im[bottom - 4, left + 2:right - 1]
    out, start, kind = [], None, None
    for i, px in enumerate(list(row) + [np.array([255, 255, 255])]):
        k = None
        if px[2] > px[0] + 40:
            k = "blue"
        elif px[0] > px[2] + 80:
            k = "orange"
        if k != kind:
            if kind is not None and i - start > 8:
                out.append((left + 2 + start, left + 2 + i - 1, kind))
            start, kind = i, k
    return out


def bar_top(im, x0, x1, top, bottom):
    x = x0 + (x1 - x0) // 4
    ref = np.median(im[bottom - 30:bottom - 5, x], axis=0)
    col = im[:bottom, x]
    match = close(col, ref, 60)
    y = next(y for y in range(top, bottom) if match[y] and match[y:y + 6].all())
    # the antialiased edge row above: count its coverage as a fraction of a pixel
    above = col[y - 1]
    bg = np.array([255, 255, 255]) if not close(im[y - 6, x], np.array([224, 216, 240]), 40) else im[y - 6, x]
    frac = np.clip(np.abs(above - bg).sum() / max(np.abs(ref - bg).sum(), 1), 0, 1)
    return y - frac


def baseline(im, x0, x1, top, bottom, skip):
    """The row of the dashed FP32 line between x0 and x1: in the columns between bars (``skip``: the bars'
    column ranges), the row with the most pixels unlike the background (white or the NVLink shading),
    centred over the rows of the line's thickness."""
    xs = [x for x in range(x0, x1) if not any(a - 2 <= x <= b + 2 for a, b in skip)]
    seg = im[top + 2:bottom - 2][:, xs]
    bg = np.median(seg, axis=0)  # per column: the background it runs over
    score = (np.abs(seg - bg[None]).sum(-1) > 90).sum(1)
    y = int(np.argmax(score))
    rows = [r for r in (y - 1, y, y + 1) if score[r] > 0.4 * score[y]]
    return top + 2 + sum(r * score[r] for r in rows) / sum(score[r] for r in rows), int(score[y])


def digitize(path):
    im = np.array(Image.open(path).convert("RGB")).astype(int)
    panels, top, bottom = frames(im)
    out = []
    for gpus, (left, right) in zip(GPUS, panels):
        pct = y_axis(im, left, top, bottom)
        bs = bars(im, left, right, bottom)
        if len(bs) != 2 * len(GROUPS):
            raise SystemExit(f"{path}: {gpus} GPUs: expected {2 * len(GROUPS)} bars, found {len(bs)}: {bs}")
        lav = [x for x in range(left + 2, right - 2) if close(im[top + 8, x], np.array([224, 216, 240]), 30)]
        nv0, nv1 = min(lav), max(lav)
        for g, name in enumerate(GROUPS):
            for (x0, x1, kind), sched in zip(bs[2 * g:2 * g + 2], ("layerwise", "mergecomp")):
                out.append({"gpus": gpus, "compressor": name.split()[0],
                            "link": "nvlink" if "NVLink" in name else "pcie", "schedule": sched,
                            "scaling_pct": round(float(pct(bar_top(im, x0, x1, top, bottom))), 1),
                            "bar_px": [int(x0), int(x1)], "colour": kind})
        for link, (a, b) in (("nvlink", (nv0 + 3, nv1 - 3)), ("pcie", (nv1 + 10, right - 10))):
            y, n = baseline(im, a, b, top, bottom, [(x0, x1) for x0, x1, _ in bs])
            out.append({"gpus": gpus, "compressor": "none", "link": link, "schedule": "horovod",
                        "scaling_pct": round(float(pct(y)), 1), "line_row": round(float(y), 1), "line_px": n})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("images", nargs="+")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = {p: digitize(p) for p in a.images}
    text = json.dumps(res, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
