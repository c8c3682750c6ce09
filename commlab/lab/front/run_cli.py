"""The run commands of ``commlab``: ``run`` (start one, follow its progress, print its summary; one node of a
multi-node job), ``runs`` (list them), ``cancel``, ``show``, ``trace``, ``report`` and ``sweep``."""
from __future__ import annotations

import getpass
import json
import os
import re
import shlex
import sys
import time
from typing import Optional

from commlab.engine.runfiles import FINAL, STATES
from commlab.engine.spec import COMM_AVAILABLE, LINKS_AVAILABLE, SCHEDULES_AVAILABLE
from commlab.lab.analysis import cluster_view, replicas
from commlab.lab.analysis.trace import write_trace
from commlab.lab.base import procs
from commlab.lab.base.errors import LabError
from commlab.lab.base.specs import admit_spec
from commlab.lab.front.cli_kit import (
    UsageError,
    add_spec_args,
    command,
    emit,
    json_arg,
    lab_of,
    notes,
    one_of,
    out_file,
    run_document,
    runs_arg,
    runs_root,
    store_of,
)
from commlab.lab.front.sweep import Sweep, markdown
from commlab.lab.rundir.disturbance import describe, mark
from commlab.lab.rundir.ftrun import request_fault, write_script
from commlab.lab.rundir.launcher import JobRank, Nodes, launch, launch_rank
from commlab.lab.rundir.progress import quiet
from commlab.lab.rundir.summary import format_summary, summarize, what_ran
from commlab.lab.strategy import ftsearch
from commlab.room import open_lab


