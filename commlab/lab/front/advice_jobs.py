"""The Advisor page's jobs: `commlab advise` started detached from the UI, followed, and its winner started.

runs/.advice/<id>/ holds one job: the spec and the request, the advise process's log, and, when it is done,
advice.json and best.yaml (commlab/lab/strategy/advisor.py writes them); ``start_winner`` queues the winner and DDP as one
group for the results view.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Optional

from commlab import api
from commlab.engine.cluster import PRESETS
from commlab.engine.runlog import write_json_atomic
from commlab.engine.spec import SpecError
from commlab.lab.analysis import presets
from commlab.lab.base import paths, procs
from commlab.lab.base.specs import load_spec, load_yaml, read_spec_file
from commlab.lab.rundir.store import RunStore, slug
from commlab.lab.service.spawn import spawn_detached
from commlab.lab.strategy.advisor import TRIALS
from commlab.lab.strategy.perfmodel.predict import ddp_spec
from commlab.lab.strategy.predictions import network_for


def spec_choices(runs) -> Dict[str, dict]:
    """label -> spec dict the Advisor page offers: the example specs, each preset's first run, and the
    specs of the latest finished runs (the advisor replaces their compressor, schedule and comm)."""
    out: Dict[str, dict] = {}
    for f in sorted((paths.SOURCE / "examples").glob("*.yaml")):
        data = load_yaml(f.read_text())
        if isinstance(data, dict) and "model" in data:
            out[f"example: {f.name}"] = data
    for p in presets.PRESETS:
        out[f"preset: {p.title}"] = p.specs()[0]
    done = [r for r in RunStore(runs).list()
            if r.state == "done" and not r.spec_dict()["name"].startswith(("advise trial", "advise to target",
                                                                              "profile "))]
    for r in done[-10:][::-1]:  # the latest ten finished runs, newest first
        out[f"run: {r.id}"] = r.spec_dict()
    valid = {}
    for k, d in out.items():
        try:
            d = {**d, "strategy": {"mode": "fixed"}}
            d.pop("network", None)  # the page picks the link
            valid[k] = load_spec(data=d).to_dict()
        except (SpecError, ValueError):
            continue  # an example that needs something this machine lacks is not offered
    return valid


def advise_argv(spec_file: Path, runs: Path, gbps: float, link: str, measure: bool, trials: int,
                out_dir: Path, target: Optional[float] = None, cluster: Optional[str] = None,
                workers: Optional[int] = None) -> List[str]:
    """``commlab advise``'s command line for a job: on a link of ``gbps``, or on the modeled ``cluster`` preset
    (then ``link`` and ``gbps`` are not passed: each worker has its own) at ``workers`` ranks."""
    import sys
    where = (["--cluster", cluster] + (["--workers", str(workers)] if workers else []) if cluster
             else ["--gbps", f"{gbps:g}", "--link", link])
    argv = [sys.executable, "-m", "commlab.lab.front.cli", "advise", str(spec_file), *where,
            "--runs", str(runs), "--json-out", str(out_dir / paths.ADVICE),
            "--out", str(out_dir / paths.ADVICE_BEST), "--top", "0"]
    return (argv + (["--measure", "target", "--trials", str(trials)] if measure else [])
            + (["--target", f"{target:g}"] if target else []))


def cluster_workers(spec: dict, cluster: str) -> Optional[int]:
    """The worker count to advise a cluster preset at: the spec's world size, or the preset's regions when it has
    more (a preset of regions takes at least one rank each); None when the spec's own fits."""
    regions = len(PRESETS[cluster]["workers"])
    return regions if regions > 1 and spec["world_size"] < regions else None


