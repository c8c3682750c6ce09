"""The workshop server (commlab/room/owners.py, commlab/room/accounts.py, commlab/app/room/access.py): the in-script gate, per-user runs,
the fair queue and quotas, tested as a student or an outsider would try them: no session, a wrong one,
another student's run id, path tricks in ids. Sign-in itself (tokens for sessions, in plain HTTP before
Streamlit) is tests/test_accounts.py's."""
import json
import os
import re

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

import commlab  # noqa: E402
from commlab.app.room import access  # noqa: E402
from commlab.lab.front import groups, new_run, sweep_jobs, ui  # noqa: E402
from commlab.room import accounts  # noqa: E402
from commlab.room import owners
from commlab.room import open_lab  # noqa: E402
from commlab.lab.base.errors import LabError  # noqa: E402
from commlab.lab.service.queue import Lab  # noqa: E402
from commlab.lab.rundir import launcher  # noqa: E402
from commlab.lab.rundir.store import RunError
from test_app import ENTRY, SMALL  # noqa: E402
from distutil import stop_process  # noqa: E402
from commlab.lab.analysis.presets import PRESETS  # noqa: E402
from commlab.lab.base.kept import Kept  # noqa: E402

TRICKS = ["../../../etc/passwd", "/etc/passwd", "..", "%2e%2e%2f%2e%2e%2fetc%2fpasswd", "..%2f..%2f", "a/../../b",
          "./spec.json", "x\x00y", "access.json", "../access.json", "~root"]


@pytest.fixture
def room(tmp_path, monkeypatch):
    """A runs directory served as on 0.0.0.0: two students with a queued run each (bob's shared), one
    of the local user's, and the tokens."""
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    monkeypatch.setenv(accounts.ACCESS_ENV, "token")
    access = accounts.load_access(tmp_path)
    tokens = {"class": access["class_token"], "admin": access["admin_token"],
              "alice": accounts.sign_in(tmp_path, access["class_token"], "alice"),
              "bob": accounts.sign_in(tmp_path, access["class_token"], "bob"),
              "carol": accounts.sign_in(tmp_path, access["class_token"], "carol")}
    q = open_lab(tmp_path, room=True)
    spec = commlab.spec(SMALL)
    runs = {o: q.create(spec, owner=o) for o in ("alice", "bob")}
    runs["local"] = q.create(spec)
    ui.share(runs["bob"].id)
    yield tmp_path, runs, tokens
    ui.set_viewer(None)


