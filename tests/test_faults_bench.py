"""bench/faults.py without running it: its specs are the lab's (checked), its kills never hit replica 0 and each has
a restart, its verdicts follow the targets, and a bad argument is one line."""
import argparse

import pytest

import commlab
from bench import faults


def args(**kw):
    base = dict(rounds=2, steps=900, every=300, links="loopback,1", methods="none,diloco", replicas=3, model="cnn",
                runs=None, out="x")
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("method", ["none", "diloco"])
@pytest.mark.parametrize("link", ["loopback", "1"])
def test_the_three_variants_are_checked_specs_that_differ_only_in_fault_tolerance(method, link):
    a = args()
    specs = {v: faults.spec_for(a, method, link, v) for v in faults.VARIANTS}
    for v, s in specs.items():
        commlab.spec(s)  # the lab's own check: a bad field raises
    assert "fault_tolerance" not in specs["plain"]
    assert not specs["clean"]["fault_tolerance"].get("faults")
    same = lambda s: {k: x for k, x in s.items() if k not in ("name", "fault_tolerance")}  # noqa: E731
    assert same(specs["plain"]) == same(specs["clean"]) == same(specs["killed"])
    kills = specs["killed"]["fault_tolerance"]["faults"]
    assert [k["step"] for k in kills] == [300, 600] and [k["replica"] for k in kills] == [1, 2]
    assert specs["killed"]["fault_tolerance"]["restart"]["max_restarts"] == len(kills)


def test_kills_rotate_over_every_replica_but_the_first():
    kills = faults.spec_for(args(replicas=4, steps=1000, every=100), "none", "loopback", "killed")
    assert [k["replica"] for k in kills["fault_tolerance"]["faults"]] == [1, 2, 3, 1, 2, 3, 1, 2, 3]


def _m(goodput, acc, recs=(), rejoin=()):
    return {"state": "done", "goodput": goodput, "acc": acc, "kills": len(rejoin), "kill_to_rejoin_s": list(rejoin),
            "quorum_min": 2, "recoveries": [{"seconds": s, "bytes": b, "at_rate_s": r} for s, b, r in recs]}


def test_the_verdicts_follow_the_targets():
    setting = {"plain": [_m(40, 0.99)], "clean": [_m(30, 0.99), _m(30, 0.98)],
               "killed": [_m(28, 0.985, [(0.1, 1e6, 0.008)], [5.0]), _m(27.5, 0.975, [(6.0, 1e6, 0.008)], [9.0])]}
    s = faults.summarize(setting, 1.0)
    assert s["goodput_ratio"] == pytest.approx([28 / 30, 27.5 / 30])
    assert s["meets"]["goodput"] and s["meets"]["accuracy"]
    assert not s["meets"]["recovery"]  # one transfer took 6 s
    assert s["acc_delta_points"] == pytest.approx([-0.5, -0.5])
    slow = {**setting, "killed": [_m(20, 0.95, [(0.1, 1e6, 0.008)], [5.0])], "clean": [_m(30, 0.99)]}
    s = faults.summarize(slow, 1.0)
    assert not s["meets"]["goodput"] and not s["meets"]["accuracy"] and s["meets"]["recovery"]
    assert "misses" in faults.table({"settings": {"none @ 1 Gbit/s": s}})


@pytest.mark.parametrize("argv,field", [(["--links", "fast"], "--links"), (["--methods", "demo"], "--methods"),
                                        (["--replicas", "2"], "--replicas")])
def test_a_bad_argument_is_one_line(argv, field, capsys):
    assert faults.main(argv) == 2
    err = capsys.readouterr().err
    assert field in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