def start_job(spec: dict, runs, gbps: float, link: str, measure: bool, trials: int = TRIALS,
              target: Optional[float] = None, cluster: Optional[str] = None) -> str:
    """Run `commlab advise` detached (it outlives the page); the job's id under runs/.advice/. ``measure``:
    the to-target trials (commlab.lab.strategy.totarget); ``target``: the held-out accuracy to count to;
    ``cluster``: a cluster preset (commlab.engine.cluster.PRESETS) to plan for instead of one link."""
    import secrets
    if target is not None and not 0 < target <= 1:
        raise SpecError("target", f"must be a held-out accuracy in (0, 1], got {target}")
    if cluster is not None and cluster not in PRESETS:
        raise SpecError("cluster", f"unknown cluster preset {cluster!r}; allowed: {', '.join(PRESETS)}")
    if cluster is None:
        network_for({**spec, "network": {"link": "loopback", "gbps": None, "latency_us": None}}, gbps, link)
    workers = cluster_workers(spec, cluster) if cluster else None
    runs = Path(runs).resolve()
    jid = f"{time.strftime('%Y%m%d-%H%M%S')}-{slug(spec['name'])}-{secrets.token_hex(2)}"
    (runs / paths.ADVICE_JOBS).mkdir(parents=True, exist_ok=True)
    d = job_dir(runs, jid)
    d.mkdir()
    write_json_atomic(d / paths.ADVICE_SPEC, spec)
    write_json_atomic(d / paths.ADVICE_REQUEST, {"gbps": None if cluster else gbps, "link": "modeled" if cluster else link,
                                                 "cluster": cluster, "workers": workers, "measure": measure,
                                                 "trials": trials, "target": target, "created": time.time()})
    pid = spawn_detached(advise_argv(d / paths.ADVICE_SPEC, runs, gbps, link, measure, trials, d, target, cluster,
                                     workers),
                         d / paths.ADVICE_LOG, cwd=paths.SOURCE)
    write_json_atomic(d / paths.PROCESS, procs.identity(pid))
    return jid


def job_dir(runs, jid: str) -> Path:
    """The folder of advice job ``jid`` (a name made from a spec's name), never one outside runs/.advice/."""
    return paths.file_in(Path(runs) / paths.ADVICE_JOBS, jid)


def job(jid: str, runs) -> dict:
    """{id, state (running | done | failed), request, advice (when done), error, log}."""
    d = job_dir(runs, jid)
    if not (d / paths.ADVICE_REQUEST).is_file():
        raise KeyError(f"no advice job {jid!r} in {Path(runs) / paths.ADVICE_JOBS}")
    out = {"id": jid, "request": json.loads((d / paths.ADVICE_REQUEST).read_text()), "advice": None, "error": None}
    log = (d / paths.ADVICE_LOG).read_text(errors="replace") if (d / paths.ADVICE_LOG).is_file() else ""
    out["log"] = log
    if (d / paths.ADVICE).is_file():
        out["state"], out["advice"] = "done", json.loads((d / paths.ADVICE).read_text())
        out["best"] = str(d / paths.ADVICE_BEST)
    elif procs.alive(json.loads((d / paths.PROCESS).read_text())) if (d / paths.PROCESS).is_file() else False:
        out["state"] = "running"
    else:
        out["state"] = "failed"
        lines = [line for line in log.splitlines() if line.strip()]
        out["error"] = lines[-1] if lines else "the advise process ended without a word"
    return out


def jobs(runs) -> List[str]:
    d = Path(runs) / paths.ADVICE_JOBS
    if not d.is_dir():
        return []
    return [p.name for p in sorted(d.iterdir(), key=lambda p: p.name, reverse=True)
            if (p / paths.ADVICE_REQUEST).is_file()]


def table_rows(advice: dict) -> List[dict]:
    """The ranked candidates of an advice.json as table rows."""
    return [{"rank": i, "candidate": c["label"], "predicted_ms": c["predicted_ms"], "penalty": c["penalty"],
             "predicted_x_penalty": c["predicted_score"], "measured_ms": c["measured_ms"],
             "measured_x_penalty": c["measured_score"],
             "to_target_s": (c.get("to_target") or {}).get("seconds") or c.get("predicted_to_target_s"),
             "evidence": c.get("evidence", ""), "penalty_from": c["penalty_source"],
             "trial_run": c["trial_run"]} for i, c in enumerate(advice["candidates"], 1)]


def start_winner(jid: str, runs) -> dict:
    """Queue the winner and DDP (none, 25 MB buckets, wfbp) on the same link as one group for the results
    view; the group dict (id, title, runs: label -> run id)."""
    j = job(jid, runs)
    if j["state"] != "done":
        raise ValueError(f"advice {jid} is {j['state']}, not done")
    best = load_spec(data=read_spec_file(j["best"])).to_dict()
    ddp = load_spec(data={**ddp_spec(best), "name": f"{best['name']} (DDP)"}).to_dict()
    ids = {"advisor's choice": api.run({**best, "name": f"{best['name']} (advised)"}, wait=False, runs=runs).id,
           "DDP": api.run(ddp, wait=False, runs=runs).id}
    group = {"id": f"advice-{jid}", "preset": None, "title": f"advice {jid}: {j['advice']['winner']} vs DDP",
             "runs": ids, "created": time.time()}
    write_json_atomic(job_dir(runs, jid) / paths.ADVICE_GROUP, group)
    return group


def job_group(jid: str, runs) -> Optional[dict]:
    f = job_dir(runs, jid) / paths.ADVICE_GROUP
    return json.loads(f.read_text()) if f.is_file() else None