def app(token=None, page=None, **params) -> AppTest:
    """The app as a browser that signed in with ``token`` sees it: the session the gatekeeper would have
    opened for it (a token that opens none, e.g. the class token, is handed over as the session id)."""
    at = AppTest.from_file(ENTRY, default_timeout=120)
    if token is not None:
        opened = accounts.open_session(os.environ["COMMLAB_RUNS"], token)
        at.session_state[access.SESSION] = opened[0] if opened else token
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    if page:
        at.switch_page(f"views/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def everything(at) -> str:
    """Every message the script sent to the browser (each element's protobuf, as text), as one string:
    what must not be there is looked for in all of it."""
    out = []

    def walk(node):
        if getattr(node, "proto", None) is not None:
            out.append(str(node.proto))
        kids = getattr(node, "children", None) or {}
        for c in (kids.values() if isinstance(kids, dict) else kids):
            walk(c)
    walk(at._tree)
    return "\n".join(out)


def signed_out(at, runs) -> None:
    assert [t.value for t in at.title] == ["commlab: sign in"]
    assert not at.sidebar.button  # no page's widgets, no sign-out
    text = everything(at)
    for r in runs.values():
        assert r.id not in text
    assert not at.get("plotly_chart") and not at.get("download_button") and not at.dataframe


# --------------------------------------------------------------------------- sign-in

def test_no_token_gets_only_the_sign_in_prompt(room):
    root, runs, tokens = room
    for page in (None, "live_run", "compare", "results", "sweeps", "model", "new_run"):
        at = AppTest.from_file(ENTRY, default_timeout=120)
        at.run()
        signed_out(at, runs)
        if page:  # a page's URL without a token: the gate stops the script before any page runs
            at.switch_page(f"views/{page}.py").run()
            assert not at.exception, [e.value for e in at.exception]
            signed_out(at, runs)


@pytest.mark.parametrize("bad", ["wrong", "", "A" * 24, "../access.json", "x" * 500, "class"])
def test_a_token_or_a_wrong_session_id_is_no_session(room, bad):
    """Whatever the session id a request carries, unless it is an open session's, the script gives the
    pointer to the sign-in page and stops: a token (even the admin's or the class token) is no session id."""
    root, runs, tokens = room
    at = AppTest.from_file(ENTRY, default_timeout=120)
    at.session_state[access.SESSION] = tokens.get(bad, bad)
    at.query_params["run"] = runs["alice"].id
    at.query_params["token"] = tokens["alice"]  # the script never reads a token from the address
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    signed_out(at, runs)
    for t in ("admin", "alice"):
        at.session_state[access.SESSION] = tokens[t]
        at.run()
        signed_out(at, runs)


def test_a_session_lasts_across_requests_and_signing_out_ends_it(room):
    root, runs, tokens = room
    at = app(tokens["alice"], run=runs["alice"].id, page="live_run")
    sid = at.session_state[access.SESSION]
    assert accounts.session_user(root, sid) == owners.User("alice")
    at.run()  # the next request (a click, a page) is still alice's, from the session
    assert runs["alice"].id in everything(at) and runs["bob"].id in everything(at)  # bob's is shared
    assert runs["local"].id not in everything(at)
    at.sidebar.button(key="access.out").click().run()
    signed_out(at, runs)
    assert accounts.session_user(root, sid) is None  # closed on the server: the cookie is worth nothing now
    at.run()
    signed_out(at, runs)


def test_students_are_not_shown_the_runs_directory(room):
    root, runs, tokens = room
    assert str(root) not in everything(app(tokens["alice"]))
    assert str(root) not in everything(app(tokens["carol"], page="live_run"))  # carol has no runs
    assert str(root) in everything(app(tokens["admin"]))


def test_revoke_signs_the_student_out_and_keeps_the_name(room, capsys):
    from commlab.lab.front import cli
    root, runs, tokens = room
    at = app(tokens["alice"])
    assert [t.value for t in at.title] == ["commlab"]
    assert cli.main(["workshop", "revoke", "alice", "--runs", str(root)]) == 0
    assert "revoked alice (1 token(s)): their sessions end at their next request" in capsys.readouterr().out
    at.run()  # the open page's next request: the sign-in pointer, from the session that ended
    signed_out(at, runs)
    assert accounts.check_token(root, tokens["alice"]) is None and accounts.check_token(root, tokens["bob"])
    with pytest.raises(LabError, match="'alice' was revoked"):
        accounts.sign_in(root, tokens["class"], "alice")
    assert cli.main(["workshop", "revoke", "mallory", "--runs", str(root)]) == 2
    assert capsys.readouterr().err.strip().startswith("commlab: error: name: no student 'mallory'; signed in: ")
    assert cli.main(["workshop", "users", "--runs", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["bob", "carol"]
    assert all("token expires in 14.0 days, 0 open session(s)" in line for line in out), out
    assert commlab.get(runs["alice"].id, runs=root).status()["owner"] == "alice"  # the runs stay hers


def test_loopback_needs_no_token(room, monkeypatch):
    root, runs, tokens = room
    monkeypatch.setenv(accounts.ACCESS_ENV, "off")
    at = app()
    assert [t.value for t in at.title] == ["commlab"]
    assert all(r.id in everything(at) for r in runs.values())  # the local user sees every run


def test_access_mode():
    assert accounts.access_mode("127.0.0.1", "token") == "off"  # an explicit loopback address
    assert accounts.access_mode("::1", None) == "off"
    assert accounts.access_mode("localhost", None) == "off"
    for exposed in ("0.0.0.0", "192.168.1.5", "::"):
        assert accounts.access_mode(exposed, "off") == "token"  # exposed: the environment cannot turn it off
    assert accounts.access_mode(None, "") == "token"  # unset, and Streamlit's default binds every interface
    assert accounts.access_mode(None, "off") == "off"
    with pytest.raises(LabError, match="COMMLAB_ACCESS: must be 'token' or 'off', got 'maybe'"):
        accounts.access_mode(None, "maybe")


def test_access_file_is_private_and_checked(tmp_path):
    data = accounts.load_access(tmp_path)
    assert oct(accounts.access_path(tmp_path).stat().st_mode & 0o777) == "0o600"
    tok = accounts.sign_in(tmp_path, data["class_token"], "erin")
    assert tok not in accounts.access_path(tmp_path).read_text()  # only its hash is stored
    assert accounts.check_token(tmp_path, data["class_token"]) is None  # the class token alone is nobody
    assert accounts.check_token(tmp_path, data["admin_token"]).admin
    with pytest.raises(LabError, match="token: not the class token"):
        accounts.sign_in(tmp_path, data["admin_token"] + "x", "frank")
    for reserved in ("teacher", "Teacher", accounts.local_user().name):
        with pytest.raises(LabError, match="is reserved"):
            accounts.sign_in(tmp_path, data["class_token"], reserved)
    accounts.access_path(tmp_path).write_text(json.dumps({"class_token": "short", "admin_token": "y" * 20}))
    with pytest.raises(LabError, match="class_token must be a string of at least 8 characters"):
        accounts.load_access(tmp_path)
    with pytest.raises(LabError, match="--token: must be at least 16 characters"):
        accounts.set_class_token(tmp_path / "other", "a b")


# --------------------------------------------------------------------------- per-user runs

def test_a_student_sees_own_and_shared_runs_only(room):
    root, runs, tokens = room
    at = app(tokens["alice"])
    text = everything(at)
    assert runs["alice"].id in text and runs["bob"].id in text  # bob's is shared
    assert runs["local"].id not in text
    at = app(tokens["carol"], page="compare")
    text = everything(at)
    assert runs["alice"].id not in text and runs["local"].id not in text and runs["bob"].id in text
    at = app(tokens["admin"])
    assert all(r.id in everything(at) for r in runs.values())  # the teacher sees everything


def test_another_students_run_id_shows_nothing(room):
    root, runs, tokens = room
    at = app(tokens["carol"], page="live_run", run=runs["alice"].id)
    assert runs["alice"].id not in [s.value for s in at.selectbox]
    assert at.selectbox(key="live.pick").value == runs["bob"].id  # falls back to what carol may see
    assert not any(b.key == "live.cancel" for b in at.button)  # bob's run is shared, not carol's to cancel
    # through the UI's functions, as a page would call them
    ui.set_viewer(lambda: owners.User("carol"))
    assert ui.get_run(runs["alice"].id) is None
    with pytest.raises(RunError, match="no run"):
        ui.cancel(runs["alice"].id)
    with pytest.raises(LabError, match="belongs to bob; only its owner or the teacher may cancel it"):
        ui.cancel(runs["bob"].id)
    with pytest.raises(LabError, match="belongs to bob"):
        ui.share(runs["bob"].id, False)
    assert commlab.get(runs["alice"].id, runs=root).state == "queued"  # nothing was cancelled
    ui.set_viewer(lambda: owners.User("alice"))
    assert ui.cancel(runs["alice"].id) == "cancelled"


@pytest.mark.parametrize("trick", TRICKS)
def test_path_tricks_in_ids_show_nothing(room, trick):
    root, runs, tokens = room
    for page, param in (("live_run", "run"), ("results", "group"), ("results", "sweep")):
        at = app(tokens["carol"], page=page, **{param: trick})
        text = everything(at)
        assert "root:" not in text and runs["alice"].id not in text and tokens["admin"] not in text
    ui.set_viewer(lambda: owners.User("carol"))
    assert ui.get_run(trick) is None
    for fn in (ui.cancel, ui.share, ui.get_run_or_raise):
        with pytest.raises(LabError):
            fn(trick)
    with pytest.raises((KeyError, LabError)):
        groups.preset_group(trick)
    with pytest.raises(LabError):
        sweep_jobs.load_sweep(trick)


EVIL_NAME = "[click](http://evil.example) ![img](http://evil.example/x.png) <img src=x onerror=alert(1)> :red[x]"


@pytest.mark.parametrize("page", [None, "live_run", "compare", "results"])
def test_a_runs_name_is_shown_as_text_on_the_teachers_pages(room, page):
    """A student's run named with Markdown, HTML and Streamlit directives: the teacher's pages show the
    characters, never a link, an image, a tag or a colour."""
    root, runs, tokens = room
    q = open_lab(root, room=True)
    evil = q.create(commlab.spec(dict(SMALL, name=EVIL_NAME)), owner="alice")
    at = app(tokens["admin"], page=page, run=evil.id)
    text = everything(at)
    assert evil.id in text or page in ("compare", "results")
    # what Streamlit renders as Markdown: bodies and labels (options, tables and the like are plain text)
    md = "\n".join(line for line in text.splitlines() if line.strip().startswith(("body:", "label:")))
    assert "click" in md or page is not None  # Home links to it by name
    for raw in ("[click](", "![img](", "<img src", ":red["):  # only with a backslash before it: shown as typed
        assert not re.search(r"(?<!\\)" + re.escape(raw), md), (raw, page, [b for b in md.splitlines() if raw in b][:2])


def test_sweeps_are_the_teachers(room):
    root, runs, tokens = room
    ui.set_viewer(lambda: owners.User("alice"))
    assert sweep_jobs.list_sweeps() == []
    with pytest.raises(LabError, match="sweeps: only the teacher"):
        sweep_jobs.start_sweep(sweep_jobs.sweep_data("s", SMALL, {"compressor.name": ["none"]}))


def test_runs_record_their_owner(tmp_path):
    q = open_lab(tmp_path, room=True)
    local = q.create(commlab.spec(SMALL))
    mine = q.create(commlab.spec(SMALL), owner="alice")
    assert local.status()["owner"] == owners.local_user().name  # the CLI and the API: the local user
    assert mine.status()["owner"] == "alice"
    assert [r["owner"] for r in q.index.query()] == [owners.local_user().name, "alice"]
    assert [r["id"] for r in q.index.query(owner="alice")] == [mine.id]


def test_commlab_runs_filters_by_owner(room, capsys):
    from commlab.lab.front.cli import main
    root, runs, tokens = room
    assert main(["runs", "--owner", "alice", "--runs", str(root)]) == 0
    out = capsys.readouterr().out
    assert runs["alice"].id in out and runs["bob"].id not in out and runs["local"].id not in out


def test_sharing_from_the_live_page(room):
    root, runs, tokens = room
    at = app(tokens["alice"], page="live_run", run=runs["alice"].id)
    assert at.toggle(key="live.share").value is False
    at.toggle(key="live.share").set_value(True).run()
    assert not at.exception, [e.value for e in at.exception]
    assert commlab.get(runs["alice"].id, runs=root).status()["shared"] is True
    assert runs["alice"].id in everything(app(tokens["carol"], page="compare"))  # now the class sees it
    at = app(tokens["carol"], page="live_run", run=runs["alice"].id)
    assert at.selectbox(key="live.pick").value == runs["alice"].id
    assert not any(t.key == "live.share" for t in at.toggle)  # not carol's to unshare


# --------------------------------------------------------------------------- fair queue and quotas

def test_fair_order_is_round_robin_over_owners():
    rows = [{"id": f"{o}{i}", "owner": o, "created": t} for t, (o, i) in
            enumerate([("a", 1), ("a", 2), ("a", 3), ("b", 1), ("a", 4), ("c", 1), ("b", 2)])]
    assert owners.fair_order(rows) == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]
    # a user with a run going waits behind those with none
    assert owners.fair_order(rows, running=[{"id": "x", "owner": "a"}])[:3] == ["b1", "c1", "a1"]
    # one user: first come, first served
    assert owners.fair_order([r for r in rows if r["owner"] == "a"]) == ["a1", "a2", "a3", "a4"]


def test_fair_order_serves_first_who_had_least_run_time():
    """A preset queues its runs at once. When s00's first run ends, its second is older than s13's first:
    it must still wait behind every owner who has had less run time (the workshop bench's 20 students:
    s00 got two runs before s13 got one, 86% off the mean share), and an owner whose one run was long
    waits behind owners with two short ones (by turns, one 35.6 s run put a share 109% off the mean)."""
    queued = [{"id": "s00-2", "owner": "s00", "created": 0.0, "started": None},
              {"id": "s13-1", "owner": "s13", "created": 1.0, "started": None},
              {"id": "s13-2", "owner": "s13", "created": 1.0, "started": None},
              {"id": "s07-1", "owner": "s07", "created": 0.5, "started": None}]
    done = [{"id": "s00-1", "owner": "s00", "created": 0.0, "started": 21.0, "ended": 30.0},
            {"id": "s07-0", "owner": "s07", "created": -9.0, "started": 5.0, "ended": 8.0}]
    got = owners.run_time(queued + done)
    assert got == {"s00": 9.0, "s07": 3.0}
    typical = owners.typical_run(queued + done)
    assert typical == 9.0  # the median of 3 and 9 s (upper middle)
    # s13 (0 s), s07 (3 s), then s00 (9 s) and s13 (charged 9 s for its first): a tie, the older run first
    assert owners.fair_order(queued, received=got, typical=typical) == ["s13-1", "s07-1", "s00-2", "s13-2"]
    assert owners.fair_order(queued) == ["s00-2", "s07-1", "s13-1", "s13-2"]  # nothing received: by age
    # one long run outweighs two short ones
    long = [{"id": "a1", "owner": "a", "started": 0.0, "ended": 36.0},
            {"id": "b1", "owner": "b", "started": 36.0, "ended": 45.0},
            {"id": "b2", "owner": "b", "started": 45.0, "ended": 54.0}]
    nxt = [{"id": "a2", "owner": "a", "created": 1.0}, {"id": "b3", "owner": "b", "created": 2.0}]
    assert owners.fair_order(nxt, received=owners.run_time(long), typical=9.0) == ["b3", "a2"]
    # a running run charges what it has run so far (at least the typical length)
    assert owners.fair_order(nxt, running=[{"id": "b4", "owner": "b", "started": 0.0}], received={"a": 36.0},
                               typical=9.0, now=40.0) == ["a2", "b3"]
    assert owners.fair_order(nxt, running=[{"id": "b4", "owner": "b", "started": 39.0}], received={"a": 36.0},
                               typical=9.0, now=40.0) == ["b3", "a2"]


def test_queue_position_follows_the_fair_order(tmp_path):
    """Supervisors that are alive (this process) for a's three runs and b's one: b's run, queued last,
    comes second."""
    from commlab.lab.base import procs
    q = open_lab(tmp_path, max_jobs=8, room=True)
    spec = commlab.spec(SMALL)
    a = [q.create(spec, owner="a") for _ in range(3)]
    b = q.create(spec, owner="b")
    for r in (*a, b):
        r.set_status("queued", supervisor=procs.identity())
    assert [q.queue_position(r) for r in a] == [0, 2, 3]
    assert q.queue_position(b) == 1
    assert q.queue_position(a[2], upto=1) == 1  # counted only as far as asked (supervisors far back poll slower)


def test_a_supervisor_far_back_waits_without_importing_torch(tmp_path, monkeypatch):
    """A queued supervisor validates its spec (which imports torch) only when it is near the head of the
    queue: a room's supervisors doing it all at once on joining stalled the run going. Three live runs
    ahead of it with one slot: it polls, never reads its spec, and ends cancelled when asked."""
    import threading
    import time
    from commlab.lab.base import procs
    from commlab.lab.service.queue import NEAR
    from commlab.lab.rundir.store import Run
    q = open_lab(tmp_path, max_jobs=1, room=True)
    spec = commlab.spec(SMALL)
    ahead = [q.create(spec, owner=o) for o in ("a", "b", "c")]
    for r in ahead:
        r.set_status("queued", supervisor=procs.identity())
    me = q.create(spec, owner="d")
    me.set_status("queued", supervisor=procs.identity())
    assert q.queue_position(me, upto=1 + NEAR) == 1 + NEAR
    read = []
    real = Run.spec
    monkeypatch.setattr(Run, "spec", lambda self: read.append(self.id) or real(self))
    got = []
    t = threading.Thread(target=lambda: got.append(q.supervise(me)))
    t.start()
    time.sleep(2.5)  # two polls or more
    me.file("cancel.request").write_text("now\n")
    t.join(timeout=30)
    assert got == ["cancelled"] and me.id not in read


def quota_file(root, quotas):
    (root / "lab.json").write_text(json.dumps({"quotas": quotas}))


def test_quotas_refuse_with_the_limit_named(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    quota_file(tmp_path, {"queued": 2, "steps": 50, "world_size": 2, "wall_s": 30})
    ui.set_viewer(lambda: owners.User("alice"))
    try:
        with pytest.raises(LabError, match=r"^quota steps: at most 50 steps per run, asked for 51$"):
            new_run.submit(dict(SMALL, steps=51))
        with pytest.raises(LabError, match=r"^quota world_size: at most 2 ranks per run, asked for 3$"):
            new_run.submit(dict(SMALL, world_size=3))
        q = open_lab(tmp_path, room=True)
        for _ in range(2):
            q.create(commlab.spec(SMALL), owner="alice")
        with pytest.raises(LabError, match=r"^quota queued: alice may have 2 runs queued or running at once; 2 are, "
                                           r"and this asks for 1 more$"):
            new_run.submit(SMALL)
        preset = PRESETS[0]
        with pytest.raises(LabError, match="quota"):
            groups.start_preset(preset)
        assert len(q.index.query()) == 2  # nothing was queued by a refused request
        ui.set_viewer(lambda: owners.User("teacher", admin=True))
        run = new_run.submit(dict(SMALL, steps=51))  # the teacher has no limits
        commlab.cancel(run.id, runs=tmp_path)
        commlab.wait(run.id, runs=tmp_path, timeout=60)
    finally:
        ui.set_viewer(None)


def test_the_results_pages_groups_are_those_whose_runs_the_viewer_may_see_read_from_the_index(tmp_path, monkeypatch):
    """The Results page lists the preset groups the viewer may see (every run of the group theirs or shared) on
    every load: who may see each run comes from the run index in one query, not from every run's status (0.87 s
    of CPU for a student with 1,500 groups of others in the room; 0.12-0.20 s now)."""
    from commlab.lab.analysis import results
    from commlab.lab.rundir.store import Run
    from distutil import counted
    lab = open_lab(tmp_path, room=True)
    a, b1, b2, b3 = (lab.create(commlab.spec(SMALL), owner=o) for o in ("alice", "bob", "bob", "bob"))
    mine, bobs, shown, mixed = (results.save_group(tmp_path, "dear-vs-ddp", {"x": r1.id, "y": r2.id})
                                for r1, r2 in ((a, a), (b1, b1), (b2, b2), (b3, a)))  # id: its first run's
    calls = {"status": 0}
    monkeypatch.setattr(Run, "status", counted(calls, "status", Run.status))
    try:
        ui.set_viewer(lambda: owners.User("bob"))
        ui.share(b2.id, runs=tmp_path)
        calls["status"] = 0
        ui.set_viewer(lambda: owners.User("alice"))
        assert sorted(g["id"] for g in groups.preset_groups(tmp_path)) == sorted([mine, shown])
        assert calls["status"] == 0
        ui.set_viewer(lambda: owners.User(owners.TEACHER, admin=True))
        assert sorted(g["id"] for g in groups.preset_groups(tmp_path)) == sorted([mine, bobs, shown, mixed])
        ui.set_viewer(lambda: owners.User("bob"))
        ui.share(b2.id, False, runs=tmp_path)
        ui.set_viewer(lambda: owners.User("alice"))
        assert [g["id"] for g in groups.preset_groups(tmp_path)] == [mine]
    finally:
        ui.set_viewer(None)


def test_a_run_whose_supervisor_died_does_not_count_against_queued(tmp_path, monkeypatch):
    """The pages look for dead supervisors at most every few seconds; a submit looks itself before it counts a
    student's queued runs, so one that died just now does not hold their place. It looks at that student's
    unfinished runs only (every run's status is a second's reading at thousands of runs, on every click)."""
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    quota_file(tmp_path, {"queued": 1})
    dead, bobs = (open_lab(tmp_path, room=True).create(commlab.spec(SMALL), owner=who) for who in ("alice", "bob"))
    for r in (dead, bobs):
        r.update_status(created=r.status()["created"] - 60)  # queued a minute ago; nobody supervises it
    ui.set_viewer(lambda: owners.User("alice"))
    try:
        monkeypatch.setitem(ui._recovered, str(tmp_path), ui.time.monotonic())  # a page's list looked just now
        assert dead.id in [r.id for r in ui.list_runs(tmp_path, state="queued")]  # and does not look again yet
        looked, recover = [], Lab.recover_stale
        monkeypatch.setattr(Lab, "recover_stale", lambda self, ids=None: looked.append(ids) or recover(self, ids))
        (run,) = ui.queue_runs(tmp_path, [commlab.spec(dict(SMALL, steps=2))])
        assert dead.state == "failed" and dead.status()["error"].startswith("stale: ")
        assert looked == [[dead.id]]  # hers, not bob's (his is left to the pages' next look)
        assert commlab.wait(run.id, runs=tmp_path, timeout=120) == "done"
    finally:
        ui.set_viewer(None)


@pytest.mark.parametrize("quotas,msg", [
    ({"queued": 0}, "quotas.queued: must be a positive integer or null (no limit), got 0"),
    ({"steps": 1.5}, "quotas.steps: must be a positive integer or null (no limit), got 1.5"),
    ({"wall_s": "600"}, "quotas.wall_s: must be a positive number or null (no limit), got '600'"),
    ({"gpus": 1}, "quotas: unknown limit 'gpus'; allowed: queued, steps, world_size, batch_size, examples, "
                  "data_mb, threads, params, tensors, wall_s, rank_mb"),
    ([1], "quotas: must be an object"),
])
def test_bad_quotas_are_named(tmp_path, quotas, msg):
    (tmp_path / "lab.json").write_text(json.dumps({"quotas": quotas}))
    with pytest.raises(LabError, match=msg.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        owners.quotas(tmp_path)


def test_wall_time_quota_cancels_the_run_and_says_why(tmp_path):
    q = open_lab(tmp_path, room=True)
    run = q.submit(commlab.spec(dict(SMALL, steps=100000)), wait=True, owner="alice", wall_limit_s=3)
    st = run.status()
    assert st["state"] == "cancelled", st
    assert st["error"].startswith("quota wall_s: stopped after ") and "the limit is 3 s per run" in st["error"], st


def test_a_students_run_past_its_disk_quota_or_the_disks_free_floor_is_cancelled_and_says_why(tmp_path):
    """A run's directory grows while it runs (its timeline: steps x ranks x buckets): a student's run is
    cancelled by its supervisor when its directory passes ``disk_mb``, or when the disk's free space falls
    under ``free_mb`` (a run queued while there was room may start after others took it); the teacher's runs
    have neither limit. The limits are in the run's status, as its admission recorded them."""
    quota_file(tmp_path, {"disk_mb": 1})
    q = open_lab(tmp_path, room=True)
    long = commlab.spec(dict(SMALL, steps=100000))
    run = q.submit(long, wait=True, owner="alice")
    st = run.status()
    assert st["disk_limit_mb"] == 1 and st["free_limit_mb"] == owners.DEFAULT_QUOTAS["free_mb"], st
    assert st["state"] == "cancelled" and st["error"].startswith("quota disk_mb: stopped with "), st
    assert st["error"].endswith("MB in its directory; the limit is 1 MB per run (runs/lab.json quotas.disk_mb)")
    assert launcher.tree_mb(run.path) > 1
    quota_file(tmp_path, {"free_mb": 10**8})  # 100 TB: more than this disk has free
    run = q.submit(long, wait=True, owner="alice")
    st = run.status()
    assert st["state"] == "cancelled" and st["error"].startswith("quota free_mb: stopped with "), st
    assert "MB free on the runs directory's disk, under the 100000000 MB kept free" in st["error"]
    teachers = q.create(commlab.spec(dict(SMALL, steps=3)), owner=owners.TEACHER)
    assert not {"disk_limit_mb", "free_limit_mb"} & set(teachers.status())


# --------------------------------------------------------------------------- the real server, over the wire

@pytest.fixture(scope="module")
def exposed(tmp_path_factory):
    """`commlab app --host 0.0.0.0` over a runs directory with a run of alice's and one of bob's (not
    shared), driven at the websocket level as a browser would (bench/wsclient.py)."""
    import signal
    import subprocess
    import sys
    from test_app import ROOT, free_port, wait_health
    root = tmp_path_factory.mktemp("exposed")
    access = accounts.load_access(root)
    tokens = {"class": access["class_token"], "admin": access["admin_token"],
              **{o: accounts.sign_in(root, access["class_token"], o) for o in ("alice", "bob", "carol")}}
    q = open_lab(root, room=True)
    runs = {o: q.create(commlab.spec(SMALL), owner=o) for o in ("alice", "bob", "carol")}
    port = free_port()
    code = (f"import sys; from commlab.lab.front.appserver import app_main; "
            f"sys.exit(app_main({port}, {str(root)!r}, host='0.0.0.0', demo=False))")
    log_path = root / "app.log"
    env = {k: v for k, v in os.environ.items() if k != accounts.ACCESS_ENV}
    with open(log_path, "wb") as log:
        p = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), start_new_session=True, env=env,
                             stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, p, log_path)
        yield url, runs, tokens, log_path
    finally:
        stop_process(p, signal.SIGTERM, timeout=30)


def wire(url, query="", page="", token=None):
    """One script run over the websocket of a browser that signed in with ``token`` at /signin."""
    from bench.wsclient import Session, sign_in
    s = Session(url, cookie=sign_in(url, token).header if token else None)
    try:
        got = s.run(query, page=page)
        # page_info_changed hands the browser its own address back (once the gate took the token out of
        # it, the rest of what the request asked for, e.g. another student's run id it typed): never a
        # token, and not something the server found; everything else is looked through
        echoes = [m.page_info_changed.query_string for m in s.all if m.WhichOneof("type") == "page_info_changed"]
        assert not any("token" in q for q in echoes), echoes
        return got, "\n".join(str(m) for m in s.all if m.WhichOneof("type") != "page_info_changed")
    finally:
        s.close()


def test_exposed_server_prints_the_links(exposed):
    url, runs, tokens, log_path = exposed
    out = log_path.read_text()
    assert "students: http://" in out and f"/?token={tokens['class']}" in out
    # the admin token was made before the server started: only its hash is on disk, so it is never printed again
    assert "teacher:  the link printed when the admin token was made" in out and tokens["admin"] not in out
    assert "WARNING: served without TLS" in out


def test_over_the_wire_a_huge_message_is_refused_as_it_arrives(exposed):
    """A signed-in browser sending a 40 MB message: Streamlit closes a connection whose message is over 25 MB only
    after reading it whole (its log says so); the exposed lab refuses it past MESSAGE_MB while it arrives, so that
    line never comes, and the server goes on serving the others."""
    from streamlit.proto.BackMsg_pb2 import BackMsg

    from bench.wsclient import Session, sign_in
    from commlab.lab.front import appserver
    url, runs, tokens, log_path = exposed
    big = BackMsg()
    big.rerun_script.query_string = "x" * ((appserver.MESSAGE_MB + 8) << 20)
    s = Session(url, cookie=sign_in(url, tokens["carol"]).header)
    try:
        s.run("")
        s.send(big)
        with pytest.raises(Exception):  # the server closed the socket
            s.run("")
    finally:
        s.close()
    assert "exceeds the limit" not in log_path.read_text()  # never read whole
    page, text = wire(url, f"run={runs['carol'].id}", page="live_run", token=tokens["carol"])
    assert not page.exceptions() and runs["carol"].id in text


def test_over_the_wire_no_client_clears_the_servers_caches(exposed):
    """Streamlit's "clear cache" message empties every viewer's caches: refused from a student's socket
    (an outsider has no socket at all)."""
    from streamlit.proto.BackMsg_pb2 import BackMsg
    from bench.wsclient import Session, sign_in
    url, runs, tokens, log_path = exposed
    s = Session(url, cookie=sign_in(url, tokens["bob"]).header)
    try:
        s.run("")
        m = BackMsg()
        m.clear_cache = True
        s.send(m)
        page = s.run("")  # the session still works, and the request was refused
        assert "Signed in as" in page.text
    finally:
        s.close()
    assert "refused a websocket request to clear the server's caches" in log_path.read_text()


@pytest.mark.parametrize("token", [None, "wrong", "", "../access.json", "class"])
@pytest.mark.parametrize("page", ["", "live_run", "compare", "results", "sweeps", "model"])
def test_over_the_wire_no_valid_token_gets_nothing(exposed, token, page):
    """Without a session the websocket is refused before Streamlit sees it; a page's address answers with
    the way to /signin and nothing of the lab."""
    from bench.wsclient import Jar, Session, sign_in
    url, runs, tokens, _ = exposed
    jar = sign_in(url, tokens.get(token, token)) if token is not None else Jar()
    assert "commlab_session" not in jar.cookies
    with pytest.raises(Exception) as refused:
        Session(url, cookie=jar.header or None, timeout_s=10)
    assert "403" in str(refused.value), refused.value
    got = jar.request(url, "GET", f"/{page}?run={runs['alice'].id}")
    assert got.status == 303 and got.location == "/signin", (got.status, got.location)
    text = got.body + jar.request(url, "GET", "/signin").body
    assert "commlab: sign in" in text
    for r in runs.values():
        assert r.id not in text
    for t in tokens.values():
        assert t not in text


def test_over_the_wire_a_student_sees_only_their_own(exposed):
    url, runs, tokens, _ = exposed
    got, text = wire(url, f"run={runs['bob'].id}", "live_run", tokens["alice"])
    assert not got.exceptions(), got.exceptions()
    assert runs["alice"].id in text and runs["bob"].id not in text
    got, text = wire(url, f"run={runs['bob'].id}", "live_run", tokens["admin"])
    assert runs["alice"].id in text and runs["bob"].id in text  # the teacher sees both


@pytest.mark.parametrize("page", ["sweeps", "advisor"])
def test_over_the_wire_teacher_only_pages_are_not_a_students(exposed, page):
    """Sweeps and the Advisor run background jobs over every run: a student asking for their URL gets
    neither the page nor another student's run; the teacher gets the page."""
    url, runs, tokens, _ = exposed
    title = {"sweeps": "Sweeps", "advisor": "Ranks what the engine can do"}[page]
    got, text = wire(url, "", page, tokens["alice"])
    assert title not in text and runs["bob"].id not in text
    got, text = wire(url, "", page, tokens["admin"])
    assert not got.exceptions(), got.exceptions()
    assert title in text


def test_over_the_wire_a_live_panel_stops_when_the_run_is_unshared(exposed):
    """The live panel's refreshes (fragments the browser reruns on a timer) check the viewer again: once bob
    unshares his run, carol's next refresh draws nothing more of it."""
    from bench.wsclient import Session, sign_in
    url, runs, tokens, _ = exposed
    bob = runs["bob"]
    index = open_lab(exposed_root(exposed), room=True).index

    def share(flag):  # as ui.share does it: the status, and the index row the pages' lists read
        bob.note(shared=flag)
        index.update(bob)
    share(True)
    carol = Session(url, cookie=sign_in(url, tokens["carol"]).header)
    try:
        page = carol.run(f"run={bob.id}", page="live_run")
        frags = page.fragment_ids()
        assert frags and bob.id in page.text, page.kinds()
        again = carol.run(f"run={bob.id}", page="live_run", fragment=frags[0])
        assert "step 0/" in again.text  # the panel's refresh, while the run is shared
        share(False)
        after = carol.run(f"run={bob.id}", page="live_run", fragment=frags[0])
        assert "step 0/" not in after.text and "shared with the class" not in after.text
        leaked = [m.WhichOneof("type") for m in after.messages if bob.id in str(m)]
        assert not leaked, [str(m)[:300] for m in after.messages if bob.id in str(m)]
    finally:
        carol.close()
        share(False)


def test_every_fragment_of_the_pages_asks_who_is_looking():
    """A fragment's refresh skips the gate in streamlit_app.py: every page's fragment goes through
    access.fragment, which asks again (the test below shows what a signed-out refresh gets)."""
    from test_app import ROOT
    bare = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "commlab" / "app").rglob("*.py")) if p.name != "access.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if "st.fragment" in line]
    assert bare == []
    assert sum("@access.fragment(" in p.read_text() for p in (ROOT / "commlab" / "app").rglob("*.py")) >= 4