def add_commands(sub) -> None:
    """The run commands' parsers, in the order ``commlab --help`` lists them."""
    p = command(sub, "run", "start a run, show its progress, print its id and a summary",
                ["commlab run examples/demo.yaml", "commlab run examples/demo.yaml --set steps=50 --set "
                 "compressor.name=topk --set compressor.ratio=0.01", "commlab run examples/demo.yaml --check"],
                "The run is queued in the runs directory, supervised by this process and kept there "
                "(commlab show RUN). Exits 1 when the run fails, 130 when Ctrl-C cancels it. Closing the output "
                "(| head) never stops the run: it goes on to its end, then the command exits 141.")
    add_spec_args(p, "job spec file (YAML or JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--check", action="store_true", help="validate the spec, print it fully defaulted (JSON), "
                                                         "and exit")
    p.add_argument("--script", default=None, metavar="'SCRIPT [ARGS]'",
                   help="with fault_tolerance: each replica group runs this script of yours (its training loop "
                        "calls commlab.wrap) instead of the lab's trainer; the lab starts the Lighthouse, the "
                        "replicas and their restarts, and executes the faults")
    json_arg(p, "the run's id, status, summary and spec")
    g = p.add_argument_group("multi-node (torchrun static rendezvous; every node runs this command)")
    g.add_argument("--nnodes", type=int, default=None, help="number of machines")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1")
    g.add_argument("--master-addr", default=None, help="node 0's address, reachable from every node")
    g.add_argument("--master-port", type=int, default=29500, help="a free port on node 0")
    g.add_argument("--run-id", default=None, help="the run's name, the same on every node (shared runs dir)")
    runs_arg(p)
    p.set_defaults(func=cmd_run, cmd_parser=p)

    p = command(sub, "runs", "list runs with status and headline figures",
                ["commlab runs", "commlab runs --state failed --comm dear", "commlab runs --json"],
                "Filters are exact matches, combined with AND.")
    p.add_argument("--reindex", action="store_true", help="rebuild the index from the run directories first")
    for flag, what, allowed in (("--state", "a state", STATES), ("--schedule", "a schedule", SCHEDULES_AVAILABLE),
                                ("--comm", "a comm mode", COMM_AVAILABLE), ("--link", "a link", LINKS_AVAILABLE)):
        p.add_argument(flag, default=None, type=one_of(what, allowed), choices=allowed, metavar=flag[2:].upper(),
                       help=f"only runs with this {flag[2:]}: {', '.join(allowed)}")
    p.add_argument("--compressor", default=None, metavar="NAME",
                   help="only runs with this compressor (a registry name or pkg.module:Class)")
    for f in ("model", "dataset", "sweep", "owner"):
        p.add_argument(f"--{f}", default=None, metavar=f.upper(), help=f"only runs with this {f}")
    json_arg(p, "the runs (their index rows)")
    runs_arg(p)
    p.set_defaults(func=cmd_runs, cmd_parser=p)

    p = command(sub, "cancel", "stop a run that is queued or running",
                ["commlab cancel 20250101-120000-demo-ab12"],
                "Waits up to 30 s for the run to stop. A run that has ended already is an error (exit 2).")
    p.add_argument("run", metavar="RUN", help="run id")
    json_arg(p, "the run's state before and after")
    runs_arg(p)
    p.set_defaults(func=cmd_cancel, cmd_parser=p)

    p = command(sub, "fault", "kill, cut off or slow down a worker of a running fault-tolerant run",
                ["commlab fault 20250101-120000-ft-ab12 --kill 2",
                 "commlab fault 20250101-120000-ft-ab12 --kill 1 --restart-after 5",
                 "commlab fault 20250101-120000-ft-ab12 --cut 1 --seconds 10",
                 "commlab fault 20250101-120000-ft-ab12 --slow 0 --speed 0.5 --seconds 30"],
                "The run goes on with the other replica groups. A killed one is restarted after --restart-after "
                "seconds (default: the spec's fault_tolerance.restart.delay_s) while restarts are left, and "
                "recovers its state from a live peer; a cut one is stopped for --seconds (no traffic, no "
                "heartbeat), then goes on and recovers; a slowed one computes at --speed of its speed for "
                "--seconds (and the others wait for it at every exchange). Waits up to 30 s for the run to "
                "record it.")
    p.add_argument("run", metavar="RUN", help="run id")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--kill", type=int, metavar="REPLICA", help="the replica group to kill (0-based)")
    which.add_argument("--cut", type=int, metavar="REPLICA", help="the replica group to cut off (0-based)")
    which.add_argument("--slow", type=int, metavar="REPLICA", help="the replica group to slow down (0-based)")
    p.add_argument("--restart-after", type=float, default=None, metavar="S",
                   help="with --kill: seconds before the lab starts it again")
    p.add_argument("--seconds", type=float, default=None, metavar="S",
                   help="with --cut or --slow: how long it is cut off or slow")
    p.add_argument("--speed", type=float, default=None, metavar="X",
                   help="with --slow: the share of its speed it computes at, in [0.01, 1)")
    json_arg(p, "the request and what the run recorded")
    runs_arg(p)
    p.set_defaults(func=cmd_fault, cmd_parser=p)

    p = command(sub, "show", "one run's summary", ["commlab show 20250101-120000-demo-ab12",
                                                   "commlab show 20250101-120000-demo-ab12 --json"])
    p.add_argument("run", metavar="RUN", help="run id")
    json_arg(p, "the run's id, status, summary and spec")
    runs_arg(p)
    p.set_defaults(func=cmd_show, cmd_parser=p)

    p = command(sub, "trace", "write a Chrome/Perfetto trace of a run's timeline (all ranks)",
                ["commlab trace 20250101-120000-demo-ab12 -o trace.json"],
                "Open the file in ui.perfetto.dev or chrome://tracing.")
    p.add_argument("run", metavar="RUN", help="run id")
    p.add_argument("-o", "--output", default="trace.json", metavar="FILE",
                   help="output file; its folder must exist")
    json_arg(p, "the output's path and event count")
    runs_arg(p)
    p.set_defaults(func=cmd_trace, cmd_parser=p)

    p = command(sub, "explain", "why a run's step took its time: the critical path, each collective's skew, latency "
                                "and wire time, stragglers, and against another run what would make it pay",
                ["commlab explain RUN", "commlab explain RUN --against BASELINE", "commlab explain RUN --steps 20:40 --json",
                 "commlab explain --trace traces/ --gbps 10"],
                "Reads the run's timeline files; a running run is explained up to its last written step. With --trace, "
                "explains your own job's PyTorch profiler traces (one file per rank, or their folder) instead.")
    p.add_argument("run", metavar="RUN", nargs="?", default=None, help="run id (not with --trace)")
    p.add_argument("--trace", action="append", default=None, metavar="FILE",
                   help="a PyTorch profiler (Kineto) trace, one per rank, or a folder of them (repeatable)")
    p.add_argument("--gbps", type=float, default=None, help="with --trace: the link's rate per rank in Gbit/s, to "
                   "split each collective's time into wire time and the rest")
    p.add_argument("--latency-us", type=float, default=None, help="with --trace: one message's latency in µs")
    p.add_argument("--against", default=None, metavar="RUN", help="another run: the difference part by part, and "
                   "the codec speed or link rate at which the slower one breaks even")
    p.add_argument("--steps", default=None, metavar="FIRST:LAST", help="the steps to explain (default: all after "
                   "the warm-up)")
    json_arg(p, "the explanation (and the comparison) as one JSON document")
    runs_arg(p)
    p.set_defaults(func=cmd_explain, cmd_parser=p)

    p = command(sub, "report", "write runs, a preset's result group or a comparison as one HTML file that "
                               "opens offline",
                ["commlab report RUN -o report.html", "commlab report RUN1 RUN2 --title 'topk vs none'",
                 "commlab report --group GID"])
    p.add_argument("runs_ids", metavar="RUN", nargs="*", help="run ids (two or more add a comparison)")
    p.add_argument("--group", default=None, metavar="GID", help="a preset's result group (the Results page's "
                   "group=...): its verdict and all its runs")
    p.add_argument("-o", "--output", default="report.html", metavar="FILE",
                   help="output file; its folder must exist")
    p.add_argument("--title", default=None, help="the report's title (default: from the runs)")
    json_arg(p, "the output's path, size and runs")
    runs_arg(p)
    p.set_defaults(func=cmd_report, cmd_parser=p)

    p = command(sub, "sweep", "run a grid of specs through the queue and print a comparison table",
                ["commlab sweep examples/sweep.yaml", "commlab sweep examples/sweep.yaml --table --json"],
                "Running the same grid again resumes it: cells whose run is done are skipped. Exits 1 unless "
                "every cell's run is done.")
    p.add_argument("grid", metavar="GRID", help="sweep file (YAML or JSON): base spec, grid of values")
    p.add_argument("--table", action="store_true", help="only print the table of what has run so far")
    json_arg(p, "the table (one object per cell)")
    runs_arg(p)
    p.set_defaults(func=cmd_sweep, cmd_parser=p)


