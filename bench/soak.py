"""A short soak of the job queue: many small jobs, random cancels, then a clean-up audit.

    python bench/soak.py [--jobs 40] [--max-jobs 2] [--cancel-fraction 0.3] [--seed 0]
                         [--runs DIR] [--timeout 900] [--keep] [--json out.json]

It submits ``--jobs`` small runs at once (mlp on digits, 2 ranks, 10-40
steps, one thread per rank, no evaluation) through ``commlab.lab.service.queue.Lab(runs,
max_jobs).submit(wait=False)``, i.e. one detached supervisor per run. About
one job in ten injects ``fault: {kind: raise, step: 3, rank: 1}`` and one in
twenty ``fault: {kind: nan}``, so the runs end in every final state. While the
queue drains it cancels ``--cancel-fraction`` of the jobs at random moments,
picking each victim from the runs' current states (queued or running, about
half each). Then it checks:

- final:       every run ends in done, failed, cancelled or diverged, within --timeout;
- expected:    the final state is the one the job asked for: done when clean, failed
               (rank 1) for ``raise``, diverged for ``nan``, cancelled when a cancel was
               requested before the run ended; a run that ends on its own while its cancel
               is on the way is accepted only if it ended within a poll or a stop's grace
               of the request and in its natural state;
- orphans:     no run was ever left queued or running with a dead supervisor;
- index:       Index.query() has exactly the runs on disk, and every column agrees
               with a fresh row built from the run directory (status.json, spec, metrics);
- reindex:     the same after deleting the index files and calling reindex();
- concurrency: at most ``max_jobs`` runs between started and ended at any moment
               (from status.json), and at most ``max_jobs`` seen running while polling;
- processes:   no recorded identity (ranks' pid files, torchrun, torchruns, supervisor)
               is alive, and no live process names the runs directory on its command line;
- netns:       no ``clab-`` network namespace of this soak is left (``clab-<pid>-...`` with
               the pid of one of its supervisors; only when ``ip`` exists);
- slots:       every slot lock under runs/.slots can be taken.

It prints a table (jobs, counts per final state, wall time, mean queue wait,
mean run time, max concurrency, checks) and exits 1 when a check fails. The
runs directory is a fresh temporary one unless --runs is given; a temporary
one is removed after a clean pass unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import prog  # noqa: E402
from commlab.lab.base import procs  # noqa: E402
from commlab.lab.base.paths import INDEX  # noqa: E402
from commlab.lab.base.specs import load_spec  # noqa: E402
from commlab.lab.rundir.index import COLUMNS, Index  # noqa: E402
from commlab.engine.runfiles import FINAL  # noqa: E402
from commlab.lab.service.queue import Lab, Slots  # noqa: E402

BASE = {"model": "mlp", "dataset": "digits", "world_size": 2, "batch_size": 16, "eval_every": 0, "threads": 1}
# how long after a cancel request a run may still end in its own state: the supervisor polls every
# 0.2 s; a run whose rank already failed sleeps 1 s and then stops the rest with a 5 s grace
NATURAL_END_LAG_S = {"done": 2.0, "failed": 8.0, "diverged": 8.0}
POLL_S = 0.2


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- the jobs

def make_jobs(n: int, rng: random.Random) -> list:
    """(name, spec dict, expected natural final state) for n jobs, faults at random positions."""
    n_raise = max(1, n // 10) if n >= 4 else 0
    n_nan = max(1, n // 20) if n >= 4 else 0
    order = list(range(n))
    rng.shuffle(order)
    raise_ix, nan_ix = set(order[:n_raise]), set(order[n_raise:n_raise + n_nan])
    jobs = []
    for i in range(n):
        steps = rng.randint(10, 40)
        d = dict(BASE, name=f"soak-{i:02d}", steps=steps, seed=i)
        expect = "done"
        if i in raise_ix:
            d["fault"] = {"kind": "raise", "step": 3, "rank": 1}
            expect = "failed"
        elif i in nan_ix:
            d["fault"] = {"kind": "nan", "step": rng.randint(3, 8), "rank": rng.randint(0, 1)}
            expect = "diverged"
        jobs.append({"name": d["name"], "spec": d, "expect": expect})
    return jobs


def cancel_plan(n_cancel: int, rng: random.Random) -> list:
    """When to cancel: after a fraction of the jobs have ended (the first ones at once), plus a jitter."""
    plan = []
    for k in range(n_cancel):
        at = 0.0 if k < max(1, n_cancel // 6) else rng.uniform(0.0, 0.85)
        plan.append({"progress": at, "jitter_s": rng.uniform(0.0, 4.0), "want": rng.choice(["queued", "running"])})
    return sorted(plan, key=lambda p: p["progress"])


# ---------------------------------------------------------------- the soak

def soak(args) -> dict:
    rng = random.Random(args.seed)
    root = Path(args.runs).resolve()
    root.mkdir(parents=True, exist_ok=True)
    netns_before = list_netns()
    q = Lab(root, max_jobs=args.max_jobs)
    jobs = make_jobs(args.jobs, rng)
    n_cancel = int(round(args.cancel_fraction * args.jobs))
    plan = cancel_plan(n_cancel, rng)

    log(f"soak: {args.jobs} jobs, max_jobs {q.max_jobs}, {n_cancel} cancels planned, seed {args.seed}, runs {root}")
    t0 = time.time()
    for job in jobs:
        job["run"] = q.submit(load_spec(data=job["spec"]), wait=False)
        job["id"] = job["run"].id
    log(f"submitted {len(jobs)} jobs in {time.time() - t0:.1f}s")

    by_id = {j["id"]: j for j in jobs}
    cancels, orphans, suspect = [], {}, {}
    peak_running, next_print, armed = 0, 0.0, None
    deadline = t0 + args.timeout
    timed_out = False
    while True:
        now = time.time()
        states = {j["id"]: j["run"].state for j in jobs}
        n_final = sum(s in FINAL for s in states.values())
        running_now = sum(s == "running" for s in states.values())
        peak_running = max(peak_running, running_now)

        # a live run must always have a live supervisor
        for rid, s in states.items():
            if s in FINAL or rid in orphans:
                continue
            sup = by_id[rid]["run"].status().get("supervisor")
            if not procs.alive(sup) and by_id[rid]["run"].state not in FINAL:
                suspect.setdefault(rid, now)
                if now - suspect[rid] > 3.0:
                    orphans[rid] = {"state": s, "supervisor": sup, "seen_at": round(now - t0, 2)}
                    log(f"ORPHAN: {rid} is {s} but its supervisor {sup} is gone")
            else:
                suspect.pop(rid, None)

        # the next planned cancel, once its moment has come
        if plan and armed is None and n_final >= plan[0]["progress"] * len(jobs):
            armed = now + plan[0]["jitter_s"]
        if plan and armed is not None and now >= armed:
            p = plan.pop(0)
            armed = None
            pools = {k: [rid for rid, s in states.items() if s == k and rid not in {c["id"] for c in cancels}]
                     for k in ("queued", "running")}
            kind = p["want"] if pools[p["want"]] else ("running" if p["want"] == "queued" else "queued")
            if pools[kind]:
                rid = rng.choice(pools[kind])
                before = by_id[rid]["run"].state
                tc = time.time()
                after = q.cancel(rid)
                cancels.append({"id": rid, "name": by_id[rid]["name"], "state_seen": kind, "state_before": before,
                                "returned": after, "time": tc, "at_s": round(tc - t0, 2)})
                log(f"  cancel {by_id[rid]['name']} ({rid}) while {before} at {tc - t0:.1f}s -> {after}")
            else:
                log(f"  cancel skipped at {now - t0:.1f}s: nothing queued or running")

        if now >= next_print or n_final == len(jobs):
            counts = {s: sum(v == s for v in states.values()) for s in ("queued", "running") + FINAL}
            log(f"t={now - t0:6.1f}s  " + "  ".join(f"{k} {v}" for k, v in counts.items())
                + f"  | cancels {len(cancels)}/{n_cancel}")
            next_print = now + args.print_every
        if n_final == len(jobs) and not plan:
            break
        if n_final == len(jobs) and plan:
            log(f"  {len(plan)} planned cancels left unused: every job already ended")
            plan.clear()
            break
        if now > deadline:
            timed_out = True
            log(f"TIMEOUT after {args.timeout}s; cancelling what is left")
            for j in jobs:
                if j["run"].state not in FINAL:
                    q.cancel(j["id"])
            t_end = time.time() + 60
            while time.time() < t_end and any(j["run"].state not in FINAL for j in jobs):
                time.sleep(POLL_S)
            break
        time.sleep(POLL_S)
    t_all_final = time.time()
    wall = t_all_final - t0

    # give exiting supervisors a moment: a supervisor writes the final status, then releases its slot and exits
    linger_deadline = time.time() + 15
    while time.time() < linger_deadline and any(live_identities(j["run"]) for j in jobs):
        time.sleep(0.1)
    linger_s = time.time() - t_all_final

    return audit(args, q, root, jobs, cancels, orphans, netns_before, timed_out, wall, linger_s, peak_running)


# ---------------------------------------------------------------- the checks

def live_identities(run) -> list:
    st = run.status()
    idents = list(run.worker_pids()) + [st.get("torchrun"), st.get("supervisor")] + list(st.get("torchruns") or [])
    return [i for i in idents if procs.alive(i)]


def stray_processes(root: Path) -> list:
    """Live (non-zombie) processes other than this one whose command line names the runs directory."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        cl = procs.cmdline(int(d.name))
        if str(root) in cl and procs.start_time(int(d.name)) is not None:
            out.append({"pid": int(d.name), "cmdline": cl[:200]})
    return out