def test_over_the_wire_a_refresh_after_sign_out_gets_the_sign_in_page(exposed):
    """A live panel's refresh (a fragment rerun on the open websocket, which the gatekeeper checked once, when
    it opened) after the session ended: the whole page again, whose gate shows the sign-in prompt; none of the
    run, and no error box."""
    from bench.wsclient import Session, sign_in
    url, runs, tokens, log_path = exposed
    jar = sign_in(url, tokens["alice"])
    alice = Session(url, cookie=jar.header)
    try:
        page = alice.run(f"run={runs['alice'].id}", page="live_run")
        frags = page.fragment_ids()
        assert frags and runs["alice"].id in page.text, page.kinds()
        accounts.close_session(log_path.parent, jar.cookies["commlab_session"])
        after = alice.run(f"run={runs['alice'].id}", page="live_run", fragment=frags[0])
        assert "Your session has ended" in after.text, after.kinds()
        assert runs["alice"].id not in after.text and not after.exceptions()
    finally:
        alice.close()


@pytest.mark.parametrize("trick", TRICKS[:6])
def test_over_the_wire_path_tricks_show_nothing(exposed, trick):
    from urllib.parse import quote
    url, runs, tokens, _ = exposed
    for param, page in (("run", "live_run"), ("group", "results"), ("sweep", "results")):
        got, text = wire(url, f"{param}={quote(trick)}", page, tokens["alice"])
        assert not got.exceptions(), got.exceptions()
        assert runs["bob"].id not in text and tokens["admin"] not in text and "root:x:" not in text


