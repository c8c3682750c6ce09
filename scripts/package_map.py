"""Draw the package map, docs/img/packages.svg: the layers of tests/test_layers.py (LAYERS) top to bottom, each
package with what its docstring says it owns and its modules, and every import between two packages as an
arrow, read from the source with that test's own import graph.

    .venv/bin/python scripts/package_map.py            # rewrite docs/img/packages.svg
    .venv/bin/python scripts/package_map.py --check    # exit 1 when the file is not what the code draws now

Each package that imports others gets one vertical lane on the right; a branch leaves the lane for every
package it imports (its title, shown on hover, counts the import statements). Arrows only point down: an
arrow up the layers fails tests/test_layers.py before it could be drawn.
"""
from __future__ import annotations

import argparse
import re
import importlib.util
import sys
import textwrap
from collections import Counter
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "img" / "packages.svg"

BOX_X, BOX_W = 20, 560
CHAR_W = 6.7  # monospace at 11 px, for wrapping the module lists
LINE_H, PAD, GAP = 15, 8, 14
LANE0, LANE_DX = BOX_X + BOX_W + 22, 24
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#393b79", "#637939")


def layers_module():
    spec = importlib.util.spec_from_file_location("test_layers", ROOT / "tests" / "test_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def package_of(module: str, layers) -> str:
    best = max((n for n in layers if module == n or module.startswith(n + ".")), key=len)
    return best


def captions(doc: str) -> dict:
    """{package: what it owns}, from the table of layers in tests/test_layers.py's docstring (``name[, name]
    description``; two names share a line with two descriptions split by a semicolon)."""
    out = {}
    for line in doc.splitlines():
        m = re.match(r"^\s{4}([a-z.]+(?:, [a-z.]+)*)\s{2,}(\S.*)$", line)
        if not m:
            continue
        names, says = m.group(1).split(", "), m.group(2)
        parts = [x.strip() for x in says.split(";")] if len(names) > 1 else [says]
        for n, d in zip(names, parts if len(parts) == len(names) else [says] * len(names)):
            out[n] = d
    return out


def members(package: str, mods, layers) -> list:
    """The modules (and sub-packages, with a slash) directly under ``package`` that belong to its layer."""
    out = set()
    for m, path in mods.items():
        if m == package or package_of(m, layers) != package:
            continue
        rest = m[len(package) + 1:].split(".")
        out.add(rest[0] + "/" if len(rest) > 1 or path.name == "__init__.py" else rest[0])
    return sorted(out, key=lambda s: (not s.endswith("/"), s))


def graph():
    """(packages top to bottom, {package: (caption, members)}, Counter of (importer, imported) packages)."""
    tl = layers_module()
    mods, edges, _ = tl.graph(ROOT)
    layers = tl.LAYERS
    order = list(reversed(layers))  # LAYERS lists them bottom to top
    says = captions(tl.__doc__)
    info = {p: (says.get(p, ""), members(p, mods, layers)) for p in order}
    counts = Counter()
    for a, outs in edges.items():
        for b, _, _ in outs:
            pa, pb = package_of(a, layers), package_of(b, layers)
            if pa != pb:
                counts[(pa, pb)] += 1
    for a, b in counts:
        if order.index(b) <= order.index(a) and not {a, b} <= {"commlab.app", "commlab"}:
            raise SystemExit(f"package_map: {a} imports {b}, which is not below it (tests/test_layers.py fails)")
    return order, info, counts


def draw(order, info, counts) -> str:
    width_chars = int((BOX_W - 2 * PAD) / CHAR_W)
    sources = sorted({a for a, _ in counts}, key=lambda a: -order.index(a))  # the lowest importer nearest the boxes
    incoming = {p: [a for a in sources if (a, p) in counts] for p in order}
    boxes, y = {}, 56
    for p in order:
        cap, mem = info[p]
        lines = textwrap.wrap(" · ".join(mem), width_chars) if mem else []
        h = max(PAD * 2 + LINE_H * (1 + len(lines)) + 4, 22 + 7 * len(incoming[p]))  # room for the arrows in
        boxes[p] = (y, h, cap, lines)
        y += h + GAP
    lane = {a: LANE0 + i * LANE_DX for i, a in enumerate(sources)}
    colour = {a: COLOURS[i % len(COLOURS)] for i, a in enumerate(reversed(sources))}
    width = LANE0 + len(sources) * LANE_DX + 10
    height = y + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
           "<title>commlab's packages and the imports between them</title>",
           "<defs>" + "".join(
               f'<marker id="head{i}" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" '
               f'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="{colour[a]}"/></marker>'
               for i, a in enumerate(sources)) + "</defs>",
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{BOX_X}" y="24" font-size="15" font-weight="bold">commlab: packages, top to bottom as they '
           f'may import (tests/test_layers.py)</text>',
           f'<text x="{BOX_X}" y="42" fill="#555">An arrow is a real import between two packages; every arrow '
           f'points down. commlab.app and commlab share the top level and never import each other.</text>']
    for p in order:
        y0, h, cap, lines = boxes[p]
        fill = "#eef3fb" if p.startswith("commlab.lab") or p == "commlab.api" else "#fdf3e6" if p == "commlab.engine" else "#eef8ee"
        out.append(f'<g><rect x="{BOX_X}" y="{y0}" width="{BOX_W}" height="{h}" rx="6" fill="{fill}" '
                   f'stroke="#667"/>')
        out.append(f'<text x="{BOX_X + PAD}" y="{y0 + PAD + 12}"><tspan font-family="monospace" '
                   f'font-weight="bold" font-size="13">{escape(p)}</tspan><tspan fill="#333">  {escape(cap)}'
                   f'</tspan></text>')
        for i, line in enumerate(lines):
            out.append(f'<text x="{BOX_X + PAD}" y="{y0 + PAD + 12 + LINE_H * (i + 1) + 3}" font-family="monospace" '
                       f'font-size="11" fill="#444">{escape(line)}</text>')
        out.append("</g>")
    right = BOX_X + BOX_W
    for i, a in enumerate(sources):
        ya, ha, _, _ = boxes[a]
        start = ya + 10
        x = lane[a]
        targets = [b for b in order if (a, b) in counts]
        ends = {}
        for b in targets:
            yb, hb, _, _ = boxes[b]
            k, n = incoming[b].index(a), len(incoming[b])
            ends[b] = yb + 16 + (hb - 20) * (k + 1) / (n + 1)  # below the importer's own port
        bottom = max(ends.values())
        c = colour[a]
        out.append(f'<g stroke="{c}" fill="none" stroke-width="1.6"><title>{escape(a)} imports '
                   f'{escape(", ".join(targets))}</title>')
        out.append(f'<circle cx="{right}" cy="{start:.1f}" r="3" fill="{c}"/>')
        out.append(f'<path d="M{right},{start:.1f} H{x} V{bottom:.1f}"/>')
        for b in targets:
            out.append(f'<path d="M{x},{ends[b]:.1f} H{right + 1}" marker-end="url(#head{i})">'
                       f'<title>{escape(a)} -> {escape(b)}: {counts[(a, b)]} import(s)</title></path>')
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from what the code draws")
    ap.add_argument("--out", default=str(OUT), help=f"output file (default {OUT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    svg = draw(*graph())
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != svg:
            print(f"package_map: {out} is out of date; run scripts/package_map.py", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(svg)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