def cmd_run(args) -> int:
    # a rank of a job that torchrun, srun or a PyTorchJob started trains in this process: it checks its spec here
    spec = admit_spec(args.spec, args.overrides, here=not args.nnodes and JobRank.present())
    if args.check:
        print(json.dumps(spec.to_dict(), indent=1))
        return 0
    script = own_script(args.script, spec) if args.script is not None else None
    lab = lab_of(args)
    auto = spec.strategy.mode == "auto" and not spec.strategy.decided
    if args.nnodes and auto:
        raise UsageError("strategy: auto is chosen by the lab's own supervisor, not across nodes; "
                         "choose first with `commlab advise SPEC --out best.yaml` and run best.yaml")
    if args.nnodes:
        return run_node(lab, spec, args, script)
    try:
        job = JobRank.from_env()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if job is not None and auto:
        raise UsageError("strategy: auto is chosen by the lab's own supervisor, not inside a job "
                         "another launcher started; choose first with `commlab advise SPEC --out best.yaml`")
    if job is not None:  # torchrun, srun or a PyTorchJob started this process as one rank: join that job
        return run_joined(lab, spec, args, job)
    progress = quiet(sys.stderr)  # the progress stream: closed early, it only goes quiet (commlab/lab/rundir/progress.py)
    say = None if args.quiet else (lambda m: print(m, file=progress, flush=True))
    run = lab.create(spec, run_id=args.run_id, say=say, supervisor=procs.identity())
    if script is not None:  # before the launch: the replicas read it as they start
        write_script(run, script, os.getcwd())
    print(f"run {run.id}  ({run.path})", file=notes(args), flush=True)
    try:
        state = lab.supervise(run, progress=not args.quiet, out=progress)
    except KeyboardInterrupt:  # Ctrl-C before the launch: the summary of what there is, then status 130
        state = run.state
    return report(run, state, args)