@pytest.mark.parametrize("path", ["/media/../access.json", "/media/%2e%2e/access.json", "/media/..%2faccess.json",
                                  "/app/static/access.json", "/app/static/../../access.json",
                                  "/_stcore/upload_file/x/y", "/access.json", "/index.sqlite",
                                  "/component/..%2f..%2faccess.json"])
def test_over_the_wire_no_file_of_the_runs_directory_is_served(exposed, path):
    import urllib.error
    import urllib.request
    url, runs, tokens, _ = exposed
    try:
        with urllib.request.urlopen(url + path, timeout=10) as r:
            body = r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
    for t in tokens.values():
        assert t not in body
    assert runs["alice"].id not in body and "SQLite format" not in body


def test_wsclient_waits_for_the_run_a_rerun_promises():
    """A script run that ends FINISHED_EARLY_FOR_RERUN (st.rerun, st.switch_page) is followed by another
    run of the same request, however late the server starts it: the page is not finished until that one
    ends. (Counting the early end as the last could return a page before the run that follows.)"""
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
    from bench.wsclient import RunTracker

    def msg(kind, status=None):
        f = ForwardMsg()
        if kind == "new_session":
            f.new_session.name = "x"
        elif kind == "script_finished":
            f.script_finished = status
        else:
            f.delta.new_element.markdown.body = "x"
        return f

    t = RunTracker()
    for f in (msg("new_session"), msg("delta"), msg("script_finished", ForwardMsg.FINISHED_EARLY_FOR_RERUN)):
        t.feed(f)
    assert not t.finished  # the rerun's new_session has not come yet
    t.feed(msg("new_session"))
    t.feed(msg("delta"))
    assert not t.finished
    t.feed(msg("script_finished", ForwardMsg.FINISHED_SUCCESSFULLY))
    assert t.finished
    # a late run of an earlier request, interrupted by this one: its early end, then this request's run
    t = RunTracker()
    t.feed(msg("script_finished", ForwardMsg.FINISHED_EARLY_FOR_RERUN))
    assert not t.finished
    t.feed(msg("new_session"))
    t.feed(msg("script_finished", ForwardMsg.FINISHED_SUCCESSFULLY))
    assert t.finished


