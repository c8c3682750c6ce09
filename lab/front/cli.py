"""The ``commlab`` command: one parser (``build_parser``) and a thin function per command.

It follows the conventions of torchrun, git and pip:

- ``commlab --version`` (``-V``) prints ``commlab X.Y.Z``; a bare ``commlab`` prints the usage and a hint
  on stderr and exits 2. Every help page has a description, examples and the options' defaults.
- Every error is one line on stderr, ``commlab: error: <what>``: argparse's, a bad spec's (``field:
  problem``, a YAML file's ``FILE:LINE:COL: problem``), a bad path's (the option and the path), never a
  traceback. Arguments (files to read, the folders of files to write, filter values) are checked before
  any work starts; no folder is created for an output file.
- Commands that print results take ``--json``: one JSON document on stdout, and nothing else there
  (progress and notes go to stderr).
- ``commlab completion bash|zsh`` prints a shell completion script made from this parser.

Exit status:

    0    success
    1    the work failed: a run ended failed, cancelled or diverged (run, sweep), a benchmark failed, or a
         file could not be written mid-way (the message names it)
    2    bad arguments or a bad spec (nothing was started), including an unknown filter value
         (``runs --state bogus``) and a cancel with nothing to cancel (``cancel`` on a finished run:
         "already done")
    130  interrupted (Ctrl-C): one line on stderr; a run so stopped is cancelled and its summary printed
    141  stdout was closed early (``commlab runs | head -1``): the output stops quietly, as a tool killed
         by SIGPIPE would
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import importlib.metadata
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional

import tomllib
import yaml

from engine.runlog import write_json_atomic
from engine.spec import COMM_AVAILABLE, LINKS_AVAILABLE, SCHEDULES_AVAILABLE, JobSpec, SpecError
from lab.analysis.trace import write_trace
from lab.base import procs
from lab.base.errors import LabError
from lab.base.paths import SOURCE, default_root
from lab.base.specs import load_spec
from lab.front import accounts, check_cli, completion
from lab.front.jupyter import notebooks_main
from lab.front.sweep import Sweep, markdown
from lab.net import netcheck, netns
from lab.rundir.disturbance import describe, mark
from lab.rundir.launcher import JobRank, Nodes, launch, launch_rank
from lab.rundir.store import FINAL, STATES, RunStore
from lab.rundir.summary import format_summary, summarize
from lab.service.queue import Lab
from lab.strategy import advisor
from lab.strategy.advisor import LINKS, TRIAL_STEPS, TRIALS
from lab.strategy.perfmodel import devices, predict, whatif
from lab.strategy.perfmodel.calibrate import CalibrationError, compressor_key, spec_key

ROOT = SOURCE
INTERRUPTED, CLOSED_PIPE = 130, 141


class UsageError(Exception):
    """Bad arguments: one line, exit status 2."""


# --------------------------------------------------------------------------- the parser

class Help(argparse.HelpFormatter):
    """Examples as written; every option that has a default says it, unless its help already states
    one in words."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if not action.option_strings or "default" in h or d is None or d is False or d == [] or d is argparse.SUPPRESS:
            return h
        return f"{h} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line (argparse would print the usage block too), as ``FIELD: problem``, with a pointer to
        this command's help when the message does not list what is allowed."""
        message = re.sub(r"^argument ", "", message)
        m = re.match(r"(?P<dest>[^:]+): invalid choice: (?P<v>.+?) \(choose from (?P<c>.*)\)$", message)
        if m:  # only commands have bare choices (options check theirs with one_of)
            value, allowed = m["v"].strip("'"), [c.strip(" '") for c in m["c"].split(",")]
            close = difflib.get_close_matches(value, allowed, n=1)
            message = f"{value!r} is not a {self.prog} command" + (f"; did you mean {close[0]!r}?" if close else "")
        if "allowed:" not in message:
            message += f" (see '{self.prog} --help')"
        raise UsageError(message)


def version() -> str:
    """The installed distribution's version, else the checkout's pyproject.toml's."""
    try:
        return importlib.metadata.version("commlab")
    except importlib.metadata.PackageNotFoundError:
        try:
            with open(ROOT / "pyproject.toml", "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def command(sub, name: str, summary: str, examples: Iterable[str] = (), more: str = "") -> Parser:
    """A subcommand with its one-line summary (in the parent's list), a description (the summary and
    ``more``) and an epilog of example invocations."""
    text = summary[0].upper() + summary[1:] + "." + (" " + more if more else "")
    epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples) if examples else None
    return sub.add_parser(name, help=summary, description=text, epilog=epilog,
                          formatter_class=Help)


def group(p: Parser, title: str, dest: str, metavar: str) -> argparse._SubParsersAction:
    """A command made of sub-commands (net, workshop); given none, it prints its usage and a hint."""
    p.set_defaults(func=None, cmd_parser=p)
    return p.add_subparsers(title=title, dest=dest, metavar=metavar, parser_class=Parser)


