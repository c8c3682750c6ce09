"""Execute the notebooks and write rendered copies: HTML under notebooks/html/ (not committed), or with --docs the
executed notebooks the documentation site shows under docs/notebooks/ (committed).

    .venv/bin/python scripts/render_notebooks.py                   # full settings -> notebooks/html/*.html
    .venv/bin/python scripts/render_notebooks.py --quick           # the CI setting (COMMLAB_QUICK=1)
    .venv/bin/python scripts/render_notebooks.py --quick 01_mergecomp
    .venv/bin/python scripts/render_notebooks.py --quick --docs    # -> docs/notebooks/*.ipynb, for mkdocs

The notebooks themselves stay stored without outputs; this prints how long each one took. Runs go to a
fresh temporary runs directory unless $COMMLAB_RUNS names one.

For the docs, each Plotly figure is kept as a small piece of HTML that draws it with the plotly.js the site
loads once (mkdocs.yml extra_javascript), instead of plotly.js embedded in the notebook (4.6 MB each), and
links between notebooks point at their pages on the site.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
DOCS_NOTEBOOKS = ROOT / "docs" / "notebooks"
PLOTLY = "application/vnd.plotly.v1+json"


def figure_html(fig: dict, div_id: str) -> str:
    """A figure as a div and a script that draws it once the page (and plotly.js, loaded at its end) is in."""
    height = (fig.get("layout") or {}).get("height") or 450
    data = json.dumps(fig.get("data", []), separators=(",", ":")).replace("</", "<\\/")
    layout = json.dumps(fig.get("layout", {}), separators=(",", ":")).replace("</", "<\\/")
    return (f'<div id="{div_id}" class="plotly-graph-div" style="height:{height}px; width:100%;"></div>\n'
            f'<script>document.addEventListener("DOMContentLoaded", function () {{ '
            f'Plotly.newPlot("{div_id}", {data}, {layout}, {{"responsive": true}}); }});</script>')


def for_docs(nb, stem: str) -> int:
    """Rewrite an executed notebook in place for the site; returns the number of figures."""
    figures = 0
    for cell in nb.cells:
        if cell.cell_type == "markdown":  # a link to a sibling notebook -> that notebook's page on the site
            cell.source = re.sub(r"\]\((\d\d_[a-z_]+)\.ipynb\)", r"](../\1/)", cell.source)
            continue
        kept = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY in data:
                out["data"] = {"text/html": figure_html(data[PLOTLY], f"{stem}-fig{figures}")}
                out["metadata"] = {}
                figures += 1
            elif set(data) == {"text/html"} and "plotly" in "".join(data["text/html"])[:2000].lower() \
                    and len("".join(data["text/html"])) > 1_000_000:
                continue  # plotly.js itself, embedded by its notebook renderer: the site loads it once
            kept.append(out)
        cell.outputs = kept
    nb.metadata.pop("widgets", None)
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="notebook names (default: all)")
    ap.add_argument("--quick", action="store_true", help="the short CI setting (COMMLAB_QUICK=1)")
    ap.add_argument("--docs", action="store_true", help=f"write executed notebooks for the docs site to "
                                                        f"{DOCS_NOTEBOOKS.relative_to(ROOT)}")
    ap.add_argument("--out", default=None, help="output folder (default notebooks/html, or docs/notebooks with "
                                                "--docs)")
    args = ap.parse_args(argv)
    import nbclient
    import nbformat
    from nbconvert import HTMLExporter

    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.names:
        want = {n.removesuffix(".ipynb") for n in args.names}
        unknown = want - {p.stem for p in paths}
        if unknown:
            print(f"render_notebooks: no notebook named {', '.join(sorted(unknown))}; "
                  f"have: {', '.join(p.stem for p in paths)}", file=sys.stderr)
            return 2
        paths = [p for p in paths if p.stem in want]
    if args.quick:
        os.environ["COMMLAB_QUICK"] = "1"
    os.environ.setdefault("COMMLAB_RUNS", tempfile.mkdtemp(prefix="commlab-notebook-runs-"))
    out = Path(args.out or (DOCS_NOTEBOOKS if args.docs else NOTEBOOKS / "html"))
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for p in paths:
        nb = nbformat.read(p, as_version=4)
        t0 = time.monotonic()
        try:
            nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                                    resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
            status = "ok"
        except nbclient.exceptions.CellExecutionError as e:
            status, failed = f"FAILED: {str(e).splitlines()[0]}", failed + 1
        took = time.monotonic() - t0
        if args.docs:
            if status != "ok":  # a broken copy must not replace a good one on the site
                print(f"{p.stem:28s} {took:6.0f} s  {status}  (docs copy left as it was)", flush=True)
                continue
            figures = for_docs(nb, p.stem)
            target = out / p.name
            tmp = target.with_suffix(".ipynb.tmp")
            nbformat.write(nb, str(tmp))
            tmp.replace(target)
            print(f"{p.stem:28s} {took:6.0f} s  {status}, {figures} figures  -> {target}", flush=True)
        else:
            html, _ = HTMLExporter().from_notebook_node(nb)
            (out / f"{p.stem}.html").write_text(html)
            print(f"{p.stem:28s} {took:6.0f} s  {status}  -> {out / (p.stem + '.html')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