def own_script(line: str, spec) -> list:
    """``--script``'s argv (the script first, then its arguments), or a UsageError naming what is missing."""
    try:
        argv = shlex.split(line)
    except ValueError as e:
        raise UsageError(f"--script: {e}") from None
    if not spec.fault_tolerance.enabled:
        raise UsageError("--script: runs your own loop as the replica groups of a fault-tolerant run "
                         "(fault_tolerance.enabled: true); without fault tolerance start it with torchrun")
    if ftsearch.needs_search(spec):
        raise UsageError(f"--script: schedule {spec.schedule.name} under fault tolerance is searched before the "
                         "replicas start, on the spec's model, which your loop does not build; use layerwise, "
                         "allinone or bucket")
    if not argv or not os.path.isfile(argv[0]):
        raise UsageError(f"--script: {argv[0] if argv else 'nothing'} is not a file (give the script's path "
                         "first, then its arguments)")
    return argv


def run_node(lab, spec, args, script: Optional[list] = None) -> int:
    """One node of a multi-machine run. Node 0 creates the run and owns its status;
    the others join the same run directory (a shared file system) and run their ranks. ``script`` (``--script``, a
    fault-tolerant run of your own loop): node 0 writes it into the run before it starts the Lighthouse, and every
    node's replica groups run it (each node reads it once the Lighthouse serves), from node 0's folder."""
    if ftsearch.needs_search(spec):
        raise UsageError(f"schedule.name: {spec.schedule.name} under fault tolerance is searched before the replicas "
                         "start, by one machine's run; across nodes use layerwise, allinone or bucket")
    if not args.run_id or not args.master_addr:
        raise UsageError("--nnodes needs --run-id and --master-addr (the same on every node)")
    try:
        nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.node_rank == 0:
        run = lab.create(spec, run_id=args.run_id, supervisor=procs.identity(),
                         ranks_here=spec.world_size // args.nnodes)
        if script is not None:
            write_script(run, script, os.getcwd())
    else:
        t0 = time.time()
        while True:  # node 0 may not have created it yet
            try:
                run = lab.store.get(args.run_id)
                break
            except LabError:
                if time.time() - t0 > 60:
                    raise
                time.sleep(0.5)
    print(f"run {run.id}  node {args.node_rank}/{args.nnodes}  ({run.path})", file=notes(args), flush=True)
    state = launch(run, progress=not args.quiet and args.node_rank == 0, nodes=nodes)
    if args.node_rank > 0:
        print(f"node {args.node_rank}: {state}", file=notes(args))
        return 0 if state == "done" else 1
    return report(run, state, args)


def run_joined(lab, spec, args, job) -> int:
    """One rank of a job that another launcher started (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    set). Every rank derives the same run id; rank 0 creates the run and owns its status, the
    others wait for it in the shared runs directory and run their rank."""
    if job.world != spec.world_size:
        raise UsageError(f"world_size: the spec asks for {spec.world_size} ranks but this job has "
                         f"{job.world} (WORLD_SIZE); pass --set world_size={job.world}")
    run_id = args.run_id or job.run_id(spec.name)
    if job.rank == 0:
        run = lab.create(spec, run_id=run_id, supervisor=procs.identity(), ranks_here=0)  # the job's launcher's
    else:
        t0 = time.time()
        while True:  # rank 0 may not have created it yet; a finished run of that name is not ours
            try:
                run = lab.store.get(run_id)
                if run.state not in FINAL:
                    break
            except LabError:
                pass
            if time.time() - t0 > 120:
                raise LabError(f"rank {job.rank}: no live run {run_id!r} in {lab.root} after 120 s; is the runs "
                               f"directory shared, and did rank 0 start (a finished run of that name: use --run-id)?")
            time.sleep(0.5)
    print(f"run {run.id}  rank {job.rank}/{job.world}  ({run.path})", file=notes(args), flush=True)
    state = launch_rank(run, job, progress=not args.quiet and job.rank == 0)
    if job.rank > 0:
        print(f"rank {job.rank}: {state}", file=notes(args))
        return 0 if state == "done" else 1
    return report(run, state, args)


def report(run, state, args) -> int:
    """A finished run's summary (or its JSON document); 0 when it is done, else 1."""
    if args.json:
        emit(run_document(run))
        return 0 if state == "done" else 1
    st = run.status()
    print(f"status         {status_text(state, st if state in ('failed', 'diverged') else {})}")
    spec = run.spec_dict()
    print(setup_line(spec, st))
    chosen = strategy_line(st)
    if chosen:
        print(chosen)
    net = spec["network"]
    if net["link"] != "loopback" or net.get("cluster"):
        kind = {"modeled": "modeled (alpha-beta delays on loopback, not a real link)",
                "shaped": "shaped (tc tbf between network namespaces)",
                "loopback": "loopback"}[net["link"]]
        rate = cluster_text(net["cluster"]) if net.get("cluster") else f"{net['gbps']:g} Gbit/s"
        print(f"network        {rate}, {kind}")
    rows = run.metric_rows()
    for line in format_summary(summarize(rows, spec, st)):
        print(line)
    if net.get("cluster"):
        print(f"waits          {cluster_view.describe(cluster_view.cluster_view(spec, rows))}")
    print(disturbance_line(st))
    return 0 if state == "done" else 1


def link_text(net: dict) -> str:
    """``loopback``, or a link with its rate: ``modeled 0.1 Gbit/s``; a cluster's by its preset: ``modeled
    three_continents``, or ``modeled cluster``."""
    link = net.get("link") or "loopback"
    if net.get("cluster"):
        return f"{link} {net['cluster'].get('preset') or 'cluster'}"
    return link if link == "loopback" or net.get("gbps") is None else f"{link} {net['gbps']:g} Gbit/s"


def cluster_text(cl: dict) -> str:
    """A resolved network.cluster in a few words: its preset, workers, the range of their rates, delays and
    speeds."""
    ws = cl["workers"]

    def span(key, unit):
        vals = [w[key] for w in ws if w[key] is not None]
        if not vals:
            return None
        lo, hi = min(vals), max(vals)
        return f"{lo:g}{unit}" if lo == hi else f"{lo:g}-{hi:g}{unit}"
    parts = [p for p in (span("gbps_up", " Gbit/s up"), span("gbps_down", " Gbit/s down"),
                         span("delay_ms", " ms"), span("speed", " speed")) if p]
    name = f"cluster {cl['preset']}" if cl.get("preset") else "cluster"
    return f"{name} of {len(ws)} workers ({', '.join(parts)})"


def setup_line(spec: dict, st: dict) -> str:
    """What ran: the model and data (an own loop's, from its status), the world, the strategy (spec.json
    holds strategy auto's choice once it is made), and the link with its rate."""
    c = spec["compressor"]
    params = ", ".join(f"{k}={v}" for k, v in c["params"].items())
    return (f"setup          {what_ran(spec, st)}, world {spec['world_size']}, "
            f"{c['name']}{'(' + params + ')' if params else ''}{' +EF' if c['error_feedback'] else ''}, "
            f"{spec['schedule']['name']}, {spec['comm']['mode']}, {link_text(spec['network'])}")


def strategy_line(st: dict):
    """strategy auto: what the advisor chose and how (status.json's ``strategy``); None for a fixed strategy."""
    s = st.get("strategy")
    if not isinstance(s, dict):
        return None
    how = [s["by"]] if s.get("by") else []
    if isinstance(s.get("cost_s"), (int, float)):
        how.append(f"{s['cost_s']:.1f} s of advice")
    return f"strategy       auto chose {s.get('chosen') or 'nothing yet'}" + (f" ({', '.join(how)})" if how else "")


def status_text(state, status: dict) -> str:
    """The state, and the error in ``status`` if any, with the rank it names (a launcher's or the queue's
    own error names none)."""
    if not status.get("error"):
        return str(state)
    rank = status.get("rank")
    return f"{state}: " + (f"rank {rank}: " if rank is not None else "") + str(status["error"])


def disturbance_line(status: dict) -> str:
    label, text = describe(status.get("disturbance"))
    return f"{label:<15}{text}"


def cmd_runs(args) -> int:
    if args.compressor and ":" not in args.compressor:
        from commlab.engine.compressors import names
        if args.compressor not in names():
            raise UsageError(f"--compressor: {args.compressor!r} is not a compressor; allowed: "
                             f"{', '.join(names())} or pkg.module:Class")
    filters = ("state", "model", "dataset", "compressor", "schedule", "comm", "link", "sweep", "owner")
    root = runs_root(args, create=False)
    rows_db = []
    if root.is_dir():
        lab = open_lab(root)
        if args.reindex:
            print(f"reindexed {lab.reindex()} runs from {lab.root}", file=sys.stderr)
        lab.recover_stale()
        rows_db = lab.index.query(**{f: getattr(args, f) for f in filters})
    if args.json:
        emit([{**r, "spec": json.loads(r["spec"] or "{}"), "summary": json.loads(r["summary"] or "{}")}
              for r in rows_db])
        return 0
    if not rows_db:
        print(f"no runs in {root}" + (" (no such directory)" if not root.is_dir() else "")
              + (" matching the filters" if any(getattr(args, f) for f in filters) else ""))
        return 0
    rows = [("RUN", "STATUS", "MODEL", "COMPRESSOR", "SCHEDULE", "COMM", "LINK", "STEPS", "ITER ms", "ACC",
             "OTHER CPU")]
    for r in rows_db:
        done = json.loads(r["summary"] or "{}").get("steps_done", 0)
        net = json.loads(r["spec"] or "{}").get("network") or {"link": r["link"]}
        rows.append((r["id"], r["state"], r["model"], r["compressor"] + ("+EF" if r["error_feedback"] else ""),
                     r["schedule"], r["comm"], link_text(net),
                     f"{done}/{r['steps']}" if r["steps"] is not None else f"{done}",
                     f"{r['iter_ms']:.1f}" if r["iter_ms"] else "-",
                     f"{r['final_acc']:.2%}" if r["final_acc"] is not None else "-",
                     mark({"other_cpu": r["other_cpu"], "disturbed": r["disturbed"]})))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def cmd_cancel(args) -> int:
    lab = open_lab(runs_root(args, create=False))
    before = lab.store.get(args.run).state
    if before in FINAL:
        raise UsageError(f"RUN: {args.run} is already {before}; nothing to cancel")
    state = lab.cancel(args.run)
    if state in ("queued", "running"):
        state = lab.wait(args.run, timeout=30)
    if args.json:
        emit({"id": args.run, "before": before, "state": state})
    else:
        print(f"{args.run}: {before} -> {state}")
    return 0 if state in FINAL else 1


def cmd_fault(args) -> int:
    want = "cut" if args.cut is not None else "slow" if args.slow is not None else "kill"
    replica = {"cut": args.cut, "slow": args.slow, "kill": args.kill}[want]
    if want == "cut" and args.seconds is None:
        raise UsageError("--seconds: how long the replica is cut off (--cut needs it)")
    if want == "slow" and (args.seconds is None or args.speed is None):
        raise UsageError(f"--{'speed' if args.seconds is not None else 'seconds'}: --slow needs --speed (the share "
                         "of its speed) and --seconds (how long)")
    if want == "kill" and args.seconds is not None:
        raise UsageError("--seconds: only a cut (--cut) or a slowdown (--slow) lasts a number of seconds")
    if want != "slow" and args.speed is not None:
        raise UsageError("--speed: only a slowdown (--slow) has a speed")
    run = store_of(args).get(args.run)
    seen = len(run.ft_events())
    try:
        req = request_fault(run, replica, args.restart_after, by=getpass.getuser(), seconds=args.seconds,
                            speed=args.speed)
    except ValueError as e:
        raise UsageError(str(e)) from None
    verb = {"cut": "cut off", "slow": "slowed down", "kill": "killed"}[want]
    deadline = time.monotonic() + 30
    done = None
    while done is None and time.monotonic() < deadline:
        done = next((e for e in run.ft_events()[seen:] if e.get("requested") and e.get("replica") == replica
                     and e["event"] in (want, "refused")), None)
        if done is None:
            time.sleep(0.2)
    if args.json:
        emit({"id": run.id, "request": req, "recorded": done})
    elif done is None:
        print(f"{run.id}: asked to {want} replica {replica}; the run has not recorded it within 30 s")
    elif done["event"] == "refused":
        print(f"{run.id}: replica {replica} was not {verb}: {done['why']}")
    elif want == "cut":
        print(f"{run.id}: cut off replica {replica} (pid {done['pid']}) for {args.seconds:g} s; then it goes on and "
              "recovers from a live peer")
    elif want == "slow":
        print(f"{run.id}: replica {replica} computes at {args.speed:g} of its speed for {args.seconds:g} s, from its "
              "next step")
    else:
        after = "the spec's restart delay" if args.restart_after is None else f"{args.restart_after:g} s"
        print(f"{run.id}: killed replica {replica} (pid {done['pid']}); the lab restarts it after {after} while "
              "restarts are left")
    return 0 if done is not None and done["event"] == want else 1


def cmd_show(args) -> int:
    run = store_of(args).get(args.run)
    doc = run_document(run)
    if args.json:
        emit(doc)
        return 0
    spec, st = doc["spec"], doc["status"]
    print(f"run            {run.id}")
    print(f"status         {status_text(st.get('state'), st)}")
    print(setup_line(spec, st))
    chosen = strategy_line(st)
    if chosen:
        print(chosen)
    own = st.get("own_loop")
    if own:
        print(f"script         {own.get('script')} (optimizer {own.get('optimizer')})")
    if st.get("started") and st.get("ended"):
        print(f"wall time      {st['ended'] - st['started']:.1f} s")
    for line in format_summary(doc["summary"]):
        print(line)
    if "replicas" in doc:
        rep = doc["replicas"]
        sizes = [q["participants"] for q in rep["quorums"]]
        print(f"replicas       {replicas.describe(rep['states'])}")
        if sizes:
            print(f"quorum         {min(sizes)} to {max(sizes)} replica groups over {len(sizes)} quorums; "
                  f"{len(rep['recoveries'])} recoveries after the start")
    if "cluster" in doc:
        print(f"network        {cluster_text(spec['network']['cluster'])}")
        print(f"waits          {cluster_view.describe(doc['cluster'])}")
    print(disturbance_line(st))
    return 0


def cmd_trace(args) -> int:
    out_file("--output", args.output)
    run = store_of(args).get(args.run)
    n = write_trace(run, args.output)
    if args.json:
        emit({"output": args.output, "events": n, "run": run.id})
    else:
        print(f"wrote {n} events to {args.output} (open in ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_explain(args) -> int:
    steps = None
    if args.steps is not None:
        m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", args.steps)
        if not m or int(m.group(1)) > int(m.group(2)):
            raise UsageError(f"--steps: FIRST:LAST with FIRST <= LAST, e.g. 20:40; got {args.steps!r}")
        steps = (int(m.group(1)), int(m.group(2)))
    from commlab.lab.analysis import explain  # lazy: pandas, for this command only
    if args.trace:
        return _explain_trace(args, steps, explain)
    if args.run is None:
        raise UsageError("explain: give a run id, or --trace FILE for your own job's profiler trace")
    if args.gbps is not None or args.latency_us is not None:
        raise UsageError("--gbps and --latency-us go with --trace: a run's link is in its spec")
    store = store_of(args)
    run = store.get(args.run)
    try:
        ex = explain.explain_run(run, steps=steps)
        other = explain.explain_run(store.get(args.against), steps=steps) if args.against else None
    except explain.NothingToExplain as e:
        raise LabError(f"explain: {e}") from None
    diff = explain.compare(other, ex, args.against, run.id) if other is not None else None
    if args.json:
        emit({"run": run.id, "explanation": ex.to_dict(), **({"against": args.against,
              "comparison": diff} if diff else {})})
        return 0
    for line in explain.report_lines(ex, run.id):
        print(line)
    if diff:
        print()
        print(f"against        {args.against}")
        for line in diff["sentences"]:
            print(f"  {line}")
    return 0


def _explain_trace(args, steps, explain) -> int:
    from commlab.lab.analysis import kineto  # lazy: pandas, for this command only
    if args.run is not None or args.against:
        raise UsageError("explain: --trace explains the trace alone (no RUN, no --against)")
    for name, v, lo, hi in (("--gbps", args.gbps, 0.001, 1e5), ("--latency-us", args.latency_us, 0, 1e6)):
        if v is not None and not lo <= v <= hi:
            raise UsageError(f"{name}: must be in [{lo:g}, {hi:g}], got {v:g}")
    frame = kineto.read_trace(args.trace if len(args.trace) > 1 else args.trace[0])
    ranks = int(frame["rank"].nunique()) if len(frame) else 1
    network = {"link": "modeled", "gbps": args.gbps, "latency_us": args.latency_us} if args.gbps else {}
    try:
        ex = explain.explain_frame(frame, {"world_size": ranks, "network": network}, steps=steps)
    except explain.NothingToExplain as e:
        raise LabError(f"explain: {e}") from None
    if args.json:
        emit({"trace": args.trace, "explanation": ex.to_dict()})
        return 0
    for line in explain.report_lines(ex, ", ".join(args.trace)):
        print(line)
    return 0


def cmd_report(args) -> int:
    from commlab.lab.analysis import results
    from commlab.lab.analysis.report import report_html
    out_file("--output", args.output)
    store = store_of(args)
    group = None
    ids = list(args.runs_ids)
    if args.group:
        try:
            group = results.load_group(store.root, args.group)
        except (KeyError, ValueError) as e:
            raise LabError(f"--group: {e.args[0] if e.args else e}") from None
        ids += [i for i in group["runs"].values() if i not in ids]
    if not ids:
        raise UsageError("give run ids or --group GID (see 'commlab report --help')")
    runs = [store.get(i) for i in ids]
    html = report_html(runs, group=group, title=args.title, get=store.get)
    with open(args.output, "w") as f:
        f.write(html)
    size = os.path.getsize(args.output)
    if args.json:
        emit({"output": args.output, "bytes": size, "runs": ids, "group": group["id"] if group else None})
        return 0
    what = f"{len(runs)} run(s)" + (f", group {group['id']}" if group else "")
    print(f"wrote {args.output} ({size / 2**20:.1f} MB, {what})")
    return 0


def cmd_sweep(args) -> int:
    sw = Sweep(lab_of(args), args.grid)
    df = sw.table() if args.table else sw.run()
    if args.json:
        emit(json.loads(df.reset_index().to_json(orient="records")) if len(df) else [])
    elif len(df):
        print(markdown(df), end="")
        print(f"saved {sw.dir / 'table.csv'}")
    else:
        print(f"sweep {sw.id}: no runs yet (commlab sweep {args.grid} runs them)")
    ok = len(df) and all(s == "done" for s in df["state"])
    return 0 if ok else 1