def one_of(what: str, allowed: Iterable[str]) -> Callable[[str], str]:
    """An argument type that takes only ``allowed``, and says which in one line."""
    allowed = tuple(allowed)

    def check(value: str) -> str:
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}; allowed: {', '.join(allowed)}")
        return value
    return check


def runs_arg(p) -> None:
    p.add_argument("--runs", metavar="DIR", default=None,
                   help="runs directory (default: $COMMLAB_RUNS, else ./runs; created when a run is made)")


def json_arg(p, what: str = "the results") -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON document on stdout "
                                                        "(notes and progress go to stderr)")


def add_spec_args(p, spec_help: str) -> None:
    """SPEC and its --set overrides, as every command that reads a spec takes them."""
    p.add_argument("spec", metavar="SPEC", help=spec_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a spec field, e.g. --set steps=50 --set compressor.name=none (repeatable)")


def build_parser() -> Parser:
    ap = Parser(prog="commlab", formatter_class=Help,
                description="commlab: a lab for communication-efficient distributed training (gradient "
                            "compression, fusion schedules, overlapped collectives, local updates).",
                epilog="examples:\n  commlab run examples/demo.yaml\n  commlab runs --state done\n"
                       "  commlab app\n\nexit status: 0 success, 1 the work failed (a run failed), 2 bad "
                       "arguments or spec,\n130 interrupted, 141 output pipe closed. "
                       "Run 'commlab COMMAND --help' for a command's options.")
    ap.add_argument("-V", "--version", action="version", version=f"commlab {version()}",
                    help="print the version and exit")
    ap.set_defaults(func=None, cmd_parser=ap)
    sub = ap.add_subparsers(title="commands", dest="cmd", metavar="COMMAND", parser_class=Parser)

    p = command(sub, "run", "start a run, show its progress, print its id and a summary",
                ["commlab run examples/demo.yaml", "commlab run examples/demo.yaml --set steps=50 --set "
                 "compressor.name=topk --set compressor.ratio=0.01", "commlab run examples/demo.yaml --check"],
                "The run is queued in the runs directory, supervised by this process and kept there "
                "(commlab show RUN). Exits 1 when the run fails, 130 when Ctrl-C cancels it.")
    add_spec_args(p, "job spec file (YAML or JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--check", action="store_true", help="validate the spec, print it fully defaulted (JSON), "
                                                         "and exit")
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

    p = command(sub, "app", "start the Streamlit UI (bound to 127.0.0.1), with a demo run if there is none",
                ["commlab app", "commlab app --port 8600 --no-demo",
                 "commlab app --host 0.0.0.0 --certfile cert.pem --keyfile key.pem"],
                "Any address beyond loopback serves a workshop: students sign in with the class token. "
                "SIGINT, SIGTERM or SIGHUP stops it cleanly.")
    p.add_argument("--port", type=int, default=8501, help="port")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the lab)")
    p.add_argument("--no-demo", action="store_true", help="do not queue the demo run into an empty runs directory")
    p.add_argument("--token", default=None, help="the class token students sign in with, when bound beyond "
                   "loopback (default: one generated and kept in RUNS/access.json)")
    p.add_argument("--certfile", default=None, metavar="FILE", help="TLS certificate (PEM) to serve https with; "
                                                                    "needs --keyfile")
    p.add_argument("--keyfile", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    runs_arg(p)
    p.set_defaults(func=cmd_app, cmd_parser=p)

    p = command(sub, "notebooks", "open the notebooks in JupyterLab (bound to 127.0.0.1), with this environment "
                                  "as kernel", ["commlab notebooks", "commlab notebooks --port 8890 --no-browser"],
                "Prints the URL with its token; Ctrl-C or SIGTERM stops the server and its kernels.")
    p.add_argument("--port", type=int, default=8888, help="port")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser; only print the URL (with its "
                                                             "token)")
    runs_arg(p)
    p.set_defaults(func=cmd_notebooks, cmd_parser=p)

    p = command(sub, "net", "emulated cluster networks (shaped links; needs root)",
                ["sudo commlab net check --gbps 1", "sudo commlab net cleanup"])
    netsub = group(p, "net commands", "net_cmd", "COMMAND")
    q = command(netsub, "check", "build a shaped cluster, measure TCP and gloo all-reduce, tear it down",
                ["sudo commlab net check --gbps 1", "sudo commlab net check --gbps 0.1 --json > link.json",
                 "sudo commlab net check --gbps 1 --save"], "Needs root, ip and tc (Linux).")
    q.add_argument("--gbps", type=float, required=True, help="link rate in Gbit/s, in [0.001, 400]")
    q.add_argument("--ranks", type=int, default=2, help="ranks in the cluster, 2..64")
    q.add_argument("--seconds", type=float, default=3.0, help="TCP measurement time (s)")
    json_arg(q, "the figures")
    q.add_argument("--save", action="store_true", help="keep the figures as the lab's shaped-link calibration "
                                                       "(the advisor's predictions for shaped links use it)")
    runs_arg(q)
    q.set_defaults(func=cmd_net, cmd_parser=q)
    q = command(netsub, "cleanup", "remove the lab's namespaces left by dead launchers",
                ["sudo commlab net cleanup"])
    json_arg(q, "the removed namespaces")
    q.set_defaults(func=cmd_net, cmd_parser=q)

    p = command(sub, "profile", "measure a model's per-layer forward/backward times and gradient sizes into a "
                                "profile file (for commlab predict)",
                ["commlab profile examples/demo.yaml -o resnet.json", "commlab predict resnet.json --workers 8,64"],
                "A single-process run of the spec's model, data set and batch size on this machine.")
    add_spec_args(p, "job spec file (YAML or JSON): model, data set, batch size; its compressor and comm mode "
                     "are what commlab predict PROFILE predicts")
    p.add_argument("-o", "--output", default="profile.json", metavar="FILE",
                   help="profile file to write; its folder must exist")
    p.add_argument("--steps", type=int, default=None, help="steps of the single-process profiling run (default "
                                                           "12, the lab's own; the first 3 are left out)")
    json_arg(p, "the profile")
    runs_arg(p)
    p.set_defaults(func=cmd_profile, cmd_parser=p)

    p = command(sub, "predict", "the performance model: predicted iteration time, speedup over DDP and scaling "
                                "factor", ["commlab predict examples/topk-ef.yaml --gbps 1,10 --workers 8,64",
                                           "commlab predict profile.json --device H100 --workers 8,64",
                                           "commlab predict examples/topk-ef.yaml --cluster node_size=8,"
                                           "intra_gbps=1600,inter_gbps=100 --workers 64"],
                "Without --profile or --calibrate, the lab's profile of the model is used (a saved one, one "
                "calibrated from a finished run, or a short single-process run measured now).")
    add_spec_args(p, "a profile file (commlab profile) or a job spec file (YAML or JSON); dear is accepted")
    p.add_argument("--gbps", default=None, metavar="LIST", help="link rates in Gbit/s, comma-separated (default "
                   "1,10,100,400); with --cluster: the inter-node rates")
    p.add_argument("--workers", default="2,8,64,1024", metavar="LIST", help="worker counts, comma-separated")
    p.add_argument("--cluster", metavar="KEY=VALUE,...", default=None,
                   help="a two-level cluster with hierarchical all-reduce: node_size=8,intra_gbps=1600,"
                        "inter_gbps=100 (optional intra_us, inter_us latencies per ring step, nics per node; "
                        "without inter_gbps, --gbps gives it)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--profile", metavar="FILE", help="a saved profile (JSON)")
    g.add_argument("--calibrate", metavar="RUN", help="calibrate compute from this run's timeline")
    p.add_argument("--link", metavar="FILE", help="alpha and beta from `commlab net check --gbps X --json` output")
    p.add_argument("--compute-speedup", type=float, default=1.0, metavar="X",
                   help="compute X times faster than measured, e.g. 20 for a GPU")
    p.add_argument("--device", metavar="NAME[:PRECISION]", default=None,
                   help="predict on a GPU: V100, V100-PCIE, A100, H100, H200 or a YAML file describing one "
                        "(peak_tflops, memory_gb_s, nvlink_gb_s, ...); compute from the model's roofline on it "
                        "unless the profile was measured there, NCCL links, --gbps the NIC rate")
    json_arg(p, "the table, crossovers and sources")
    runs_arg(p)
    p.set_defaults(func=cmd_predict, cmd_parser=p)

    p = command(sub, "advise", "choose a communication strategy for a spec and a link, then prove it",
                ["commlab advise examples/demo.yaml --gbps 1 --out best.yaml",
                 "commlab advise examples/demo.yaml --gbps 0.1 --measure --trials 2",
                 "commlab advise examples/demo.yaml --gbps 1 --json > advice.json"],
                "Ranks the strategies by predicted (with --measure, measured) time to accuracy and says why the "
                "winner won.")
    add_spec_args(p, "job spec file (YAML or JSON); its compressor, schedule and comm are what gets chosen")
    p.add_argument("--gbps", type=float, default=None, help="link rate in Gbit/s (default: the spec's link)")
    p.add_argument("--link", default=None, type=one_of("a link", LINKS), choices=LINKS, metavar="LINK",
                   help=f"{' or '.join(LINKS)}: modeled (alpha-beta delays, default with --gbps) or shaped "
                        "(tc on an emulated cluster)")
    p.add_argument("--workers", type=int, default=None, help="worker count (default: the spec's world_size)")
    p.add_argument("--measure", action="store_true", help="run short trials of the top candidates, choose by them")
    p.add_argument("--trials", type=int, default=TRIALS, help="candidates tried with --measure")
    p.add_argument("--trial-steps", type=int, default=TRIAL_STEPS,
                   help="steps per trial (PowerSGD's uncompressed start is added)")
    p.add_argument("--penalty", action="append", default=[], metavar="COMPRESSOR=X",
                   help="declare a convergence penalty (steps to accuracy vs none), e.g. topk=1.3 (repeatable)")
    p.add_argument("--candidate", action="append", default=[], metavar="COMPRESSOR",
                   help="rank this compressor too: a name or package.module:Class, or a section in YAML such as "
                        "'{name: mypkg.codecs:ScaledSign, scale: 0.5}' (repeatable; the spec's own compressor "
                        "joins by itself when it names code)")
    p.add_argument("--top", type=int, default=12, help="rows of the table to print (0: all)")
    p.add_argument("-o", "--out", default=None, metavar="FILE", help="write the winner as a spec (YAML); its "
                                                                     "folder must exist")
    p.add_argument("--json-out", default=None, metavar="FILE", help="write the whole advice as JSON to FILE")
    json_arg(p, "the whole advice")
    runs_arg(p)
    p.set_defaults(func=cmd_advise, cmd_parser=p)

    p = command(sub, "check", "check a plug-in against what the built-ins pass",
                ["commlab check compressor mypkg.codecs:ScaledSign --param scale=0.5",
                 "commlab check compressor topk --param ratio=0.05 --checks-only --json"],
                "Your own compressor, named by import path, gets the built-ins' conformance checks, its cost curve "
                "beside theirs and the links and cluster sizes where it would pay. Exit status 0 when every check "
                "passes, 1 when one fails.")
    what = group(p, "what to check", "what", "WHAT")
    q = command(what, "compressor", "a compressor's conformance checks, cost curve and payoff",
                ["commlab check compressor mypkg.codecs:ScaledSign --model resnet --gbps 0.1,1,10"])
    check_cli.add_arguments(q)
    json_arg(q, "the checks, costs and predictions")
    runs_arg(q)
    q.set_defaults(func=check_cli.cmd_check, cmd_parser=q)

    p = command(sub, "workshop", "the workshop server's students: list them, revoke one, rotate tokens",
                ["commlab workshop users", "commlab workshop revoke mallory --rotate-class",
                 "commlab workshop rotate admin"])
    wsub = group(p, "workshop actions", "action", "ACTION")
    q = command(wsub, "users", "students who signed in (RUNS/access.json), with expiry and open sessions",
                ["commlab workshop users --json"])
    json_arg(q, "the students")
    runs_arg(q)
    q.set_defaults(func=cmd_workshop, cmd_parser=q)
    q = command(wsub, "revoke", "revoke a student: their token and sessions end, the name and their browsers "
                                "cannot sign in again; their runs keep going",
                ["commlab workshop revoke mallory"])
    q.add_argument("name", metavar="NAME", help="the student's name")
    q.add_argument("--rotate-class", action="store_true", help="also replace the class token (for someone who "
                   "would sign in again from a cleared browser); hand the new link to the others")
    json_arg(q, "what was revoked")
    runs_arg(q)
    q.set_defaults(func=cmd_workshop, cmd_parser=q)
    q = command(wsub, "rotate", "replace a token: 'class', 'admin' or a student's name (their sessions end); "
                                "prints the new token", ["commlab workshop rotate class"])
    q.add_argument("who", metavar="WHO", help="class | admin | NAME")
    json_arg(q, "the new token")
    runs_arg(q)
    q.set_defaults(func=cmd_workshop, cmd_parser=q)

    names = benchmarks()
    p = command(sub, "bench", "run a benchmark from bench/, or list them",
                ["commlab bench", "commlab bench ddp_compare --help", "commlab bench ddp_compare --models cnn"],
                "Benchmarks compare commlab with its peers in one run; each takes --help.")
    p.add_argument("name", metavar="NAME", nargs="?", type=one_of("a benchmark", names), choices=names,
                   help="benchmark name; omit to list them")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    json_arg(p, "the list of benchmarks")
    p.set_defaults(func=cmd_bench, cmd_parser=p)

    p = command(sub, "completion", "print a shell completion script",
                ["commlab completion bash > ~/.local/share/bash-completion/completions/commlab",
                 "commlab completion zsh > ~/.zfunc/_commlab   # with fpath+=(~/.zfunc) before compinit",
                 "source <(commlab completion bash)"])
    p.add_argument("shell", metavar="SHELL", type=one_of("a shell", completion.SHELLS), choices=completion.SHELLS,
                   help=f"{' or '.join(completion.SHELLS)}")
    p.set_defaults(func=cmd_completion, cmd_parser=p)
    return ap


SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(JobSpec))


