"""Small conveniences shared by the notebooks in notebooks/ (no engine logic here either).

``COMMLAB_QUICK=1`` (set by the test that executes the notebooks in CI) shortens every
experiment so each notebook runs in well under three minutes; without it the notebooks
run their full-length settings (a few minutes each on a 2-core laptop).
"""
from __future__ import annotations

import math
import os

from commlab.engine import runfiles
from commlab.engine.schedules import CallCost, ParamInfo
from commlab.lab.base.paths import default_root

QUICK = os.environ.get("COMMLAB_QUICK", "") not in ("", "0")


def _figures_also_as_html() -> None:
    """Figures carry an HTML copy (with plotly.js embedded once) besides plotly's own JSON, so the rendered
    copies that scripts/render_notebooks.py writes show them offline, in any browser."""
    try:
        import plotly.io as pio
    except ImportError:
        return
    pio.renderers.default = "plotly_mimetype+notebook"


_figures_also_as_html()


def pick(full, quick):
    """``quick`` under COMMLAB_QUICK, else ``full``."""
    return quick if QUICK else full


def runs_dir() -> str:
    """Where the notebooks' runs go: the default of every command, $COMMLAB_RUNS or else ./runs (the kernel's
    working directory). `commlab notebooks` sets $COMMLAB_RUNS to the ./runs of where it was started, so the
    runs a notebook starts show up in `commlab app` and `commlab runs` started there."""
    return str(default_root().resolve()) if not os.environ.get("COMMLAB_RUNS") else os.environ["COMMLAB_RUNS"]


def gradient_shapes(model: str = "resnet", dataset: str = "digits", **options):
    """(name, shape) of every trainable tensor of a zoo model, in gradient-ready order (reverse registration),
    as the communicator sees them."""
    from commlab.engine import data, models
    net = models.build(model, data.load(dataset).info, **options)
    named = [(n, tuple(p.shape)) for n, p in net.named_parameters() if p.requires_grad]
    return named[::-1]


def per_call_cost(compressor: str, shapes, reps: int = 5, **params):
    """Measured encode+decode time of ``compressor`` applied layer by layer (one call per tensor) and once
    on all tensors merged into one flat buffer. Median of ``reps`` repetitions, in seconds:
    ``{"layerwise_s", "merged_s", "calls", "fixed_s"}``, where fixed_s = (layerwise - merged) / (calls - 1)
    is the cost each extra call adds (the per-call overhead MergeComp removes)."""
    import statistics
    import time

    import torch

    from commlab.engine.compressors import make

    torch.manual_seed(0)
    tensors = [torch.randn(s) for _, s in shapes]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    per_layer = [make(compressor, **params) for _ in tensors]
    merged = make(compressor, **params)

    def roundtrip(c, t):
        payload, ctx = c.compress(t)
        c.decompress(payload, ctx)

    def timed(fn):
        out = []
        for _ in range(reps + 1):  # the first repetition warms caches and allocators up
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out[1:])

    lw = timed(lambda: [roundtrip(c, t) for c, t in zip(per_layer, tensors)])
    mg = timed(lambda: roundtrip(merged, flat))
    n = len(tensors)
    return {"layerwise_s": lw, "merged_s": mg, "calls": n, "fixed_s": (lw - mg) / max(n - 1, 1)}


def layerfusion_profile(run):
    """What a ``layerfusion`` run profiled, from its tuning.json: the gradients as ``ParamInfo`` in ready order,
    their median ready times (seconds from the start of backward) and the fitted ``CallCost``. Feed them to
    ``commlab.engine.schedules.layerfusion`` / ``simulate`` to replay the rule."""
    import json

    info = json.load(open(run.file(runfiles.TUNING)))
    if info.get("schedule") != "layerfusion" or "ready_ms" not in info:
        raise ValueError(f"run {run.id}: no layerfusion profile in tuning.json (schedule {info.get('schedule')!r})")
    spec = run.spec_dict()
    shapes = dict(gradient_shapes(spec["model"]["name"], spec["dataset"]["name"], **spec["model"]["options"]))
    names = [n for group in info["layout"] for n in group]
    params = [ParamInfo(n, math.prod(shapes[n]), 4) for n in names]
    c = info["cost"]
    cost = CallCost(c["fixed_ms"] / 1e3, c["per_mb_ms"] / 1e3 / 2 ** 20,
                    c["compute_fixed_ms"] / 1e3, c["compute_per_mb_ms"] / 1e3 / 2 ** 20)
    return params, [r / 1e3 for r in info["ready_ms"]], cost


SLOW_LINK_ENV = "COMMLAB_SLOW_LINK"
"""``modeled`` makes ``slow_link`` give modeled links even as root (the notebooks' test does: shaped links
have tests of their own, tests/test_shaped_runs.py and tests/test_netns.py); ``shaped`` or unset: shaped where
this process may build them."""


def can_shape() -> bool:
    """Whether ``slow_link`` gives shaped links: as root, unless ``$COMMLAB_SLOW_LINK`` is ``modeled``."""
    want = os.environ.get(SLOW_LINK_ENV, "")
    if want not in ("", "shaped", "modeled"):
        raise ValueError(f"{SLOW_LINK_ENV}: must be shaped or modeled, got {want!r}")
    return os.geteuid() == 0 and want != "modeled"


def slow_link(gbps: float) -> dict:
    """A ``network`` spec for an emulated link of ``gbps``: ``shaped`` (tc on an emulated cluster) when this
    process may build one (root; ``can_shape``), else ``modeled`` (alpha-beta delays in the communicator)."""
    return {"link": "shaped" if can_shape() else "modeled", "gbps": gbps}
