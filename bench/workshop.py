"""A room's worth of load on the workshop server: N simulated students against `commlab app --host 0.0.0.0`.

Each student is a websocket session (bench/wsclient.py: what a browser tab sends and receives, without
drawing anything). It signs in through the sign-in form (the class token, then a name), then until the
time is up: opens Home (timed), queues a small run through the New run form whenever it has fewer than
its quota of runs queued or running, and watches its latest run's Live run page (timed), with a think
time between requests. The lab runs with ``max_jobs`` slots, so the queue is full the whole time.

At the end it waits for every run to end and checks:
- every run is in a final state, and none failed;
- no session received the id of a run that was not its own (nothing is shared here);
- the Home page's response time (request to end of the script run), median and 90th percentile;
- fairness: the run time each student got, from runs started before the deadline, against the mean.

    flock /tmp/commlab-cpu.lock python bench/workshop.py --students 4 --minutes 3 --steps 30
"""
from __future__ import annotations

import argparse
import json
import os
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

from bench.wsclient import Session  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Student(threading.Thread):
    def __init__(self, name: str, url: str, class_token: str, args, deadline: float):
        super().__init__(name=name, daemon=True)
        self.student, self.url, self.class_token, self.args, self.deadline = name, url, class_token, args, deadline
        self.home_s, self.live_s, self.submitted, self.refused, self.errors = [], [], [], [], []
        self.retries = []
        """Sign-in pages that came back without the form (asked again; reported)."""
        self.session = None

    def run(self):
        import traceback
        try:
            self._run()
        except Exception as e:  # reported in the results, never swallowed
            where = traceback.extract_tb(e.__traceback__)[-1]
            self.errors.append(f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})")

    def _run(self):
        from lab.queue import Lab
        s = self.session = Session(self.url)
        for attempt in range(3):
            page = s.run(f"token={self.class_token}")
            name_id, submit_id = page.widget("access.name_in"), page.widget("FormSubmitter:access.name-Sign in")
            if name_id and submit_id:
                break
            self.retries.append(f"attempt {attempt}: the sign-in form was not in the reply: {page.kinds()} "
                                f"{page.exceptions()}")
        else:
            raise RuntimeError(f"{self.student}: no sign-in form after 3 tries")
        page = s.run(f"token={self.class_token}", widgets={name_id: self.student, submit_id: True})
        token = (page.query_string or "").partition("token=")[2].split("&")[0]
        if not token:
            raise RuntimeError(f"{self.student}: sign-in gave no personal token")
        q = Lab(self.args.runs)
        while time.time() < self.deadline:
            page = s.run(f"token={token}")
            self.home_s.append(page.seconds)
            active = [r for r in q.index.query(owner=self.student) if r["state"] in ("queued", "running")]
            if len(active) < self.args.queued:
                form = s.run(f"token={token}", page="new_run")
                ids = {k: form.widget(k) for k in ("nr.steps", "nr.eval_every", "nr.submit")}
                got = s.run(f"token={token}", page="new_run",
                            widgets={ids["nr.steps"]: self.args.steps, ids["nr.eval_every"]: self.args.steps,
                                     ids["nr.submit"]: True})
                rid = (got.query_string or "").partition("run=")[2].split("&")[0]
                if rid:
                    self.submitted.append(rid)
                elif "quota" in got.text:
                    self.refused.append(time.time())
                else:
                    raise RuntimeError(f"{self.student}: the New run form queued nothing: {got.exceptions()}")
            if self.submitted:
                page = s.run(f"token={token}&run={self.submitted[-1]}", page="live_run")
                self.live_s.append(page.seconds)
            time.sleep(self.args.think_s)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--students", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=30, help="steps of each student's run (cnn on digits)")
    ap.add_argument("--queued", type=int, default=2, help="runs each student keeps queued (its quota)")
    ap.add_argument("--max-jobs", type=int, default=1, help="slots of the lab's queue")
    ap.add_argument("--think-s", type=float, default=2.0, help="pause between a student's requests")
    ap.add_argument("--drain-s", type=float, default=600.0, help="how long to wait for the runs to end")
    ap.add_argument("--runs", default=None, help="runs directory (default: a fresh temporary one)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "workshop.json"))
    args = ap.parse_args(argv)
    args.runs = Path(args.runs or tempfile.mkdtemp(prefix="commlab-workshop-"))
    args.runs.mkdir(parents=True, exist_ok=True)
    (args.runs / "lab.json").write_text(json.dumps({"max_jobs": args.max_jobs, "quotas": {
        "queued": args.queued, "steps": args.steps, "world_size": 2}}))
    from lab import workshop
    from lab.store import FINAL
    port = free_port()
    log_path = args.runs / "app.log"
    env = {k: v for k, v in os.environ.items() if k != workshop.ACCESS_ENV}
    code = (f"import sys; from lab.ui import app_main; "
            f"sys.exit(app_main({port}, {str(args.runs)!r}, host='0.0.0.0', demo=False))")
    with open(log_path, "wb") as log:
        app = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), env=env, start_new_session=True,
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    # Stopped early (Ctrl-C, a timeout's SIGTERM), the bench still stops the app and the runs it queued:
    # they live in the bench's own runs directory, and nothing else would end them.
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return _measure(args, app, url, log_path)
    finally:
        if app.poll() is None:
            app.send_signal(signal.SIGTERM)
            app.wait(timeout=60)
        import lab
        for r in lab.runs(runs=args.runs):
            if r.state not in FINAL:
                lab.cancel(r.id, runs=args.runs)