def list_netns() -> list:
    if not shutil.which("ip"):
        return None
    try:
        p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sorted(line.split()[0] for line in p.stdout.splitlines() if line.strip().startswith("clab-"))


def _ns_owner(name: str) -> int:
    parts = name.split("-")
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else -1


def index_disagreements(index: Index, runs) -> list:
    """Where the index differs from rows built afresh from the run directories."""
    rows = {r["id"]: r for r in index.query()}
    out = []
    disk = {r.id: r for r in runs}
    for rid in sorted(set(rows) - set(disk)):
        out.append(f"{rid}: in the index but not on disk")
    for rid, run in sorted(disk.items()):
        want = Index.row_of(run)
        got = rows.get(rid)
        if got is None:
            out.append(f"{rid}: on disk ({want['state']}) but not in the index")
            continue
        for c in COLUMNS:
            if got.get(c) != want.get(c):
                g, w = str(got.get(c))[:80], str(want.get(c))[:80]
                out.append(f"{rid}: {c} index={g} directory={w}")
    return out


def max_overlap(spans) -> int:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    level = top = 0
    for _, d in events:
        level += d
        top = max(top, level)
    return top


def judge(job, cancel) -> str:
    """'' when the final state is the expected one, else why not."""
    st = job["run"].status()
    state = st.get("state")
    natural = job["expect"]
    if cancel is None or cancel["returned"] in FINAL:
        if state != natural:
            return f"expected {natural}, got {state} ({st.get('error')})"
        if natural == "failed" and st.get("rank") != 1:
            return f"failed as expected but blamed rank {st.get('rank')} (fault on rank 1): {st.get('error')}"
        return ""
    if state == "cancelled":
        return ""
    lag = (st.get("ended") or 0) - cancel["time"]
    if cancel["state_before"] == "queued" and st.get("started") is None:
        return f"cancelled while queued but ended {state} without starting"
    if state == natural and lag <= NATURAL_END_LAG_S.get(state, 0):
        job["ended_before_cancel_took_effect"] = round(lag, 3)
        return ""
    return (f"cancel requested while {cancel['state_before']} at +{cancel['at_s']}s, but the run ended {state} "
            f"{lag:.2f}s later (natural outcome {natural}; error: {st.get('error')})")