def unrecognized(args, extra: List[str], argv: List[str]) -> str:
    """argparse's "unrecognized arguments", with a hint: an option named like a spec field is what
    ``--set FIELD=VALUE`` sets (``run --steps 10`` took 10 as the SPEC); another may be a typo."""
    hints = []
    options = [s for a in args.cmd_parser._actions for s in a.option_strings]
    for tok in extra:
        if not tok.startswith("--"):
            i = argv.index(tok)
            if i and argv[i - 1] == "--json" and "--json-out" in options:  # advise's old `--json FILE`
                hints.append(f"--json-out {tok}")
            continue
        name, eq, value = tok[2:].partition("=")
        if not eq:
            i = argv.index(tok)
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else "VALUE"
        if hasattr(args, "overrides") and name.replace("-", "_") in SPEC_FIELDS:
            hints.append(f"--set {name.replace('-', '_')}={value}")
        else:
            hints += difflib.get_close_matches(f"--{name}", options, n=1)
    hint = f"; did you mean {' '.join(hints)}?" if hints else ""
    return f"unrecognized arguments: {' '.join(extra)}{hint} (see '{args.cmd_parser.prog} --help')"


# --------------------------------------------------------------------------- checks and output

def out_file(option: str, path: str) -> str:
    """An output file, checked before any work starts: its folder exists (none is made) and can be written."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option}: {path} is a directory; give a file name")
    folder = p.parent
    if not folder.is_dir():
        raise UsageError(f"{option}: {path}: no such directory: {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{option}: {path}: permission denied")
    return path


def in_file(option: str, path: str) -> str:
    """An input file, checked before any work starts."""
    if not Path(path).is_file():
        raise UsageError(f"{option}: no such file: {path}")
    return path


def runs_root(args, create: bool = True) -> Path:
    """The runs directory (--runs, $COMMLAB_RUNS or ./runs): a directory, made (with its parents) when a
    command that writes runs needs it."""
    root = Path(args.runs) if args.runs else default_root()
    if root.exists() and not root.is_dir():
        raise UsageError(f"--runs: {root} is not a directory")
    if create:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--runs: cannot create {root}: {e.strerror}") from None
    return root


def lab_of(args) -> Lab:
    return Lab(runs_root(args))


def store_of(args) -> RunStore:
    return RunStore(runs_root(args, create=False))


def notes(args):
    """Where a command's human lines go: stderr when stdout carries its JSON."""
    return sys.stderr if getattr(args, "json", False) else sys.stdout


