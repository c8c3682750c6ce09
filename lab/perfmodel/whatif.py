"""What ``commlab predict`` and the model page do: find or make a profile, then tabulate.

Profile lookup for a spec, in order: ``--profile FILE``; ``--calibrate RUN``
(that run's timeline); a saved profile ``<runs>/.profiles/<key>.json`` for the
spec's model, data set and batch; the most recent finished run in the index
with that model, data set and batch; else a short single-process run of the
spec (20 steps, one thread, loopback) measured now. Every calibrated profile is saved
there and reused. Compressor cost curves missing from it are measured and
added.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable, List, Optional

from engine.spec import SpecError
from lab.perfmodel import calibrate as cal
from lab.perfmodel import predict as pr
from lab.perfmodel.iteration import MODES

PROFILE_STEPS = 20


def load_for_prediction(path: Optional[str] = None, overrides=(), data: Optional[dict] = None) -> dict:
    """A validated, fully defaulted spec dict (the same checks as ``commlab run``)."""
    from lab.specs import apply_overrides, load_spec, read_spec_file
    raw = apply_overrides(data if data is not None else read_spec_file(path), overrides)
    spec = load_spec(data=raw).to_dict()
    if spec["comm"]["mode"] not in MODES:
        raise SpecError("comm.mode", f"the model knows {', '.join(MODES)}")
    return spec


def profile_dir(runs) -> Path:
    from lab.store import default_root
    return Path(runs or default_root()) / ".profiles"


def matching_run(spec: dict, runs):
    """The most recent finished run with the spec's model, data set and batch size, a
    ``sync`` one if there is any: nothing runs inside its backward (in wfbp the synchronous
    header exchange of an all-gathered payload blocks backward and has no span of its own,
    so it would count as compute). ``dear`` runs are not used: their forward includes the
    waits for parameter all-gathers, which are communication, not compute."""
    import lab
    key = cal.spec_key(spec)
    found = []
    for r in reversed(lab.runs(runs=runs, state="done")):
        try:
            d = r.spec_dict()
            if cal.spec_key(d) == key and d["comm"]["mode"] != "dear":
                found.append((d["comm"]["mode"] != "sync", len(found), r))
        except (KeyError, OSError, json.JSONDecodeError):
            continue
    return min(found, key=lambda f: f[:2])[2] if found else None


def resolve_profile(spec: dict, runs=None, profile: Optional[str] = None, calibrate: Optional[str] = None,
                    say: Callable[[str], None] = print, runner: Optional[Callable[[dict], object]] = None
                    ) -> cal.Profile:
    """``runner`` (a validated spec dict -> its finished Run) runs the profiling run when one is needed;
    by default it goes through the queue (lab.run), which a caller holding a slot must not wait on."""
    from lab.store import RunStore
    key = cal.spec_key(spec)
    saved = profile_dir(runs) / f"{key}.json"
    if profile:
        if not Path(profile).is_file():
            raise SpecError("--profile", f"no such file: {profile}")
        p = cal.Profile.load(profile)
        say(f"profile: {profile} ({p.source})")
    elif calibrate:
        p = cal.from_run(RunStore(runs).get(calibrate))
        say(f"profile: calibrated from run {calibrate}")
    elif saved.is_file():
        p = cal.Profile.load(saved)
        say(f"profile: reusing {saved} ({p.source})")
    else:
        run = matching_run(spec, runs)
        if run is not None:
            p = cal.from_run(run)
            say(f"profile: calibrated from run {run.id}, the latest finished {key} {run.spec_dict()['comm']['mode']} "
                f"run in the index (sync runs first)")
        else:
            say(f"profile: no finished {key} run in the index; measuring a {PROFILE_STEPS}-step single-process run")
            p = measure_profile(spec, runs, runner)
            say(f"profile: measured from run {p.source.split()[-1]}")
    if p.key() != key:
        raise SpecError("model", f"the profile is for {p.key()}, the spec is {key}")
    if ensure_curves(p, [spec]):
        say("profile: measured the compressor's encode/decode cost curve")
    p.save(saved if not profile else profile)
    return p


def link_file(path: str) -> dict:
    """A profile link from a saved ``commlab net check --json`` output."""
    try:
        return cal.link_from_net_check(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise SpecError("--link", f"no such file: {path}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError("--link", f"{path} is not `commlab net check --json` output ({type(e).__name__}: {e})") from None


def measure_profile(spec: dict, runs=None, runner: Optional[Callable[[dict], object]] = None) -> cal.Profile:
    import lab
    s = copy.deepcopy(spec)
    # one thread, as every rank of a 2-rank run on this 2-core machine runs
    s.update(name=f"profile {cal.spec_key(spec)}", world_size=1, steps=PROFILE_STEPS, eval_every=0, threads=1,
             network={"link": "loopback"}, comm={"mode": "sync"},
             compressor={"name": "none", "params": {}, "error_feedback": False})
    if "strategy" in s:  # the profiling run itself is fixed: none, sync
        s["strategy"] = {"mode": "fixed"}
    run = runner(s) if runner else lab.run(s, runs=runs)
    if run.state != "done":
        raise cal.CalibrationError(f"the profiling run {run.id} ended {run.state}: {run.log_tail(2)}")
    return cal.from_run(run, skip=min(cal.SKIP_STEPS, PROFILE_STEPS - 2))


def ensure_curves(profile: cal.Profile, specs) -> bool:
    added = False
    for s in specs:
        c = s["compressor"]
        k = cal.compressor_key(c)
        if c["name"] != "none" and k not in profile.compressors:
            profile.compressors[k] = cal.measure_compressor(c)
            added = True
    return added


def table(profile: cal.Profile, spec: dict, gbps: List[float], workers: List[int],
          compute_speedup: float = 1.0) -> List[dict]:
    rows = []
    base = pr.ddp_spec(spec)
    for p in workers:
        for g in gbps:
            t = pr.predict(profile, spec, g, p, compute_speedup)
            d = pr.predict(profile, base, g, p, compute_speedup)
            rows.append({"workers": p, "gbps": g, "ddp_ms": d.total * 1e3, "spec_ms": t.total * 1e3,
                         "speedup": d.total / t.total, "exposed_comm_ms": t.exposed_comm * 1e3,
                         "encode_decode_ms": t.encode_decode * 1e3})
    return rows


def format_table(rows: List[dict]) -> List[str]:
    head = ("WORKERS", "GBIT/S", "DDP ms", "SPEC ms", "SPEEDUP", "EXPOSED COMM ms", "ENC+DEC ms")
    cells = [head] + [(str(r["workers"]), f"{r['gbps']:g}", f"{r['ddp_ms']:.2f}", f"{r['spec_ms']:.2f}",
                       f"{r['speedup']:.2f}x", f"{r['exposed_comm_ms']:.2f}", f"{r['encode_decode_ms']:.2f}")
                      for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return ["  ".join(c.rjust(wi) for c, wi in zip(row, w)) for row in cells]


def crossover_line(profile: cal.Profile, spec: dict, workers: int, compute_speedup: float = 1.0) -> str:
    g = pr.crossover_gbps(profile, spec, workers, compute_speedup)
    if g is None:
        return f"{workers} workers: compression does not beat DDP at any bandwidth in 0.001..1000 Gbit/s"
    if g >= 1e3:
        return f"{workers} workers: it beats DDP at every bandwidth up to 1000 Gbit/s"
    return f"{workers} workers: it beats DDP below {g:.3g} Gbit/s"
