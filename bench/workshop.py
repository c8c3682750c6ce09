"""A room's worth of load on the workshop server: N simulated students against `commlab app --host 0.0.0.0`.

Each student is a websocket session (bench/wsclient.py: what a browser tab sends and receives, without
drawing anything). It signs in through the sign-in pages (the class token, then a name: a personal token
and a session cookie; nothing in the URL), then until the time is up: opens Home (timed), starts the next
preset with its Start button whenever none of its runs is queued or running (student k starts at preset
k, then takes them in turn), and watches that preset's Results page (timed), with a think time between
requests. The teacher's runs/lab.json scales the presets down (``preset_steps``) and sets the quotas; the
lab runs with ``max_jobs`` slots, so the queue is full the whole time.

The simulated browsers run in this process, on the lab's machine, where a room's browsers would be on
the students' laptops: so the bench runs in a session of its own and, once the app is up, lowers its CPU
priority to the app server's (commlab.lab.service.spawn.lower_cpu_priority: nice APP_NICE, for the session's scheduling
group too), so that 20 sessions' websocket traffic competes with the server, not with the runs.

At the end it waits for every run to end and checks:
- every run is in a final state, and none failed; every run a Start queued is there and the student's;
- no session received the id of a run, or the token, of anyone else;
- the Home page's response time (request to end of the script run), median and 90th percentile;
- fairness: the run time each student got against the mean: from runs started before the deadline
  (whole), and the run time inside the measured minutes only.

    flock /tmp/commlab-cpu.lock python bench/workshop.py --students 4 --minutes 3 --steps 10
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import prog  # noqa: E402
from bench.wsclient import Session, sign_in  # noqa: E402
from commlab.lab.analysis.presets import PRESETS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Student(threading.Thread):
    def __init__(self, k: int, url: str, class_token: str, args, deadline: float):
        super().__init__(name=f"student{k:02d}", daemon=True)
        self.k, self.student, self.url, self.class_token = k, f"student{k:02d}", url, class_token
        self.args, self.deadline = args, deadline
        self.home_s, self.watch_s, self.refused, self.errors = [], [], [], []
        self.groups = []
        """(preset key, group id, {label: run id}) of every preset this student started."""
        self.session = None
        self.token = None

    @property
    def run_ids(self):
        return [rid for _, _, ids in self.groups for rid in ids.values()]

    def run(self):
        import traceback
        try:
            self._run()
        except Exception as e:  # reported in the results, never swallowed
            where = traceback.extract_tb(e.__traceback__)[-1]
            self.errors.append(f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})")

    def _run(self):
        from commlab.lab.analysis import results
        from commlab.room import open_lab
        jar = sign_in(self.url, self.class_token, self.student)
        if not jar.personal or "commlab_session" not in jar.cookies:
            raise RuntimeError(f"sign-in refused ({jar.status}): {re.sub('<[^>]+>', ' ', jar.body)[:200]}")
        self.token = jar.personal
        s = self.session = Session(self.url, cookie=jar.header)
        presets = [p.key for p in PRESETS]
        q = open_lab(self.args.runs, room=True)
        while time.time() < self.deadline:
            home = s.run("")  # the session cookie: nothing in the URL
            self.home_s.append(home.seconds)
            if "Start an experiment in one click" not in home.text:
                raise RuntimeError(f"Home did not come back: {home.kinds()} {home.exceptions()}")
            active = [r for r in q.index.query(owner=self.student) if r["state"] in ("queued", "running")]
            if not active:  # its last preset is over: the next one, each student starting at its own
                key = presets[(self.k + len(self.groups)) % len(presets)]
                wid = home.widget(f"preset-{key}")
                if not wid:
                    raise RuntimeError(f"no Start button for preset {key} on Home")
                got = s.run("", widgets={wid: True})
                gid = (got.query_string or "").partition("group=")[2].split("&")[0]
                if gid:
                    self.groups.append((key, gid, results.load_group(self.args.runs, gid)["runs"]))
                elif "quota " in got.text:
                    self.refused.append(time.time())
                else:
                    raise RuntimeError(f"preset {key}: Start queued nothing: {got.exceptions()}")
            if self.groups:  # watch it: the preset's results page (live while its runs go)
                page = s.run(f"group={self.groups[-1][1]}", page="results")
                self.watch_s.append(page.seconds)
            time.sleep(self.args.think_s)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def own_session() -> None:
    """Go on in a session of our own (a child that leads it; this process waits and passes signals on),
    so that lowering our priority there leaves the caller's session alone."""
    if os.getsid(0) == os.getpid():
        return
    child = subprocess.Popen([sys.executable, *sys.argv], start_new_session=True)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: child.send_signal(signum))
    sys.exit(child.wait())