def emit(obj) -> None:
    print(json.dumps(obj, indent=1, default=str))


def run_document(run) -> dict:
    """A run as ``show --json`` and ``run --json`` print it."""
    spec, st = run.spec_dict(), run.status()
    return {"id": run.id, "state": st.get("state"), "status": st, "summary": summarize(run.metric_rows(), spec),
            "spec": spec}


# --------------------------------------------------------------------------- commands

def cmd_run(args) -> int:

    spec = load_spec(args.spec, args.overrides)
    if args.check:
        print(json.dumps(spec.to_dict(), indent=1))
        return 0
    lab = lab_of(args)
    auto = spec.strategy.mode == "auto" and not spec.strategy.decided
    if args.nnodes and auto:
        raise UsageError("strategy: auto is chosen by the lab's own supervisor, not across nodes; "
                         "choose first with `commlab advise SPEC --out best.yaml` and run best.yaml")
    if args.nnodes:
        return run_node(lab, spec, args)
    try:
        job = JobRank.from_env()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if job is not None and auto:
        raise UsageError("strategy: auto is chosen by the lab's own supervisor, not inside a job "
                         "another launcher started; choose first with `commlab advise SPEC --out best.yaml`")
    if job is not None:  # torchrun, srun or a PyTorchJob started this process as one rank: join that job
        return run_joined(lab, spec, args, job)
    run = lab.create(spec, run_id=args.run_id)
    print(f"run {run.id}  ({run.path})", file=notes(args), flush=True)
    try:
        state = lab.supervise(run, progress=not args.quiet)
    except KeyboardInterrupt:  # Ctrl-C before the launch: the summary of what there is, then status 130
        state = run.state
    return report(run, state, args)


