"""The ``commlab`` command: one parser (``build_parser``) and a thin function per command. The parser is
assembled here from the command groups: the run commands (run_cli.py), the performance model's (model_cli.py),
``check`` (check_cli.py) and the lab's own (app, notebooks, net, workshop, bench, completion: below); what they
share (the parser's conventions, path checks, output) is cli_kit.py.

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
         by SIGPIPE would. A run's progress stream (stderr) closed early only goes quiet: ``commlab run``
         supervises the run to its end all the same (``... 2>&1 | head -1``: done, then 141)
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

from commlab.engine.spec import JobSpec, SpecError
from commlab.lab.base.errors import LabError
from commlab.lab.front import check_cli, completion, model_cli, run_cli
from commlab.room import accounts
from commlab.lab.front.appserver import LOCAL_PROXY, app_main
from commlab.lab.front.cli_kit import (
    ROOT,
    Help,
    Parser,
    UsageError,
    command,
    emit,
    group,
    json_arg,
    notes,
    one_of,
    runs_arg,
    runs_root,
    version,
)
from commlab.lab.front.jupyter import notebooks_main
from commlab.lab.net import netcheck, netns
from commlab.lab.strategy.perfmodel import whatif

INTERRUPTED, CLOSED_PIPE = 130, 141


# --------------------------------------------------------------------------- the parser

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

    run_cli.add_commands(sub)

    p = command(sub, "app", "start the Streamlit UI (bound to 127.0.0.1), with a demo run if there is none",
                ["commlab app", "commlab app --port 8600 --no-demo",
                 "commlab app --host 0.0.0.0 --certfile cert.pem --keyfile key.pem",
                 "commlab app --host 0.0.0.0 --behind-proxy"],
                "Any address beyond loopback serves a workshop: students sign in with the class token. "
                "SIGINT, SIGTERM or SIGHUP stops it cleanly.")
    p.add_argument("--port", type=int, default=8501, help="port")
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the lab)")
    p.add_argument("--no-demo", action="store_true", help="do not queue the demo run into an empty runs directory")
    p.add_argument("--token", default=None, help="the class token students sign in with (16 or more "
                   "characters, hard to guess), when bound beyond "
                   "loopback (default: one generated and kept in RUNS/access.json)")
    p.add_argument("--certfile", default=None, metavar="FILE", help="TLS certificate (PEM) to serve https with; "
                                                                    "needs --keyfile")
    p.add_argument("--keyfile", default=None, metavar="FILE", help="the certificate's private key (PEM)")
    p.add_argument("--behind-proxy", nargs="?", const=LOCAL_PROXY, default=None, metavar="ADDRESSES",
                   help="a proxy (e.g. for TLS) forwards to this lab: believe the client address in its "
                        "X-Forwarded-For header, from the proxy's addresses only (comma-separated IP addresses "
                        "or networks; alone: a proxy on this machine, 127.0.0.1 and ::1). Without it the "
                        "sign-in limits count the socket's peer address")
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

    model_cli.add_commands(sub)

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


def cmd_app(args) -> int:
    return app_main(args.port, args.runs, args.host, demo=not args.no_demo, token=args.token,
                    certfile=args.certfile, keyfile=args.keyfile, behind_proxy=args.behind_proxy)


def cmd_notebooks(args) -> int:
    return notebooks_main(args.port, browser=not args.no_browser, runs=args.runs)


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
