"""Execute the notebooks and write rendered HTML copies to notebooks/html/ (not committed).

    .venv/bin/python scripts/render_notebooks.py            # full settings
    .venv/bin/python scripts/render_notebooks.py --quick    # the CI setting
    .venv/bin/python scripts/render_notebooks.py 01_mergecomp

The notebooks themselves stay stored without outputs; this prints how long each one took.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="notebook names (default: all)")
    ap.add_argument("--quick", action="store_true", help="the short CI setting (COMMLAB_QUICK=1)")
    ap.add_argument("--out", default=str(NOTEBOOKS / "html"), help="output folder (default notebooks/html)")
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
    out = Path(args.out)
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
        html, _ = HTMLExporter().from_notebook_node(nb)
        (out / f"{p.stem}.html").write_text(html)
        print(f"{p.stem:28s} {took:6.0f} s  {status}  -> {out / (p.stem + '.html')}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