def run_node(lab, spec, args) -> int:
    """One node of a multi-machine run. Node 0 creates the run and owns its status;
    the others join the same run directory (a shared file system) and run their ranks."""
    if not args.run_id or not args.master_addr:
        raise UsageError("--nnodes needs --run-id and --master-addr (the same on every node)")
    try:
        nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    except ValueError as e:
        raise UsageError(str(e)) from None
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
    if args.compressor and ":" not in args.compressor:
        from engine.compressors import names
        if args.compressor not in names():
            raise UsageError(f"--compressor: {args.compressor!r} is not a compressor; allowed: "
                             f"{', '.join(names())} or pkg.module:Class")
    filters = ("state", "model", "dataset", "compressor", "schedule", "comm", "link", "sweep", "owner")
    root = runs_root(args, create=False)
    rows_db = []
    if root.is_dir():
        lab = Lab(root)
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


def cmd_report(args) -> int:
    from lab.analysis import results
    from lab.analysis.report import report_html
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
        raise UsageError(f"{flag}: must be a comma-separated list of numbers in [{lo:g}, {hi:g}], got {text!r}")
    return vals


def cmd_profile(args) -> int:
    if args.steps is None:
        args.steps = whatif.PROFILE_STEPS
    if not 5 <= args.steps <= 10000:
        raise UsageError(f"--steps: must be in 5..10000, got {args.steps}")
    out_file("--output", args.output)
    spec = load_spec(args.spec, args.overrides).to_dict()
    say = notes(args)
    print(f"profile: {spec['model']['name']} on {spec['dataset']['name']}, batch {spec['batch_size']}: a "
          f"{args.steps}-step single-process run", file=say, flush=True)
    try:
        prof = whatif.profile_spec(spec, runs_root(args), args.steps, runner=Lab(runs_root(args)).runner())
    except CalibrationError as e:
        raise LabError(str(e)) from None
    prof.save(args.output)
    if args.json:
        emit({"output": args.output, "profile": dataclasses.asdict(prof)})
        return 0
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
    say = notes(args)

    def info(line: str) -> None:
        print(line, file=say, flush=True)
    workers = _numbers("--workers", args.workers, int, 1, 100000)
    if not 0.001 <= args.compute_speedup <= 10000:
        raise UsageError(f"--compute-speedup: must be in [0.001, 10000], got {args.compute_speedup}")
    # with --device, the device gives the node's size and fabric: --cluster may change any of them
    shape = whatif.parse_cluster(args.cluster, required=() if args.device else None) if args.cluster else None
    if shape and "inter_gbps" in shape:
        if args.gbps is not None:
            raise UsageError("--gbps and --cluster inter_gbps both give the inter-node rate; give one")
        gbps = [shape["inter_gbps"]]
    else:
        gbps = _numbers("--gbps", args.gbps or "1,10,100,400", float, 0.001, 10000)
    dev = None
    if args.device:
        if args.compute_speedup != 1.0 or args.link:
            raise UsageError("--device models the device's compute and links; "
                             "--compute-speedup and --link are for a measured profile")
        try:
            dev, precision = devices.parse(args.device)
        except ValueError as e:
            raise UsageError(str(e)) from None
        for p in workers:
            try:
                ondevice.topology(dev, 1.0, shape).nodes(p)
            except ValueError as e:
                raise SpecError("--workers", str(e).split(": ", 1)[1]) from None
    elif shape:
        whatif.check_workers(shape, workers)
    if args.link and shape:
        raise UsageError("--link calibrates a flat link; --cluster gives its own links")
    link_cal = whatif.link_file(args.link) if args.link else None  # read before any profiling run
    if args.profile:
        in_file("--profile", args.profile)
    if whatif.is_profile_file(args.spec):
        if args.profile or args.calibrate:
            raise UsageError("PROFILE is a profile already; --profile and --calibrate are for a SPEC")
        prof = whatif.load_profile_file(args.spec)
        if not prof.spec:
            raise SpecError("PROFILE", f"{args.spec} records no spec (not written by commlab profile); use "
                                       f"commlab predict SPEC --profile {args.spec}")
        spec = whatif.load_for_prediction(data=prof.spec, overrides=args.overrides)
        if prof.key() != spec_key(spec):
            raise SpecError("--set", f"the profile is for {prof.key()}, the spec is now {spec_key(spec)}")
        m = prof.machine
        info(f"profile: {args.spec} ({prof.source}" + (f", {m.get('device')} on {m.get('host')}, torch "
                                                      f"{m.get('torch')}" if m else "") + ")")
        if whatif.ensure_curves(prof, [spec]):
            prof.save(args.spec)
            info(f"profile: measured the compressor's encode/decode cost curve, added to {args.spec}")
    else:
        spec = whatif.load_for_prediction(args.spec, args.overrides)
        if args.calibrate:
            store_of(args).get(args.calibrate)  # a missing run is said before anything is measured
        try:
            prof = whatif.resolve_profile(spec, runs_root(args), args.profile, args.calibrate, say=info,
                                          runner=Lab(runs_root(args)).runner())
        except CalibrationError as e:
            raise LabError(str(e)) from None
    if link_cal is not None:
        prof.link = link_cal
    links = node_size = None
    if dev is not None and spec["method"]["name"] != "none" and predict.method_of(spec).codec() is not None:
        raise SpecError("--device", f"method {spec['method']['name']} brings its own codec, whose cost on a GPU "
                                    "is not modeled; predict it without --device")
    if dev is not None:
        prof = ondevice.device_profile(prof, spec, dev, precision, say=info)
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
    c, meth = spec["compressor"], spec["method"]
    setup = (f"{spec['model']['name']} batch {spec['batch_size']}, {c['name']}{' +EF' if c['error_feedback'] else ''}"
             f", {spec['schedule']['name']}, {spec['comm']['mode']}"
             + (f", method {method_label(meth)} (SPEC ms: the mean step over the run's {spec['steps']} steps, its syncs "
                f"amortized)" if meth["name"] != "none" else "")
             + f"; vs DDP (none, bucket 25 MB, wfbp); link: {link}; "
             + (f"device {dev.name} {precision}" if dev else f"compute x{args.compute_speedup:g}"))
    rows = whatif.table(prof, spec, gbps, workers, args.compute_speedup, cluster=shape, links=links)
    crossovers = [whatif.crossover_line(prof, spec, p, args.compute_speedup, cluster=shape, links=links,
                                        node_size=node_size) for p in workers]
    sources = ondevice.sources(prof, spec, dev, precision if dev else "", args.compute_speedup, cluster=bool(shape))
    if args.json:
        emit({"setup": setup, "rate": "inter-node" if shape or dev else "flat", "rows": rows,
              "crossover": dict(zip(map(str, workers), crossovers)), "sources": list(sources)})
        return 0
    print("spec: " + setup)
    for line in whatif.format_table(rows, "INTER GBIT/S" if shape or dev else "GBIT/S"):
        print(line)
    for line in crossovers:
        print(("crossover (inter-node rate): " if shape or dev else "crossover: ") + line)
    print("sources:")
    for line in sources:
        print("  " + line)
    return 0