def audit(args, q, root, jobs, cancels, orphans, netns_before, timed_out, wall, linger_s, peak_running) -> dict:
    checks = {}

    def check(name, ok, detail):
        checks[name] = {"ok": bool(ok), "detail": detail}

    states = {j["id"]: j["run"].state for j in jobs}
    not_final = {rid: s for rid, s in states.items() if s not in FINAL}
    check("final", not not_final and not timed_out,
          f"{len(jobs) - len(not_final)}/{len(jobs)} final" + (f"; not final: {not_final}" if not_final else "")
          + ("; timed out" if timed_out else ""))

    cancel_of = {c["id"]: c for c in cancels}
    wrong = {}
    for j in jobs:
        why = judge(j, cancel_of.get(j["id"]))
        if why:
            wrong[j["id"]] = why
    check("expected", not wrong, "all as expected" if not wrong else wrong)
    check("orphans", not orphans, "none" if not orphans else orphans)

    # stale recovery must find nothing either (it would mark a run failed)
    stale = q.recover_stale()
    check("no stale", not stale, "none" if not stale else stale)

    disk_runs = q.store.list()
    dis = index_disagreements(q.index, disk_runs)
    check("index", not dis and len(disk_runs) == len(jobs),
          f"{len(disk_runs)} runs agree" if not dis else dis[:20] + [f"... {len(dis) - 20} more"] * (len(dis) > 20))
    before = {r["id"]: r for r in q.index.query()}
    for suffix in ("", "-wal", "-shm"):
        Path(str(root / INDEX) + suffix).unlink(missing_ok=True)
    n = q.reindex()
    dis2 = index_disagreements(q.index, disk_runs)
    after = {r["id"]: r for r in q.index.query()}
    same = before == after
    check("reindex", not dis2 and n == len(disk_runs) and same,
          f"{n} rows rebuilt, identical to the live index" if not dis2 and same else
          {"disagreements": dis2[:20], "identical_to_live_index": same, "rows": n})

    spans = []
    for j in jobs:
        st = j["run"].status()
        if st.get("started") is not None and st.get("ended") is not None:
            spans.append((st["started"], st["ended"]))
    top = max_overlap(spans)
    check("concurrency", top <= q.max_jobs and peak_running <= q.max_jobs,
          f"max {top} from status times, {peak_running} seen polling (limit {q.max_jobs})")

    live = {j["id"]: live_identities(j["run"]) for j in jobs}
    live = {k: v for k, v in live.items() if v}
    strays = stray_processes(root)
    check("processes", not live and not strays,
          f"none alive ({linger_s:.1f}s after the last run ended)" if not live and not strays else
          {"recorded_alive": live, "unrecorded": strays})

    netns_after = list_netns()
    if netns_after is None:
        check("netns", True, "skipped: no `ip`")
    else:
        # clab-<pid>-...: <pid> is the process that built the cluster (a run's supervisor)
        mine = {os.getpid()} | {int((j["run"].status().get("supervisor") or {}).get("pid") or 0) for j in jobs}
        ours = [n for n in netns_after if _ns_owner(n) in mine]
        others = sorted(set(netns_after) - set(ours))
        check("netns", not ours, (f"no clab- namespace of this soak; others' ({len(others)}): "
                                  f"{sorted({_ns_owner(n) for n in others})} owner pids, "
                                  f"{len(set(others) - set(netns_before or []))} appeared during the soak"
                                  if others else "no clab- namespace") if not ours else ours)

    fds = []
    slots = Slots(root, q.max_jobs)
    try:
        for _ in range(q.max_jobs):
            fd = slots.try_acquire()
            if fd is None:
                break
            fds.append(fd)
        got = len(fds)
    finally:
        for fd in fds:
            Slots.release(fd)
    check("slots", got == q.max_jobs, f"{got}/{q.max_jobs} slot locks free")

    # ---- figures
    counts = {s: sum(v == s for v in states.values()) for s in FINAL}
    waits, runs_s, order = [], [], []
    for j in jobs:
        st = j["run"].status()
        if st.get("started") is not None:
            waits.append(st["started"] - st["created"])
            order.append((st["created"], st["started"]))
            if st.get("ended") is not None:
                runs_s.append(st["ended"] - st["started"])
    order.sort()
    inversions = sum(1 for a in range(len(order)) for b in range(a + 1, len(order)) if order[b][1] < order[a][1])
    cancel_kinds = {k: sum(c["state_before"] == k for c in cancels) for k in ("queued", "running")}
    figures = {
        "jobs": len(jobs), "max_jobs": q.max_jobs, "seed": args.seed, "cancel_fraction": args.cancel_fraction,
        "states": counts,
        "faults": {k: sum(j["expect"] == k for j in jobs) for k in ("failed", "diverged")},
        "cancel_requests": len(cancels), "cancel_requests_by_state": cancel_kinds,
        "cancelled_requests_honoured": sum(states[c["id"]] == "cancelled" for c in cancels),
        "ended_before_cancel_took_effect": {j["name"]: j["ended_before_cancel_took_effect"] for j in jobs
                                            if "ended_before_cancel_took_effect" in j},
        "started": len(waits), "wall_s": round(wall, 1),
        "mean_queue_wait_s": round(statistics.mean(waits), 2) if waits else None,
        "max_queue_wait_s": round(max(waits), 2) if waits else None,
        "mean_run_s": round(statistics.mean(runs_s), 2) if runs_s else None,
        "max_run_s": round(max(runs_s), 2) if runs_s else None,
        "max_concurrency": top, "peak_running_polled": peak_running,
        "start_order_inversions": inversions, "linger_s": round(linger_s, 2),
    }
    return {"figures": figures, "checks": checks, "cancels": [{k: v for k, v in c.items()} for c in cancels],
            "runs": [{"id": j["id"], "name": j["name"], "steps": j["spec"]["steps"], "fault": j["spec"].get("fault"),
                      "expect": j["expect"], "state": states[j["id"]],
                      **{k: j["run"].status().get(k) for k in ("created", "started", "ended", "error", "rank")}}
                     for j in jobs]}


