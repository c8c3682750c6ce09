"""The ``commlab`` command.

Exit status: 0 on success, 2 for a bad spec or bad arguments (one line, no
traceback), 1 when a run fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from engine.spec import SpecError
from lab.analysis.trace import write_trace
from lab.base import procs
from lab.base.errors import LabError
from lab.base.paths import SOURCE
from lab.base.specs import load_spec
from lab.front import accounts, advise_cli, check_cli
from lab.front.jupyter import notebooks_main
from lab.front.sweep import Sweep, markdown
from lab.net import netcheck, netns
from lab.rundir.disturbance import describe, mark
from lab.rundir.launcher import JobRank, Nodes, launch, launch_rank
from lab.rundir.store import FINAL, RunStore
from lab.rundir.summary import format_summary, summarize
from lab.service.queue import Lab
from lab.strategy.perfmodel import devices, whatif
from lab.strategy.perfmodel.calibrate import CalibrationError
from lab.strategy.perfmodel.calibrate import spec_key


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage block too)
        raise UsageError(f"{self.prog}: {message}")


def _runs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", metavar="DIR", default=None,
                   help="runs directory (default: $COMMLAB_RUNS or ./runs)")


def add_spec_args(p, spec_help: str) -> None:
    """SPEC and its --set overrides, as every command that reads a spec takes them."""
    p.add_argument("spec", metavar="SPEC", help=spec_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a spec field, e.g. --set steps=50 --set compressor.name=none (repeatable)")


def build_parser() -> Parser:
    ap = Parser(prog="commlab", description="A lab for communication-efficient distributed training.")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    p = sub.add_parser("run", help="start a run, show progress, print its id and a summary")
    add_spec_args(p, "job spec file (YAML or JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--check", action="store_true", help="validate the spec, print it fully defaulted, and exit")
    g = p.add_argument_group("multi-node (torchrun static rendezvous; every node runs this command)")
    g.add_argument("--nnodes", type=int, default=None, help="number of machines")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1")
    g.add_argument("--master-addr", default=None, help="node 0's address, reachable from every node")
    g.add_argument("--master-port", type=int, default=29500, help="a free port on node 0")
    g.add_argument("--run-id", default=None, help="the run's name, the same on every node (shared runs dir)")
    _runs_arg(p)

    p = sub.add_parser("runs", help="list runs with status and headline figures")
    p.add_argument("--reindex", action="store_true", help="rebuild the index from the run directories first")
    for f in ("state", "model", "compressor", "schedule", "comm", "sweep", "owner"):
        p.add_argument(f"--{f}", default=None, help=f"only runs with this {f}")
    _runs_arg(p)

    p = sub.add_parser("cancel", help="stop a run in any state (queued or running)")
    p.add_argument("run", metavar="RUN", help="run id")
    _runs_arg(p)

    p = sub.add_parser("show", help="one run's summary")
    p.add_argument("run", metavar="RUN", help="run id")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _runs_arg(p)

    p = sub.add_parser("trace", help="write a Chrome/Perfetto trace of a run's timeline (all ranks)")
    p.add_argument("run", metavar="RUN", help="run id")
    p.add_argument("-o", "--output", default="trace.json", help="output file (default trace.json)")
    _runs_arg(p)
    p = sub.add_parser("report", help="write runs, a preset's result group or a comparison as one HTML file "
                                      "that opens offline")
    p.add_argument("runs_ids", metavar="RUN", nargs="*", help="run ids (two or more add a comparison)")
    p.add_argument("--group", default=None, metavar="GID", help="a preset's result group (the Results page's "
                   "group=...): its verdict and all its runs")
    p.add_argument("-o", "--output", default="report.html", help="output file (default report.html)")
    p.add_argument("--title", default=None, help="the report's title")
    _runs_arg(p)

    p = sub.add_parser("sweep", help="run a grid of specs through the queue and print a comparison table")
    p.add_argument("grid", metavar="GRID", help="sweep file (YAML or JSON): base spec, grid of values")
    p.add_argument("--table", action="store_true", help="only print the table of what has run so far")
    _runs_arg(p)

    p = sub.add_parser("app", help="start the Streamlit UI (bound to 127.0.0.1), with a demo run if there is none")
    p.add_argument("--port", type=int, default=8501, help="port (default 8501)")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the lab)")
    p.add_argument("--no-demo", action="store_true", help="do not queue the demo run into an empty runs directory")
    p.add_argument("--token", default=None, help="the class token students sign in with, when bound beyond "
                   "loopback (default: one generated and kept in RUNS/access.json)")
    p.add_argument("--certfile", default=None, help="TLS certificate (PEM) to serve https with; needs --keyfile")
    p.add_argument("--keyfile", default=None, help="the certificate's private key (PEM)")
    _runs_arg(p)

    p = sub.add_parser("notebooks", help="open the notebooks in JupyterLab (bound to 127.0.0.1), with this environment as kernel")
    p.add_argument("--port", type=int, default=8888, help="port (default 8888)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser; only print the URL (with its token)")
    _runs_arg(p)

    p = sub.add_parser("net", help="emulated cluster networks (shaped links)")
    netsub = p.add_subparsers(dest="net_cmd", metavar="NET_COMMAND", parser_class=Parser)
    netsub.required = True
    q = netsub.add_parser("check", help="build a shaped cluster, measure TCP and gloo all-reduce, tear it down")
    q.add_argument("--gbps", type=float, required=True, help="link rate in Gbit/s")
    q.add_argument("--ranks", type=int, default=2, help="ranks in the cluster (default 2)")
    q.add_argument("--seconds", type=float, default=3.0, help="TCP measurement time (default 3)")
    q.add_argument("--json", action="store_true", help="print the figures as JSON")
    q.add_argument("--save", action="store_true", help="keep the figures as the lab's shaped-link calibration "
                                                       "(the advisor's predictions for shaped links use it)")
    _runs_arg(q)
    netsub.add_parser("cleanup", help="remove the lab's namespaces left by dead launchers")

    p = sub.add_parser("profile", help="measure a model's per-layer forward/backward times and gradient sizes "
                                      "into a profile file (for commlab predict)")
    add_spec_args(p, "job spec file (YAML or JSON): model, data set, batch size; its compressor and comm mode "
                     "are what commlab predict PROFILE predicts")
    p.add_argument("-o", "--output", default="profile.json", help="profile file to write (default profile.json)")
    p.add_argument("--steps", type=int, default=None, help="steps of the single-process profiling run (default "
                                                           "12, the lab's own; the first 3 are left out)")
    _runs_arg(p)

    p = sub.add_parser("predict", help="the performance model: predicted iteration time, speedup over DDP and "
                                      "scaling factor")
    add_spec_args(p, "a profile file (commlab profile) or a job spec file (YAML or JSON); dear is accepted")
    p.add_argument("--gbps", default=None, help="link rates in Gbit/s, comma-separated (default 1,10,100,400); "
                                                "with --cluster: the inter-node rates")
    p.add_argument("--workers", default="2,8,64,1024", help="worker counts, comma-separated (default 2,8,64,1024)")
    p.add_argument("--cluster", metavar="KEY=VALUE,...", default=None,
                   help="a two-level cluster with hierarchical all-reduce: node_size=8,intra_gbps=1600,"
                        "inter_gbps=100 (optional intra_us, inter_us latencies per ring step, nics per node; "
                        "without inter_gbps, --gbps gives it)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--profile", metavar="FILE", help="a saved profile (JSON)")
    g.add_argument("--calibrate", metavar="RUN", help="calibrate compute from this run's timeline")
    p.add_argument("--link", metavar="FILE", help="alpha and beta from `commlab net check --gbps X --json` output")
    p.add_argument("--compute-speedup", type=float, default=1.0, metavar="X",
                   help="compute X times faster than measured, e.g. 20 for a GPU (default 1)")
    p.add_argument("--device", metavar="NAME[:PRECISION]", default=None,
                   help="predict on a GPU: V100, V100-PCIE, A100, H100, H200 or a YAML file describing one "
                        "(peak_tflops, memory_gb_s, nvlink_gb_s, ...); compute from the model's roofline on it "
                        "unless the profile was measured there, NCCL links, --gbps the NIC rate")
    _runs_arg(p)

    advise_cli.add_parser(sub, add_spec_args, _runs_arg)
    check_cli.add_parser(sub, _runs_arg)

    p = sub.add_parser("workshop", help="the workshop server's students: list them, revoke one, rotate tokens")
    wsub = p.add_subparsers(dest="ws_cmd", metavar="ACTION", parser_class=Parser)
    wsub.required = True
    q = wsub.add_parser("users", help="students who signed in (runs/access.json), with expiry and open sessions")
    _runs_arg(q)
    q = wsub.add_parser("revoke", help="revoke a student: their token and sessions end, the name and their "
                                       "browsers cannot sign in again; their runs keep going")
    q.add_argument("name", metavar="NAME", help="the student's name")
    q.add_argument("--rotate-class", action="store_true", help="also replace the class token (for someone who "
                   "would sign in again from a cleared browser); hand the new link to the others")
    _runs_arg(q)
    q = wsub.add_parser("rotate", help="replace a token: 'class', 'admin' or a student's name (their sessions "
                                       "end); prints the new link's token")
    q.add_argument("who", metavar="WHO", help="class | admin | NAME")
    _runs_arg(q)

    p = sub.add_parser("bench", help="run a benchmark from bench/ (e.g. commlab bench ddp_compare --models cnn)")
    p.add_argument("name", metavar="NAME", nargs="?", help="benchmark name; omit to list them")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    return ap


def bench_dir():
    return SOURCE / "bench"


def cmd_bench(args) -> int:
    import subprocess
    scripts = sorted(p.stem for p in bench_dir().glob("*.py") if p.stem not in ("__init__", "common"))
    if not args.name:
        print("benchmarks: " + ", ".join(scripts))
        return 0
    if args.name not in scripts:
        raise UsageError(f"commlab bench: unknown benchmark {args.name!r}; allowed: {', '.join(scripts)}")
    argv = [sys.executable, str(bench_dir() / f"{args.name}.py"), *args.args]
    return subprocess.run(argv, cwd=bench_dir().parent).returncode


def cmd_run(args) -> int:

    spec = load_spec(args.spec, args.overrides)
    if args.check:
        print(json.dumps(spec.to_dict(), indent=1))
        return 0
    lab = Lab(args.runs)
    auto = spec.strategy.mode == "auto" and not spec.strategy.decided
    if args.nnodes and auto:
        raise UsageError("commlab run: strategy: auto is chosen by the lab's own supervisor, not across nodes; "
                         "choose first with `commlab advise SPEC --out best.yaml` and run best.yaml")
    if args.nnodes:
        return run_node(lab, spec, args)
    try:
        job = JobRank.from_env()
    except ValueError as e:
        raise UsageError(f"commlab run: {e}") from None
    if job is not None and auto:
        raise UsageError("commlab run: strategy: auto is chosen by the lab's own supervisor, not inside a job "
                         "another launcher started; choose first with `commlab advise SPEC --out best.yaml`")
    if job is not None:  # torchrun, srun or a PyTorchJob started this process as one rank: join that job
        return run_joined(lab, spec, args, job)
    run = lab.create(spec, run_id=args.run_id)
    print(f"run {run.id}  ({run.path})", flush=True)
    try:
        state = lab.supervise(run, progress=not args.quiet)
    except KeyboardInterrupt:
        state = run.state
    return report(run, state)


def run_node(lab, spec, args) -> int:
    """One node of a multi-machine run. Node 0 creates the run and owns its status;
    the others join the same run directory (a shared file system) and run their ranks."""
    import time
    if not args.run_id or not args.master_addr:
        raise UsageError("commlab run: --nnodes needs --run-id and --master-addr (the same on every node)")
    try:
        nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    except ValueError as e:
        raise UsageError(f"commlab run: {e}") from None
    if args.node_rank == 0:
        run = lab.create(spec, run_id=args.run_id)
        run.set_status("queued", supervisor=procs.identity())
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
    print(f"run {run.id}  node {args.node_rank}/{args.nnodes}  ({run.path})", flush=True)
    state = launch(run, progress=not args.quiet and args.node_rank == 0, nodes=nodes)
    if args.node_rank > 0:
        print(f"node {args.node_rank}: {state}")
        return 0 if state == "done" else 1
    return report(run, state)


def run_joined(lab, spec, args, job) -> int:
    """One rank of a job that another launcher started (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    set). Every rank derives the same run id; rank 0 creates the run and owns its status, the
    others wait for it in the shared runs directory and run their rank."""
    import time
    if job.world != spec.world_size:
        raise UsageError(f"commlab run: world_size: the spec asks for {spec.world_size} ranks but this job has "
                         f"{job.world} (WORLD_SIZE); pass --set world_size={job.world}")
    run_id = args.run_id or job.run_id(spec.name)
    if job.rank == 0:
        run = lab.create(spec, run_id=run_id)
        run.set_status("queued", supervisor=procs.identity())
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
    print(f"run {run.id}  rank {job.rank}/{job.world}  ({run.path})", flush=True)
    state = launch_rank(run, job, progress=not args.quiet and job.rank == 0)
    if job.rank > 0:
        print(f"rank {job.rank}: {state}")
        return 0 if state == "done" else 1
    return report(run, state)


def report(run, state) -> int:
    st = run.status()
    print(f"status         {state}" + (f": rank {st.get('rank')}: {st.get('error')}" if state in ("failed", "diverged")
                                         else ""))
    spec = run.spec_dict()
    net = spec["network"]
    if net["link"] != "loopback":
        kind = "modeled (alpha-beta delays on loopback, not a real link)" if net["link"] == "modeled" else \
            "shaped (tc tbf between network namespaces)"
        print(f"network        {net['gbps']} Gbit/s, {kind}")
    for line in format_summary(summarize(run.metric_rows(), spec)):
        print(line)
    print(disturbance_line(st))
    return 0 if state == "done" else 1


def disturbance_line(status: dict) -> str:
    label, text = describe(status.get("disturbance"))
    return f"{label:<15}{text}"


def cmd_runs(args) -> int:
    lab = Lab(args.runs)
    if args.reindex:
        print(f"reindexed {lab.reindex()} runs from {lab.root}", file=sys.stderr)
    lab.recover_stale()
    filters = ("state", "model", "compressor", "schedule", "comm", "sweep", "owner")
    rows_db = lab.index.query(**{f: getattr(args, f) for f in filters})
    if not rows_db:
        print(f"no runs in {lab.root}" + (" matching the filters" if any(getattr(args, f) for f in filters) else ""))
        return 0
    rows = [("RUN", "STATUS", "MODEL", "COMPRESSOR", "SCHEDULE", "COMM", "STEPS", "ITER ms", "ACC", "OTHER CPU")]
    for r in rows_db:
        done = json.loads(r["summary"] or "{}").get("steps_done", 0)
        rows.append((r["id"], r["state"], r["model"], r["compressor"] + ("+EF" if r["error_feedback"] else ""),
                     r["schedule"], r["comm"], f"{done}/{r['steps']}",
                     f"{r['iter_ms']:.1f}" if r["iter_ms"] else "-",
                     f"{r['final_acc']:.2%}" if r["final_acc"] is not None else "-",
                     mark({"other_cpu": r["other_cpu"], "disturbed": r["disturbed"]})))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def cmd_sweep(args) -> int:
    sw = Sweep(Lab(args.runs), args.grid)
    df = sw.table() if args.table else sw.run()
    if len(df):
        print(markdown(df), end="")
        print(f"saved {sw.dir / 'table.csv'}")
    ok = len(df) and all(s == "done" for s in df["state"])
    return 0 if ok else 1


def cmd_report(args) -> int:
    from lab.analysis import results
    from lab.analysis.report import report_html
    lab = Lab(args.runs)
    group = None
    ids = list(args.runs_ids)
    if args.group:
        try:
            group = results.load_group(lab.root, args.group)
        except (KeyError, ValueError) as e:
            raise LabError(f"--group: {e.args[0] if e.args else e}") from None
        ids += [i for i in group["runs"].values() if i not in ids]
    if not ids:
        raise UsageError("commlab report: give run ids or --group GID")
    runs = [lab.store.get(i) for i in ids]
    html = report_html(runs, group=group, title=args.title, get=lab.store.get)
    with open(args.output, "w") as f:
        f.write(html)
    what = f"{len(runs)} run(s)" + (f", group {group['id']}" if group else "")
    print(f"wrote {args.output} ({len(html) / 2**20:.1f} MB, {what})")
    return 0


def cmd_app(args) -> int:
    from lab.front.ui import app_main
    return app_main(args.port, args.runs, args.host, demo=not args.no_demo, token=args.token,
                    certfile=args.certfile, keyfile=args.keyfile)


def cmd_notebooks(args) -> int:
    return notebooks_main(args.port, browser=not args.no_browser, runs=args.runs)


def _numbers(flag: str, text: str, kind, lo, hi) -> list:
    try:
        vals = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or not all(lo <= v <= hi for v in vals):
        raise UsageError(f"commlab predict: {flag} must be a comma-separated list of numbers in [{lo:g}, {hi:g}], "
                         f"got {text!r}")
    return vals


def cmd_profile(args) -> int:
    if args.steps is None:
        args.steps = whatif.PROFILE_STEPS
    if not 5 <= args.steps <= 10000:
        raise UsageError(f"commlab profile: --steps must be in 5..10000, got {args.steps}")
    spec = load_spec(args.spec, args.overrides).to_dict()
    print(f"profile: {spec['model']['name']} on {spec['dataset']['name']}, batch {spec['batch_size']}: a "
          f"{args.steps}-step single-process run", flush=True)
    try:
        prof = whatif.profile_spec(spec, args.runs, args.steps, runner=Lab(args.runs).runner())
    except CalibrationError as e:
        raise LabError(str(e)) from None
    prof.save(args.output)
    m = prof.machine
    print(f"measured on {m.get('host')} ({m.get('gpu') or m.get('cpu')}), {m.get('device')}, torch {m.get('torch')}, "
          f"{m.get('threads')} thread(s), {m.get('dtype')}, {m.get('clock')}, from {prof.source}")
    grad = sum(b for _, b in prof.params)
    print(f"forward {prof.forward_s * 1e3:.2f} ms, backward {prof.backward_s * 1e3:.2f} ms, optimizer "
          f"{prof.optimizer_s * 1e3:.2f} ms per step; {len(prof.params)} tensors, {grad / 2**20:.2f} MiB of gradients")
    slow = sorted(prof.layer_backward.items(), key=lambda kv: -kv[1])[:5]
    if slow:
        print("slowest layers in backward: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in slow))
    print(f"wrote {args.output} (commlab predict {args.output})")
    return 0


def cmd_predict(args) -> int:
    from lab.strategy.perfmodel import ondevice  # the roofline loads torch: not for commlab --help
    workers = _numbers("--workers", args.workers, int, 1, 100000)
    if not 0.001 <= args.compute_speedup <= 10000:
        raise UsageError(f"commlab predict: --compute-speedup must be in [0.001, 10000], got {args.compute_speedup}")
    # with --device, the device gives the node's size and fabric: --cluster may change any of them
    shape = whatif.parse_cluster(args.cluster, required=() if args.device else None) if args.cluster else None
    if shape and "inter_gbps" in shape:
        if args.gbps is not None:
            raise UsageError("commlab predict: --gbps and --cluster inter_gbps both give the inter-node rate; "
                             "give one")
        gbps = [shape["inter_gbps"]]
    else:
        gbps = _numbers("--gbps", args.gbps or "1,10,100,400", float, 0.001, 10000)
    dev = None
    if args.device:
        if args.compute_speedup != 1.0 or args.link:
            raise UsageError("commlab predict: --device models the device's compute and links; "
                             "--compute-speedup and --link are for a measured profile")
        try:
            dev, precision = devices.parse(args.device)
        except ValueError as e:
            raise UsageError(f"commlab predict: {e}") from None
        for p in workers:
            try:
                ondevice.topology(dev, 1.0, shape).nodes(p)
            except ValueError as e:
                raise SpecError("--workers", str(e).split(": ", 1)[1]) from None
    elif shape:
        whatif.check_workers(shape, workers)
    if whatif.is_profile_file(args.spec):
        if args.profile or args.calibrate:
            raise UsageError("commlab predict: PROFILE is a profile already; --profile and --calibrate are for a SPEC")
        prof = whatif.load_profile_file(args.spec)
        if not prof.spec:
            raise SpecError("PROFILE", f"{args.spec} records no spec (not written by commlab profile); use "
                                       f"commlab predict SPEC --profile {args.spec}")
        spec = whatif.load_for_prediction(data=prof.spec, overrides=args.overrides)
        if prof.key() != spec_key(spec):
            raise SpecError("--set", f"the profile is for {prof.key()}, the spec is now {spec_key(spec)}")
        m = prof.machine
        print(f"profile: {args.spec} ({prof.source}" + (f", {m.get('device')} on {m.get('host')}, torch {m.get('torch')}"
                                                       if m else "") + ")")
        if whatif.ensure_curves(prof, [spec]):
            prof.save(args.spec)
            print(f"profile: measured the compressor's encode/decode cost curve, added to {args.spec}")
    else:
        spec = whatif.load_for_prediction(args.spec, args.overrides)
        try:
            prof = whatif.resolve_profile(spec, args.runs, args.profile, args.calibrate,
                                          runner=Lab(args.runs).runner())
        except CalibrationError as e:
            raise LabError(str(e)) from None
    if args.link:
        if shape:
            raise UsageError("commlab predict: --link calibrates a flat link; --cluster gives its own links")
        prof.link = whatif.link_file(args.link)
    links = node_size = None
    if dev is not None:
        prof = ondevice.device_profile(prof, spec, dev, precision, say=print)
        links, node_size = ondevice.link_maker(dev, shape), ondevice.topology(dev, gbps[0], shape).gpus_per_node
        link = ondevice.topology(dev, gbps[0], shape).describe().replace(
            f"x {gbps[0] * dev.link_eff:g} Gbit/s", "x the GBIT/S column")
    elif shape:
        link = "two-level cluster, hierarchical all-reduce: " + whatif.cluster_at(shape, gbps[0]).describe()
        if "inter_gbps" not in shape:
            link = link.replace(f", {gbps[0]:g} between", ", the GBIT/S column between")
    else:
        link = (f"calibrated at {prof.link['nominal_gbps']:g} Gbit/s and scaled" if prof.link
                else "nominal alpha-beta (alpha 0, beta 8/rate; no link calibrated)")
    c = spec["compressor"]
    print(f"spec: {spec['model']['name']} batch {spec['batch_size']}, {c['name']}{' +EF' if c['error_feedback'] else ''}"
          f", {spec['schedule']['name']}, {spec['comm']['mode']}; vs DDP (none, bucket 25 MB, wfbp); link: {link}; "
          + (f"device {dev.name} {precision}" if dev else f"compute x{args.compute_speedup:g}"))
    rows = whatif.table(prof, spec, gbps, workers, args.compute_speedup, cluster=shape, links=links)
    for line in whatif.format_table(rows, "INTER GBIT/S" if shape or dev else "GBIT/S"):
        print(line)
    for p in workers:
        print(("crossover (inter-node rate): " if shape or dev else "crossover: ")
              + whatif.crossover_line(prof, spec, p, args.compute_speedup, cluster=shape, links=links,
                                      node_size=node_size))
    print("sources:")
    for line in ondevice.sources(prof, spec, dev, precision if dev else "", args.compute_speedup,
                                 cluster=bool(shape)):
        print("  " + line)
    return 0


def cmd_advise(args) -> int:
    return advise_cli.cmd_advise(args)


def cmd_net(args) -> int:
    try:
        netns.check_shaped_supported()
        if args.net_cmd == "cleanup":
            removed = netns.cleanup_stale()
            print(f"removed {len(removed)} stale namespace(s)" + (": " + ", ".join(removed) if removed else ""))
            return 0
        if not 0.001 <= args.gbps <= 400:
            raise UsageError(f"commlab net check: --gbps must be in [0.001, 400], got {args.gbps}")
        if not 2 <= args.ranks <= 64:
            raise UsageError(f"commlab net check: --ranks must be in 2..64, got {args.ranks}")
        r = netcheck.net_check(args.gbps, seconds=args.seconds, n_ranks=args.ranks,
                            out=None if args.json else sys.stdout)
    except netns.NetworkUnavailable as e:
        raise LabError(str(e)) from None
    if args.json:
        print(json.dumps(r, indent=1))
    if args.save:
        path = whatif.save_shaped_link(args.runs, r)
        print(f"saved the lab's shaped-link calibration: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_cancel(args) -> int:
    lab = Lab(args.runs)
    before = lab.store.get(args.run).state
    state = lab.cancel(args.run)
    if state in ("queued", "running"):
        state = lab.wait(args.run, timeout=30)
    print(f"{args.run}: {before} -> {state}")
    return 0


def cmd_show(args) -> int:
    run = RunStore(args.runs).get(args.run)
    spec, st = run.spec_dict(), run.status()
    s = summarize(run.metric_rows(), spec)
    if args.json:
        print(json.dumps({"id": run.id, "status": st, "summary": s, "spec": spec}, indent=1))
        return 0
    print(f"run            {run.id}")
    print(f"status         {st.get('state')}" + (f": rank {st.get('rank')}: {st.get('error')}" if st.get("error") else ""))
    c = spec["compressor"]
    params = ", ".join(f"{k}={v}" for k, v in c["params"].items())
    own = st.get("own_loop")  # commlab.wrap in the user's script: the model and data are the script's
    what = (f"own loop ({own.get('model')}, {own.get('params', 0):,} parameters)" if own else
            f"{spec['model']['name']} on {spec['dataset']['name']}")
    print(f"setup          {what}, world {spec['world_size']}, "
          f"{c['name']}{'(' + params + ')' if params else ''}{' +EF' if c['error_feedback'] else ''}, "
          f"{spec['schedule']['name']}, {spec['comm']['mode']}, {spec['network']['link']}")
    if own:
        print(f"script         {own.get('script')} (optimizer {own.get('optimizer')})")
    if st.get("started") and st.get("ended"):
        print(f"wall time      {st['ended'] - st['started']:.1f} s")
    for line in format_summary(s):
        print(line)
    print(disturbance_line(st))
    return 0


def cmd_trace(args) -> int:
    run = RunStore(args.runs).get(args.run)
    n = write_trace(run, args.output)
    print(f"wrote {n} events to {args.output} (open in ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_workshop(args) -> int:
    root = Lab(args.runs).root
    if args.ws_cmd == "users":
        people = accounts.people(root)
        if not people:
            print(f"no students in {accounts.access_path(root)}")
        for p in people:
            left = (p["expires"] - time.time()) / 86400
            print(f"{p['name']:<20} token {'expired' if left <= 0 else f'expires in {left:.1f} days'}, "
                  f"{p['sessions']} open session(s)")
        return 0
    if args.ws_cmd == "rotate":
        token = accounts.rotate(root, args.who)
        what = {"class": "class token (students who signed in keep theirs)",
                "admin": "admin token (the teacher's sessions ended)"}.get(args.who, f"{args.who}'s personal token "
                                                                                "(their sessions ended)")
        print(f"new {what}: {token}")
        return 0
    n = accounts.revoke(root, args.name)
    print(f"revoked {args.name} ({n} token(s)): their sessions end at their next request, the name and their "
          f"browsers cannot sign in again; their runs keep going (commlab runs --owner {args.name}, "
          f"commlab cancel RUN)")
    if args.rotate_class:
        print(f"new class token: {accounts.rotate(root, 'class')}")
    return 0


COMMANDS = {"workshop": cmd_workshop, "run": cmd_run, "runs": cmd_runs, "cancel": cmd_cancel, "sweep": cmd_sweep, "net": cmd_net,
            "app": cmd_app, "notebooks": cmd_notebooks, "show": cmd_show, "trace": cmd_trace,
            "bench": cmd_bench, "predict": cmd_predict, "profile": cmd_profile, "advise": cmd_advise,
            "report": cmd_report, "check": check_cli.cmd_check}


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.cmd](args)
    except (UsageError, SpecError, LabError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"commlab: error: {msg}" if not msg.startswith("commlab") else msg, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