def fetch(url, cookie=None):
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {}),
                                    timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_over_the_wire_a_download_is_its_sessions_and_serves_once(exposed):
    """As an attacker would: another student's session, or one without a token, asking for alice's trace
    download by its id, under their own session id or under alice's; replaying the URL alice fetched."""
    import time
    from bench.wsclient import Session, sign_in
    url, runs, tokens, _ = exposed
    alice_jar = sign_in(url, tokens["alice"])
    alice = Session(url, cookie=alice_jar.header)
    bob = Session(url, cookie=sign_in(url, tokens["bob"]).header)
    nobody = None
    try:
        page = alice.run(f"run={runs['alice'].id}", page="live_run")
        fid = page.deferred_file_id("live.trace")
        assert fid, page.kinds()
        bob.run("")
        with pytest.raises(Exception, match="403"):  # no session: not even a websocket to ask with
            nobody = Session(url, timeout_s=10)
        for s in (bob,):
            for sid in (None, alice.session_id):  # its own session id; alice's (the server checks the socket's)
                got, err = s.deferred_file(fid, sid)
                assert not got and err, (got, err)
        got, err = alice.deferred_file(fid)
        assert got and not err, err
        assert got.startswith("/media/") and len(got.split("/")[-1].split(".")[0]) == 64  # random, not a hash
        assert fetch(url + got)[0] == 403  # without a session, not even a fresh URL serves
        status, body = fetch(url + got, alice_jar.header)
        assert status == 200 and runs["alice"].id.encode() in body and b"traceEvents" in body
        assert fetch(url + got, alice_jar.header)[0] == 200  # a browser's second fetch of a download, just after
        time.sleep(access.REFETCH_S + 0.5)
        assert fetch(url + got, alice_jar.header)[0] == 404  # then spent: a leaked URL serves nothing
        got2, _ = alice.deferred_file(fid)  # a second click builds a fresh one
        assert got2 and got2 != got and fetch(url + got2, alice_jar.header)[0] == 200
    finally:
        for s in (alice, bob, nobody):
            if s is not None:
                s.close()