def report(res: dict) -> None:
    f, checks = res["figures"], res["checks"]
    rows = [("jobs", f"{f['jobs']} (max_jobs {f['max_jobs']}, seed {f['seed']}; faults: "
                     f"{f['faults']['failed']} raise, {f['faults']['diverged']} nan)"),
            *[(f"  {s}", str(n)) for s, n in f["states"].items()],
            ("cancel requests", f"{f['cancel_requests']} (while queued {f['cancel_requests_by_state']['queued']}, "
                                f"while running {f['cancel_requests_by_state']['running']}; "
                                f"{f['cancelled_requests_honoured']} ended cancelled)"),
            ("wall time", f"{f['wall_s']} s"),
            ("mean queue wait", f"{f['mean_queue_wait_s']} s (max {f['max_queue_wait_s']} s, {f['started']} started)"),
            ("mean run time", f"{f['mean_run_s']} s (max {f['max_run_s']} s)"),
            ("max concurrency", f"{f['max_concurrency']} (polled peak {f['peak_running_polled']})"),
            ("start order inversions", str(f["start_order_inversions"])),
            ("checks passed", f"{sum(c['ok'] for c in checks.values())}/{len(checks)}")]
    print("| figure | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    print("\n| check | result | detail |\n|---|---|---|")
    for name, c in checks.items():
        d = c["detail"] if isinstance(c["detail"], str) else json.dumps(c["detail"])[:300]
        print(f"| {name} | {'pass' if c['ok'] else 'FAIL'} | {d} |")
    for name, c in checks.items():
        if not c["ok"] and not isinstance(c["detail"], str):
            print(f"\n{name} failed:\n{json.dumps(c['detail'], indent=1)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=prog(__file__), description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=40)
    ap.add_argument("--max-jobs", type=int, default=2)
    ap.add_argument("--cancel-fraction", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", help="runs directory (default: a fresh temporary one)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for every job to end (default 900)")
    ap.add_argument("--print-every", type=float, default=5.0, help="seconds between progress lines")
    ap.add_argument("--keep", action="store_true", help="keep the temporary runs directory")
    ap.add_argument("--json", help="write the figures, checks and per-run rows here")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.max_jobs < 1 or not 0 <= args.cancel_fraction <= 1 or args.timeout <= 0:
        ap.error("--jobs and --max-jobs must be >= 1, --cancel-fraction in [0, 1], --timeout > 0")
    tmp = None
    if not args.runs:
        tmp = args.runs = tempfile.mkdtemp(prefix="commlab-soak-")
    res = soak(args)
    res["command"] = " ".join([os.path.relpath(sys.argv[0], REPO) if sys.argv[0] else "bench/soak.py", *sys.argv[1:]])
    res["runs_dir"] = str(Path(args.runs).resolve())
    report(res)
    ok = all(c["ok"] for c in res["checks"].values())
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
        print(f"\nwrote {args.json}")
    if tmp and ok and not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"runs directory: {res['runs_dir']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