def main(argv=None) -> int:
    if argv is None:
        own_session()
    ap = argparse.ArgumentParser(prog=prog(__file__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--students", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=10,
                    help="steps of every preset run (runs/lab.json preset_steps: presets scaled down to this)")
    ap.add_argument("--queued", type=int, default=4,
                    help="runs a student may have queued or running (quota; a preset asks for 2 to 4 at once)")
    ap.add_argument("--max-jobs", type=int, default=1, help="slots of the lab's queue")
    ap.add_argument("--think-s", type=float, default=2.0, help="pause between a student's requests")
    ap.add_argument("--drain-s", type=float, default=600.0, help="how long to wait for the runs to end")
    ap.add_argument("--runs", default=None, help="runs directory (default: a fresh temporary one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "workshop.json"))
    args = ap.parse_args(argv)
    args.runs = Path(args.runs or tempfile.mkdtemp(prefix="commlab-workshop-"))
    args.runs.mkdir(parents=True, exist_ok=True)
    # every simulated student signs in from 127.0.0.1, as a room behind one NAT or proxy does: the teacher raises
    # the names one address may take (runs/lab.json access.names_per_address) to the room's size
    (args.runs / "lab.json").write_text(json.dumps({"max_jobs": args.max_jobs, "preset_steps": args.steps,
                                                    "quotas": {"queued": args.queued, "steps": args.steps,
                                                               "world_size": 2},
                                                    "access": {"names_per_address": max(10, args.students)}}))
    from commlab.room import accounts
    from commlab.engine.runfiles import FINAL
    port = free_port()
    log_path = args.runs / "app.log"
    env = {k: v for k, v in os.environ.items() if k != accounts.ACCESS_ENV}
    code = (f"import sys; from commlab.lab.front.appserver import app_main; "
            f"sys.exit(app_main({port}, {str(args.runs)!r}, host='0.0.0.0', demo=False))")
    with open(log_path, "wb") as log:
        app = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), env=env, start_new_session=True,
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    from commlab.lab.service.spawn import lower_cpu_priority
    lower_cpu_priority()  # the students' side, not the runs' (see the module docstring); the app keeps its own
    # Stopped early (Ctrl-C, a timeout's SIGTERM), the bench still stops the app and the runs it queued:
    # they live in the bench's own runs directory, and nothing else would end them.
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return _measure(args, app, url, log_path)
    finally:
        if app.poll() is None:
            app.send_signal(signal.SIGTERM)
            app.wait(timeout=60)
        import commlab
        for r in commlab.runs(runs=args.runs):
            if r.state not in FINAL:
                commlab.cancel(r.id, runs=args.runs)


def _measure(args, app, url, log_path) -> int:
    from commlab.room import accounts
    from commlab.room import open_lab
    from commlab.engine.runfiles import FINAL
    import urllib.request
    t0 = time.time()
    while True:
        try:
            urllib.request.urlopen(url + "/_stcore/health", timeout=2).read()
            break
        except OSError:
            if app.poll() is not None or time.time() - t0 > 120:
                print(log_path.read_text(), file=sys.stderr)
                return 1
            time.sleep(0.5)
    class_token = accounts.load_access(args.runs)["class_token"]
    admin_token = accounts.rotate(args.runs, "admin")  # runs/access.json keeps only its hash: a new one, known here
    started = time.time()
    deadline = started + args.minutes * 60
    students = [Student(k, url, class_token, args, deadline) for k in range(args.students)]
    for st in students:
        st.start()
        time.sleep(0.2)
    for st in students:
        st.join()
    q = open_lab(args.runs, room=True)
    t_drain = time.time()
    while time.time() - t_drain < args.drain_s:
        q.recover_stale()
        if all(r["state"] in FINAL for r in q.index.query()):
            break
        time.sleep(2)
    drained_s = time.time() - t_drain
    rows = q.index.query()
    owners = {r["id"]: r["owner"] for r in rows}
    leaks = []
    for st in students:
        if st.session is None:
            continue
        text = "\n".join(str(m) for m in st.session.all)
        leaks += [f"{st.student} received {rid} ({o}'s)" for rid, o in owners.items()
                  if o != st.student and rid in text]
        leaks += [f"{st.student} received {o.student}'s token" for o in students
                  if o is not st and o.token and o.token in text]
        if admin_token in text:
            leaks.append(f"{st.student} received the teacher's token")
        st.session.close()
    app.send_signal(signal.SIGTERM)
    app_rc = app.wait(timeout=60)
    stop_line = next((line for line in log_path.read_text().splitlines() if "commlab UI stopped" in line), None)
    states = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    # nothing lost: every run a student's Start queued is in the index, theirs, and final
    lost = [f"{st.student}: {rid}" for st in students for rid in st.run_ids
            if rid not in owners or owners[rid] != st.student]
    whole = {st.student: 0.0 for st in students}  # runs started before the deadline, whole
    clipped = {st.student: 0.0 for st in students}  # run time inside the measured minutes only
    for r in rows:
        if r["started"] and r["ended"] and r["started"] < deadline and r["owner"] in whole:
            whole[r["owner"]] += r["ended"] - r["started"]
            clipped[r["owner"]] += min(r["ended"], deadline) - r["started"]
    run_len = [r["ended"] - r["started"] for r in rows if r["started"] and r["ended"]]

    def spread(share):
        mean = statistics.mean(share.values()) if share else 0.0
        return max(abs(v - mean) / mean for v in share.values()) if mean else None
    home = [x for st in students for x in st.home_s]
    watch = [x for st in students for x in st.watch_s]
    res = {
        "command": "python bench/workshop.py " + " ".join(sys.argv[1:]),
        "students": args.students, "minutes": args.minutes, "preset_steps": args.steps,
        "max_jobs": args.max_jobs, "queued_quota": args.queued, "think_s": args.think_s, "cpus": os.cpu_count(),
        "presets_started": sum(len(st.groups) for st in students),
        "presets_by_key": {k: sum(1 for st in students for g in st.groups if g[0] == k)
                           for k in sorted({g[0] for st in students for g in st.groups})},
        "runs": len(rows), "states": states, "all_final": all(r["state"] in FINAL for r in rows),
        "drain_s": round(drained_s, 1), "lost": lost,
        "leaks": leaks, "errors": {st.student: st.errors for st in students if st.errors},
        "refused_by_quota": sum(len(st.refused) for st in students),
        "home_s": {"n": len(home), "median": statistics.median(home) if home else None, "p90": pct(home, 90)},
        "watch_s": {"n": len(watch), "median": statistics.median(watch) if watch else None,
                    "p90": pct(watch, 90)},
        "run_length_s": {"n": len(run_len), "median": statistics.median(run_len) if run_len else None,
                         "min": min(run_len) if run_len else None, "max": max(run_len) if run_len else None},
        "run_time_s_by_student": {k: round(v, 1) for k, v in whole.items()},
        "fairness_max_deviation": spread(whole),
        "run_time_in_window_s_by_student": {k: round(v, 1) for k, v in clipped.items()},
        "fairness_in_window_max_deviation": spread(clipped),
        "app_exit": app_rc, "app_stop": stop_line,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    ok = res["all_final"] and not leaks and not lost and not res["errors"] and states.get("failed", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