@pytest.fixture
def downloads(tmp_path, monkeypatch):
    """download_data as on an exposed lab, for one session whose user the test sets: ``downloads(name)`` returns
    ``{"user": User(name)}``, which the test may change; nothing kept from before."""
    monkeypatch.setenv("COMMLAB_RUNS", str(tmp_path))
    monkeypatch.setattr(access, "mode", lambda: "room")
    monkeypatch.setattr(access, "session_id", lambda: "sid")
    monkeypatch.setattr(access, "_kept", Kept(access.KEPT_FILES))
    monkeypatch.setattr(access, "_held", {})

    def as_user(name: str) -> dict:
        who = {"user": owners.User(name)}
        monkeypatch.setattr(access.accounts, "session_user", lambda root, sid: who["user"])
        return who
    return as_user


def test_a_students_report_shows_a_runs_error_without_the_machines_folders(tmp_path, monkeypatch):
    """The Live page shows a student a run's error without the server's folders; the report they download (built
    later, in a thread serving no one) shows it the same way; the teacher's shows it whole."""
    from commlab.app import widgets
    monkeypatch.setattr(access, "mode", lambda: "off")  # the builder itself: what it writes for whom
    run = open_lab(tmp_path, room=True).create(commlab.spec(SMALL), owner="alice")
    run.mark_failed("rank 0: OSError: cannot read /srv/lab/secret/models.py")
    built = {}
    monkeypatch.setattr(widgets.st, "download_button", lambda *a, data, key, **k: built.__setitem__(key, data))
    for user in (owners.User("alice"), owners.User(owners.TEACHER, admin=True)):
        ui.set_viewer(lambda: user)
        try:
            widgets.report_button([run], "r.html", user.name)
        finally:
            ui.set_viewer(None)
    ui.set_viewer(lambda: None)  # the builder runs where nobody is signed in
    try:
        alices, teachers = built["alice"](), built[owners.TEACHER]()
    finally:
        ui.set_viewer(None)
    assert "cannot read .../models.py" in alices and "/srv/lab" not in alices
    assert "cannot read /srv/lab/secret/models.py" in teachers