def method_label(section: dict) -> str:
    """A spec's method section in one phrase: ``diloco(H=50,outer_lr=0.7,...)`` and its compressor, if any."""
    ps = ",".join(f"{k}={v}" for k, v in (section.get("params") or {}).items())
    comp = section.get("compressor") or {}
    return (f"{section['name']}({ps})" + (f" with {compressor_key(comp)}" if comp and comp["name"] != "none" else ""))


def parse_candidate(text: str) -> dict:
    """``--candidate``: a compressor name or import path, or a YAML mapping (a spec's compressor section), in
    the full form the spec gives it; a one-line SpecError naming --candidate otherwise."""
    raw = text.strip()
    try:
        section = yaml.safe_load(raw) if raw.startswith("{") else raw
    except yaml.YAMLError as e:
        raise SpecError("--candidate", f"{text!r} is not valid YAML: {str(e).strip().splitlines()[0]}") from None
    try:
        return load_spec(data={"compressor": section}).to_dict()["compressor"]
    except SpecError as e:
        raise SpecError("--candidate", f"{text}: {e}") from None


def write_spec(spec: dict, path) -> Path:
    """The winner of an advice as a spec file (YAML); its folder must exist (``out_file`` checked it)."""
    path = Path(path)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def cmd_advise(args) -> int:
    for option in ("out", "json_out"):
        if getattr(args, option):
            out_file("--" + option.replace("_", "-"), getattr(args, option))
    spec = whatif.load_for_prediction(args.spec, args.overrides)
    extra = [parse_candidate(c) for c in args.candidate]
    if args.top < 0:
        raise SpecError("--top", f"must be >= 0, got {args.top}")
    say = notes(args)
    adv = advisor.advise(spec, runs_root(args), args.gbps, args.link, args.workers, args.measure, args.trials,
                         args.trial_steps, advisor.parse_penalties(args.penalty),
                         runner=Lab(runs_root(args)).runner(), candidates=extra,
                         say=lambda line: print(line, file=say, flush=True))
    net = adv.network
    print(f"advice for {spec['model']['name']} batch {spec['batch_size']}, {adv.world} workers, "
          f"{net['link']} {net['gbps']:g} Gbit/s; link: {adv.link_source}; profile: {adv.profile_source}", file=say)
    for line in advisor.format_table(adv, args.top or None):
        print(line, file=say)
    print(f"winner ({adv.chosen_by}): {adv.reason}", file=say)
    c = adv.cost_s
    print(f"advisor cost: {c['total']:.1f} s (profile and cost curves {c['profile']:.1f} s, predictions "
          f"{c['predict']:.1f} s, trials {c['trials']:.1f} s)", file=say)
    for i, cand in enumerate(adv.ranked(), 1):  # the rows format_table shows: the top ones and every method
        if cand.note and (not args.top or i <= args.top or cand.local):
            print(f"note: {cand.label}: {cand.note}", file=say)
    if args.out:
        print(f"wrote {write_spec(adv.winner_spec(), args.out)}", file=say)
    if args.json_out:
        write_json_atomic(args.json_out, adv.as_dict())
        print(f"wrote {args.json_out}", file=say)
    if args.json:
        emit(adv.as_dict())
    return 0