def _measure(args, app, url, log_path) -> int:
    from lab import workshop
    from lab.queue import Lab
    from lab.store import FINAL
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
    class_token = workshop.load_access(args.runs)["class_token"]
    started = time.time()
    deadline = started + args.minutes * 60
    students = [Student(f"student{k:02d}", url, class_token, args, deadline) for k in range(args.students)]
    for st in students:
        st.start()
        time.sleep(0.2)
    for st in students:
        st.join()
    q = Lab(args.runs)
    t_drain = time.time()
    while time.time() - t_drain < args.drain_s:
        q.recover_stale()
        if all(r["state"] in FINAL for r in q.index.query()):
            break
        time.sleep(2)
    rows = q.index.query()
    owners = {r["id"]: r["owner"] for r in rows}
    leaks = []
    for st in students:
        if st.session is None:
            continue
        text = "\n".join(str(m) for m in st.session.all)
        leaks += [f"{st.student} received {rid} ({o}'s)" for rid, o in owners.items()
                  if o != st.student and rid in text]
        st.session.close()
    app.send_signal(signal.SIGTERM)
    app_rc = app.wait(timeout=60)
    stop_line = next((line for line in log_path.read_text().splitlines() if "commlab UI stopped" in line), None)
    states = {}
    for r in rows:
        states[r["state"]] = states.get(r["state"], 0) + 1
    share = {st.student: 0.0 for st in students}
    for r in rows:
        if r["started"] and r["ended"] and r["started"] < deadline and r["owner"] in share:
            share[r["owner"]] += r["ended"] - r["started"]
    mean = statistics.mean(share.values()) if share else 0.0
    spread = max(abs(v - mean) / mean for v in share.values()) if mean else None
    home = [x for st in students for x in st.home_s]
    live = [x for st in students for x in st.live_s]
    res = {
        "students": args.students, "minutes": args.minutes, "steps": args.steps, "max_jobs": args.max_jobs,
        "queued_quota": args.queued, "think_s": args.think_s, "cpus": os.cpu_count(),
        "runs": len(rows), "states": states, "all_final": all(r["state"] in FINAL for r in rows),
        "leaks": leaks, "errors": {st.student: st.errors for st in students if st.errors},
        "sign_in_retries": {st.student: st.retries for st in students if st.retries},
        "refused_by_quota": sum(len(st.refused) for st in students),
        "home_s": {"n": len(home), "median": statistics.median(home) if home else None, "p90": pct(home, 90)},
        "live_s": {"n": len(live), "median": statistics.median(live) if live else None, "p90": pct(live, 90)},
        "run_time_s_by_student": {k: round(v, 1) for k, v in share.items()},
        "fairness_max_deviation": spread,
        "app_exit": app_rc, "app_stop": stop_line,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    ok = res["all_final"] and not leaks and not res["errors"] and states.get("failed", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