def test_a_download_is_built_once_per_content_and_one_at_a_time_per_person(tmp_path, downloads):
    """A click on a download builds it in the server (a report of big runs: seconds of CPU, megabytes): the
    same file of the same runs, unchanged, is built once per viewer and kept; while a person's download is
    being built, their next click builds nothing (refused in one line), so repeated clicks queue no work."""
    import threading
    who = downloads("alice")
    run = open_lab(tmp_path, room=True).create(commlab.spec(SMALL), owner="alice")
    built = []
    trace = access.download_data(lambda: built.append("trace") or b"trace", [run.id], "trace")
    assert trace() == trace() == b"trace" and built == ["trace"]  # kept
    (run.path / "timeline-rank0.jsonl").write_text('{"ph": "X", "name": "step 0", "pid": 0, "tid": 0}\n')
    assert trace() == b"trace" and built == ["trace"] * 2  # the run's files changed: built again
    run.mark_cancelled("by its owner")
    assert trace() == b"trace" and built == ["trace"] * 3  # its status changed (a report shows it): again
    who["user"] = owners.User(owners.TEACHER, admin=True)
    assert trace() == b"trace" and built == ["trace"] * 4  # another viewer: their own (what a file shows may differ)
    who["user"] = owners.User("alice")
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(30)
        return b"report"
    report = access.download_data(slow, [run.id])  # no kind: built on every click
    t = threading.Thread(target=report)
    t.start()
    assert started.wait(30)
    with pytest.raises(PermissionError, match="^download refused: alice has one being built; try again when it is "
                                              "done$"):
        access.download_data(lambda: built.append("csv") or b"csv", [run.id])()
    release.set()
    t.join(30)
    assert built == ["trace"] * 4 and access.download_data(lambda: b"csv", [run.id])() == b"csv"


