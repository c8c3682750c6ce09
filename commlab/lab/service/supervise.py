"""A detached supervisor for one queued run: ``python -m commlab.lab.service.supervise --runs DIR RUN_ID``.

Started by ``Lab.submit(..., wait=False)`` (the UI, notebooks). It waits for a
slot, runs the job and writes the final status, like ``commlab run`` does in
the foreground. A room's supervisor is commlab.room.supervise: this one with
the room's admission rule.
"""
from __future__ import annotations

import argparse
import sys

from commlab.engine.runfiles import State
from commlab.lab.base.errors import LabError
from commlab.lab.rundir.store import RunStore
from commlab.lab.service.queue import Lab


def main(argv=None, admission=None) -> int:
    ap = argparse.ArgumentParser(prog="commlab.lab.service.supervise", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("run_id")
    args = ap.parse_args(argv)
    try:
        lab = Lab(args.runs, admission=admission)
    except LabError as e:  # e.g. a runs/lab.json broken since the run was queued: say so in its status
        RunStore(args.runs).get(args.run_id).mark_failed(str(e), only_from=(State.QUEUED,))
        print(f"commlab: error: {e}", file=sys.stderr)
        return 2
    run = lab.store.get(args.run_id)
    state = lab.supervise(run)
    return 0 if state == State.DONE else 1


if __name__ == "__main__":
    sys.exit(main())
