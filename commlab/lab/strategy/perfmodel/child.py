"""What the performance model measures for a viewer, in a child with limits (commlab.lab.base.sandbox), never in the
process that serves the UI:

    python -m commlab.lab.strategy.perfmodel.child TASK LIMITS_JSON < input.json      one JSON object on stdout

Tasks (registered with commlab.lab.base.sandbox by calibrate, with their limits calibrate.CURVES and calibrate.PREDICT):
``curves`` (calibrate.curves_here: compressors' encode/decode cost curves, timed on buffers their parameters size;
input ``{"items": [{"compressor": section} | {"method": section}, ...], "numels", "repeat", "warm"}``), ``rounds``
(predict.rounds_here: the payload of buckets whose compressor declares none, by driving one exchange; input
``{"items": [{"compressor", "shapes", "n", "sharded"}, ...]}``) and ``predict`` (whatif.cluster_here: the
Performance model page's cluster prediction of a viewer's profile and spec, with the curves and payloads it
measures). Callers: calibrate.measure_curves, predict.without_driving, views.cluster_prediction.

At its top it imports the lab's own modules, which load neither torch nor anything a viewer names; the work
imports torch and builds the compressors after commlab.lab.base.sandbox.main has set the child's limits.
"""
from __future__ import annotations

import sys

from commlab.lab.base import sandbox
from commlab.lab.strategy.perfmodel import calibrate, predict, whatif


def work(task: str, data: dict):
    """The child's work (commlab.lab.base.sandbox.main), after its limits are set."""
    import torch
    torch.set_num_threads(1)
    if task == "curves":
        return calibrate.curves_here(data)
    if task == "rounds":
        return predict.rounds_here(data)
    if task == "predict":
        return whatif.cluster_here(data)
    raise ValueError(f"no task {task!r} here")


if __name__ == "__main__":
    sys.exit(sandbox.main(work=work))