def test_a_download_asked_for_again_and_again_holds_no_more_memory(tmp_path, monkeypatch, downloads):
    """Streamlit stores what a deferred download's builder returns as a new file on every request, also when
    the builder hands back a kept one: a client that asks again and again without fetching held a copy per
    request (300 requests for a 5 MB report held 1.5 GB). One person holds at most HELD_PER_PERSON, and
    everyone HELD_MB_TOTAL MB; a file fetched and spent frees its place; another person is not refused."""
    from streamlit.runtime.media_file_manager import MediaFileManager
    from streamlit.runtime.media_file_storage import MediaFileStorageError
    from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
    who = downloads("mallory")
    monkeypatch.setattr(access, "REFETCH_S", -1.0)  # spent at its first fetch
    run = open_lab(tmp_path, room=True).create(commlab.spec(SMALL), owner="mallory")
    run.note(shared=True)  # bob may see it too
    storage = MemoryMediaFileStorage("/media")
    access._one_shot(storage)
    mgr = MediaFileManager(storage)
    report = "x" * (1 << 20)
    fid = mgr.add_deferred(access.download_data(lambda: report, [run.id], "report"), "text/html", "c", "r.html")
    urls = [mgr.execute_deferred(fid) for _ in range(access.HELD_PER_PERSON)]
    for _ in range(5):
        with pytest.raises(MediaFileStorageError, match=f"download refused: mallory holds {access.HELD_PER_PERSON} "
                                                        "downloads not yet fetched"):
            mgr.execute_deferred(fid)
    assert len(storage._files_by_id) == access.HELD_PER_PERSON
    built = []
    csv = mgr.add_deferred(access.download_data(lambda: built.append(1) or "a,b", [run.id]), "text/csv", "c", "x.csv")
    with pytest.raises(MediaFileStorageError, match="download refused: mallory holds 3 downloads not yet fetched"):
        mgr.execute_deferred(csv)
    assert built == []  # refused before it was built
    who["user"] = owners.User("bob")
    bobs = mgr.execute_deferred(fid)  # another person is not refused for mallory's
    storage.get_file(bobs.split("/")[-1])
    who["user"] = owners.User("mallory")
    storage.get_file(urls[0].split("/")[-1])  # fetched: spent at once here, its place freed
    with pytest.raises(MediaFileStorageError):
        storage.get_file(urls[0].split("/")[-1])
    assert mgr.execute_deferred(fid)
    monkeypatch.setattr(access, "HELD_MB_TOTAL", access.HELD_PER_PERSON)  # mallory's three 1 MB files fill it
    who["user"] = owners.User(owners.TEACHER, admin=True)
    with pytest.raises(MediaFileStorageError, match="the server holds"):
        mgr.execute_deferred(fid)


def test_over_the_wire_a_revoked_student_gets_no_download(exposed):
    from bench.wsclient import Session, sign_in
    url, runs, tokens, _ = exposed
    carol = Session(url, cookie=sign_in(url, tokens["carol"]).header)
    try:
        page = carol.run(f"run={runs['carol'].id}", page="live_run")
        fid = page.deferred_file_id("live.report")
        assert fid
        page = carol.run(f"run={runs['carol'].id}", page="live_run")  # the session's, again
        assert runs["carol"].id in page.text and "commlab: sign in" not in page.text
        accounts.revoke(exposed_root(exposed), "carol")
        got, err = carol.deferred_file(fid)
        assert not got and err
        page = carol.run(f"run={runs['carol'].id}", page="live_run")
        assert "commlab: sign in" in page.text and runs["carol"].id not in page.text
    finally:
        carol.close()


def exposed_root(exposed):
    return exposed[3].parent  # app.log lies in the runs directory


def test_students_signing_in_at_once_all_keep_their_tokens(tmp_path):
    """Sign-ins at the same moment (a room opening the link together) each add a token to runs/access.json;
    none may drop another's (it did, read-modify-write without a lock: that student's next request got the
    sign-in prompt, the workshop bench's session that stopped early in every run)."""
    from concurrent.futures import ThreadPoolExecutor
    klass = accounts.load_access(tmp_path)["class_token"]
    names = [f"s{k:02d}" for k in range(48)]
    with ThreadPoolExecutor(16) as pool:
        tokens = list(pool.map(lambda n: accounts.sign_in(tmp_path, klass, n), names))
    assert [accounts.check_token(tmp_path, t) for t in tokens] == [owners.User(n) for n in names]
    assert accounts.users(tmp_path) == names


def test_preset_steps_scale_the_presets_and_bad_values_are_named(tmp_path):
    assert owners.preset_steps(tmp_path) is None
    (tmp_path / "lab.json").write_text(json.dumps({"preset_steps": 10}))
    assert owners.preset_steps(tmp_path) == 10
    for p in PRESETS:
        for d in p.specs():
            scaled = owners.scale_preset(d, 10)
            assert scaled["steps"] == 10 and scaled["eval_every"] <= 10 and d["steps"] > 10
            commlab.spec(scaled)  # still a valid spec
    # a worker's death moves with the steps, to the same fraction of the run (here a third)
    plug = {"steps": 120, "fault": {"kind": "exit", "rank": 1, "step": 40},
            "fault_tolerance": {"enabled": True, "faults": [{"kind": "kill", "replica": 1, "step": 40}]}}
    scaled = owners.scale_preset(plug, 10)
    assert scaled["fault"]["step"] == 3 and scaled["fault_tolerance"]["faults"][0]["step"] == 3
    assert plug["fault"]["step"] == 40  # the preset's own spec is left as it was
    assert owners.scale_preset({"steps": 5, "eval_every": 5}, 10) == {"steps": 5, "eval_every": 5}
    for bad in (0, -3, 2.5, True, "10"):
        (tmp_path / "lab.json").write_text(json.dumps({"preset_steps": bad}))
        with pytest.raises(LabError, match=r"lab.json: preset_steps must be a positive integer, got"):
            owners.preset_steps(tmp_path)
