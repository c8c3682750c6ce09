"""The workshop is a layer around the lab (commlab/room/): a runs directory nobody shares gets the single-user
lab's admission rule (commlab/lab/service/admission.py) and its run path calls nothing of the room; a room's
directory gets the room's rule (owners, memory limits, fair order, its own supervisor); the sandbox's places
are first come, first served until a room installs its gate. No ranks start here: admission and the queue's
order only."""
import json
import sys
from contextlib import contextmanager

import pytest

import commlab
from commlab.engine.spec import JobSpec
from commlab.lab.base import sandbox
from commlab.lab.base.errors import LabError
from commlab.lab.service.admission import Admission, local_name
from commlab.room import is_room, open_lab, places
from commlab.room.policy import Room

SMALL = {"model": "mlp", "dataset": "digits", "steps": 3, "batch_size": 16, "eval_every": 0, "threads": 1,
         "world_size": 2}
ROOM_MODULES = ("commlab.room.owners", "commlab.room.accounts", "commlab.room.places", "commlab.room.previews",
                "commlab.room.policy")


@contextmanager
def modules_called(into: set):
    """Every module of commlab's whose function is called meanwhile (this thread), into ``into``."""
    def seen(frame, event, arg):
        if event == "call":
            into.add(frame.f_globals.get("__name__", ""))
    sys.setprofile(seen)
    try:
        yield into
    finally:
        sys.setprofile(None)


def test_a_runs_directory_nobody_shares_is_admitted_without_the_room(tmp_path):
    lab = open_lab(tmp_path)
    assert type(lab.admission) is Admission and not is_room(tmp_path)
    assert lab.admission.supervisor == "commlab.lab.service.supervise"
    spec = commlab.spec(SMALL)
    called = set()
    with modules_called(called):
        runs = [lab.create(spec), lab.create(spec)]
        places_in_line = [lab.queue_position(r, upto=5) for r in runs]
    assert not called & set(ROOM_MODULES), sorted(called & set(ROOM_MODULES))
    assert "commlab.lab.service.admission" in called  # the path went through the rule it names
    st = runs[0].status()
    assert st["owner"] == local_name() and "rank_limit_mb" not in st
    assert places_in_line == [0, 0]  # no live supervisor ahead of either: nobody counts


def test_a_lab_without_a_room_has_one_user(tmp_path):
    with pytest.raises(LabError) as e:
        open_lab(tmp_path).create(commlab.spec(SMALL), owner="alice")
    assert str(e.value).startswith("owner: this lab has one user") and "\n" not in str(e.value)
    assert open_lab(tmp_path).create(commlab.spec(SMALL), owner=local_name()).status()["owner"] == local_name()


@pytest.mark.parametrize("cfg", [{"quotas": {"steps": 100}}, {"rank_mb": 1024}, {"access": {}}, {"preset_steps": 40}])
def test_a_room_is_what_its_runs_directory_says(tmp_path, cfg):
    (tmp_path / "lab.json").write_text(json.dumps(cfg))
    lab = open_lab(tmp_path)
    assert is_room(tmp_path) and type(lab.admission) is Room
    assert lab.admission.supervisor == "commlab.room.supervise"
    assert type(open_lab(tmp_path, room=False).admission) is Admission  # a front end may say otherwise


def test_a_room_admits_by_owner_and_orders_fairly(tmp_path):
    (tmp_path / "lab.json").write_text(json.dumps({"quotas": {"rank_mb": 700}}))
    lab = open_lab(tmp_path)
    spec = commlab.spec(SMALL)
    called = set()
    with modules_called(called):
        a1, a2 = lab.create(spec, owner="alice"), lab.create(spec, owner="alice")
        b1 = lab.create(spec, owner="bob")
    assert {"commlab.room.policy", "commlab.room.owners"} <= called
    assert (a1.status()["owner"], a1.status()["rank_limit_mb"]) == ("alice", 700)
    assert "rank_limit_mb" not in lab.create(spec).status()  # the local user: no quota (no rank_mb for everyone)
    rows = [{"id": r.id, "created": r.status()["created"], "owner": r.status()["owner"], "state": "queued"}
            for r in (a1, a2, b1)]
    assert lab.admission.order(rows, rows) == [a1.id, b1.id, a2.id]  # bob's one run before alice's second
    assert Admission(tmp_path).order(rows, rows) == [a1.id, a2.id, b1.id]  # without the room: first come
    named = spec.to_dict()
    named["model"]["name"] = "commlab_room_layer_nosuch:build"
    with pytest.raises(ValueError, match="names code"):  # a student's spec that names code: refused, not imported
        lab.create(JobSpec.from_checked(named), owner="alice")
    assert "commlab_room_layer_nosuch" not in sys.modules


def test_the_sandbox_is_first_come_until_a_room_installs_its_gate(monkeypatch):
    spawned = []
    monkeypatch.setattr(sandbox, "_spawn", lambda task, spec, limits: spawned.append(task) or {"params": 1})
    monkeypatch.setattr(sandbox, "_gate", sandbox._first_free)
    monkeypatch.setattr(places, "_asker", lambda: None)  # a room's viewer: nobody signed in
    assert sandbox.run("describe", {}) == {"params": 1}  # no room: nobody needs to be signed in
    places.install()
    with pytest.raises(sandbox.SandboxError, match="nobody is signed in"):
        sandbox.run("describe", {})
    assert spawned == ["describe"]