def cmd_net(args) -> int:
    if args.net_cmd == "check":
        if not 0.001 <= args.gbps <= 400:
            raise UsageError(f"--gbps: must be in [0.001, 400], got {args.gbps}")
        if not 2 <= args.ranks <= 64:
            raise UsageError(f"--ranks: must be in 2..64, got {args.ranks}")
        if not 0.1 <= args.seconds <= 600:
            raise UsageError(f"--seconds: must be in [0.1, 600], got {args.seconds}")
        root = runs_root(args) if args.save else None
    try:
        netns.check_shaped_supported()
        if args.net_cmd == "cleanup":
            removed = netns.cleanup_stale()
            if args.json:
                emit({"removed": removed})
            else:
                print(f"removed {len(removed)} stale namespace(s)" + (": " + ", ".join(removed) if removed else ""))
            return 0
        r = netcheck.net_check(args.gbps, seconds=args.seconds, n_ranks=args.ranks,
                               out=None if args.json else sys.stdout)
    except netns.NetworkUnavailable as e:
        raise LabError(str(e)) from None
    if args.json:
        emit(r)
    if args.save:
        path = whatif.save_shaped_link(root, r)
        print(f"saved the lab's shaped-link calibration: {path}", file=notes(args))
    return 0


def cmd_cancel(args) -> int:
    lab = Lab(runs_root(args, create=False))
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


def cmd_show(args) -> int:
    run = store_of(args).get(args.run)
    doc = run_document(run)
    if args.json:
        emit(doc)
        return 0
    spec, st = doc["spec"], doc["status"]
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
    for line in format_summary(doc["summary"]):
        print(line)
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


