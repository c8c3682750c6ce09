"""A detached supervisor for one queued run: ``python -m lab.supervise --runs DIR RUN_ID``.

Started by ``Lab.submit(..., wait=False)`` (the UI, notebooks). It waits for a
slot, runs the job and writes the final status, like ``commlab run`` does in
the foreground.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lab.supervise", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("run_id")
    args = ap.parse_args(argv)
    from lab.queue import Lab
    lab = Lab(args.runs)
    run = lab.store.get(args.run_id)
    state = lab.supervise(run)
    return 0 if state == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