def cmd_workshop(args) -> int:
    root = runs_root(args, create=args.action == "rotate")
    if args.action == "users":
        people = accounts.people(root) if root.is_dir() else []
        if args.json:
            emit(people)
            return 0
        if not people:
            print(f"no students in {accounts.access_path(root)}")
        for p in people:
            left = (p["expires"] - time.time()) / 86400
            print(f"{p['name']:<20} token {'expired' if left <= 0 else f'expires in {left:.1f} days'}, "
                  f"{p['sessions']} open session(s)")
        return 0
    if args.action == "rotate":
        token = accounts.rotate(root, args.who)
        if args.json:
            emit({"who": args.who, "token": token})
            return 0
        what = {"class": "class token (students who signed in keep theirs)",
                "admin": "admin token (the teacher's sessions ended)"}.get(args.who, f"{args.who}'s personal token "
                                                                                "(their sessions ended)")
        print(f"new {what}: {token}")
        return 0
    n = accounts.revoke(root, args.name)
    class_token = accounts.rotate(root, "class") if args.rotate_class else None
    if args.json:
        emit({"revoked": args.name, "tokens": n, "class_token": class_token})
        return 0
    print(f"revoked {args.name} ({n} token(s)): their sessions end at their next request, the name and their "
          f"browsers cannot sign in again; their runs keep going (commlab runs --owner {args.name}, "
          f"commlab cancel RUN)")
    if class_token:
        print(f"new class token: {class_token}")
    return 0


def bench_dir() -> Path:
    return ROOT / "bench"


def benchmarks() -> List[str]:
    """The scripts in bench/ that run as benchmarks (a ``__main__`` block); not its helpers (common,
    wsclient, ...). None in an installation without bench/ (it is not in the wheel)."""
    main_block = re.compile(r"""^if __name__ == ["']__main__["']:""", re.M)
    return sorted(p.stem for p in bench_dir().glob("*.py") if main_block.search(p.read_text()))


def cmd_bench(args) -> int:
    names = benchmarks()
    if not args.name:
        if not names:
            raise UsageError(f"no benchmarks: {bench_dir()} is missing (bench/ comes with a source checkout)")
        about = {n: " ".join((ast.get_docstring(ast.parse((bench_dir() / f"{n}.py").read_text())) or "")
                             .split("\n\n")[0].split()) for n in names}
        if args.json:
            emit([{"name": n, "about": about[n]} for n in names])
        else:
            w = max(map(len, names))
            print("\n".join(f"{n:<{w}}  {about[n]}" for n in names))
        return 0
    env = {**os.environ, "COMMLAB_BENCH": args.name}  # the benchmark's usage line says `commlab bench NAME`
    argv = [sys.executable, str(bench_dir() / f"{args.name}.py"), *args.args]
    return subprocess.run(argv, cwd=ROOT, env=env).returncode


def cmd_completion(args) -> int:
    sys.stdout.write(completion.script(build_parser(), args.shell))
    return 0


# --------------------------------------------------------------------------- entry point

def error(message: str) -> None:
    """``commlab: error: ...`` on one line of stderr."""
    line = "; ".join(s.strip() for s in str(message).splitlines() if s.strip())
    print(f"commlab: error: {line}", file=sys.stderr, flush=True)


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (a BrokenPipeError from elsewhere is a real error)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def sigint_seen(seen: list):
    """Ctrl-C raises KeyboardInterrupt as usual, and is noted in ``seen``: a command that catches it to stop
    cleanly (a run is cancelled and summarized) still ends with status 130. Left alone when SIGINT is
    ignored or handled by someone else, or off the main thread."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return

    def on_sigint(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    seen: list = []
    try:
        with sigint_seen(seen):
            parser = build_parser()
            try:
                args, extra = parser.parse_known_args(argv)
            except SystemExit as e:  # --help and --version print (argparse drops a failed write), then stop
                sys.stdout.flush()
                return CLOSED_PIPE if stdout_closed() else e.code if isinstance(e.code, int) else 0
            if extra:
                raise UsageError(unrecognized(args, extra, argv))
            if args.func is None:  # `commlab`, `commlab net`: the usage and where to look
                print(args.cmd_parser.format_usage().rstrip(), file=sys.stderr)
                print(f"run '{args.cmd_parser.prog} --help' for the commands", file=sys.stderr)
                return 2
            rc = args.func(args)
            sys.stdout.flush()
        if seen:
            error("interrupted")
            return INTERRUPTED
        return rc
    except (UsageError, SpecError, LabError) as e:
        error(e)
        return 2
    except KeyboardInterrupt:
        error("interrupted")
        return INTERRUPTED
    except BrokenPipeError as e:
        if not stdout_closed():
            error(f"{type(e).__name__}: {e}")
            return 1
        # the reader has gone (`| head`): stop quietly; stdout goes to /dev/null so that the interpreter's
        # last flush at exit does not complain either
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE
    except OSError as e:
        error(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
