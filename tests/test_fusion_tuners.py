"""MergeComp's search and LayerFusion's rule on fake timing profiles (no clocks, no processes)."""
import itertools
import random

import pytest

from commlab.engine import schedules
from commlab.engine.schedules import CallCost, ParamInfo
from commlab.engine.spec import JobSpec, SpecError
from commlab.engine.tuners.layerfusion import LayerFusionTuner, fit_cost
from commlab.engine.tuners.mergecomp import MergeCompSearch


def cuts_of(buckets):
    """The cut positions of a contiguous layout (inverse of ``from_cuts``)."""
    return [b[0] for b in buckets[1:]]


def fake_params(sizes, dtype="float32"):
    return [ParamInfo(name=f"p{i}", numel=n, element_size=4, dtype=dtype) for i, n in enumerate(sizes)]


def all_cut_sets(n):
    for k in range(n):
        yield from (list(c) for c in itertools.combinations(range(1, n), k))


# -- pure builders ------------------------------------------------------------
def test_from_cuts_and_balanced_cuts_are_contiguous_covers():
    rng = random.Random(0)
    for _ in range(50):
        params = fake_params([rng.randint(1, 5000) for _ in range(rng.randint(1, 30))])
        n = len(params)
        for k in (1, 2, 3, 7, 40):
            cuts = schedules.balanced_cuts(params, k)
            b = schedules.from_cuts(params, cuts)
            schedules.check(b, params)  # contiguous, every parameter once
            assert len(b) == min(k, n)
            assert cuts_of(b) == cuts
    with pytest.raises(ValueError, match="cuts"):
        schedules.from_cuts(fake_params([1, 2]), [2])


def test_from_cuts_never_mixes_dtypes():
    params = fake_params([10, 10]) + fake_params([10, 10], dtype="float16")
    b = schedules.from_cuts(params, [])
    assert b == [[0, 1], [2, 3]]


def test_balanced_cuts_balance_bytes():
    params = fake_params([100] * 8)
    assert schedules.balanced_cuts(params, 4) == [2, 4, 6]
    params = fake_params([400, 100, 100, 100, 100])
    assert schedules.balanced_cuts(params, 2) == [1]


# -- MergeComp's search -------------------------------------------------------
def run_search(search, cost):
    cuts = search.next_candidate()
    while cuts is not None:
        schedules.check(search.layout(cuts), search.params)  # every proposal is a valid partition
        search.report(cost(cuts))
        cuts = search.next_candidate()
    return search.best


def pipeline_cost(params, alpha, beta, gap):
    """A synthetic iteration time: groups are sent one after another as backward produces
    them (a gradient every ``gap`` s), each call costing alpha + beta * bytes."""
    ready = [gap * (i + 1) for i in range(len(params))]

    def cost(cuts):
        return schedules.simulate(params, schedules.from_cuts(params, cuts), ready, CallCost(alpha, beta))
    return cost


@pytest.mark.parametrize("seed", range(6))
def test_search_finds_known_optimum(seed):
    rng = random.Random(seed)
    params = fake_params([rng.choice([64, 512, 4096, 20000]) for _ in range(9)])
    cost = pipeline_cost(params, alpha=rng.choice([1e-4, 1e-3, 5e-3]), beta=2e-8, gap=rng.choice([2e-4, 1e-3]))
    optimum = min(cost(c) for c in all_cut_sets(len(params)))  # brute force over all 256 partitions
    search = MergeCompSearch(params, max_groups=8, max_candidates=40)
    cuts, t = run_search(search, cost)
    assert t == pytest.approx(optimum, rel=1e-9), (cuts, t, optimum)
    assert len(search.trace) <= 40
    assert len({tuple(c) for c, _ in search.trace}) == len(search.trace)  # no candidate measured twice


def test_search_close_to_optimum_on_many_profiles():
    """A local search can stop in a local optimum; over 60 random profiles it reaches the
    brute-force optimum in most and is never more than 5% off."""
    exact, worst = 0, 0.0
    for seed in range(100, 160):
        rng = random.Random(seed)
        params = fake_params([rng.choice([64, 512, 4096, 20000]) for _ in range(9)])
        cost = pipeline_cost(params, alpha=rng.choice([1e-4, 1e-3, 5e-3]), beta=2e-8, gap=rng.choice([2e-4, 1e-3]))
        optimum = min(cost(c) for c in all_cut_sets(len(params)))
        _, t = run_search(MergeCompSearch(params, max_groups=8, max_candidates=24), cost)
        exact += t <= optimum * (1 + 1e-9)
        worst = max(worst, t / optimum - 1)
    assert exact >= 50 and worst < 0.10, (exact, worst)


def test_search_beats_one_cut():
    """Where the optimum needs several groups, the search finds it; a single cut cannot."""
    params = fake_params([1000] * 12)
    cost = pipeline_cost(params, alpha=1e-4, beta=1e-7, gap=1e-3)
    one_cut = min(cost(c) for c in [[]] + [[j] for j in range(1, 12)])
    optimum = min(cost(c) for c in all_cut_sets(12))
    _, t = run_search(MergeCompSearch(params, max_groups=8), cost)
    assert t == pytest.approx(optimum) and t < one_cut


def test_search_stops_early_and_respects_budget():
    params = fake_params([1000] * 30)
    calls = []

    def cost(cuts):  # fewer groups are always better: the k sweep stops after `patience` worse
        calls.append(cuts)
        return 1.0 + len(cuts)
    cuts, t = run_search(MergeCompSearch(params, max_groups=16, max_candidates=24, patience=2), cost)
    assert cuts == [] and t == 1.0
    assert calls[:3] == [[], [15], [10, 20]] and [4] not in [len(c) for c in calls]  # k = 4 never tried
    assert len(calls) <= 24
    _, _ = run_search(MergeCompSearch(params, max_groups=30, max_candidates=5), lambda c: -len(c))
    with pytest.raises(RuntimeError):
        s = MergeCompSearch(fake_params([1]))
        run_search(s, lambda c: 1.0)
        s.report(1.0)


# -- LayerFusion --------------------------------------------------------------
def test_layerfusion_all_ready_at_once_is_one_bucket():
    params = fake_params([1000] * 10)
    b = schedules.layerfusion(params, [0.01] * 10, CallCost(1e-3, 1e-8))
    assert b == [list(range(10))]


def test_layerfusion_spread_out_is_layerwise():
    """Each gradient arrives long after the previous exchange ended: the optimum sends the last one alone."""
    params = fake_params([1000] * 6)
    ready = [0.1 * (i + 1) for i in range(6)]
    cost = CallCost(1e-3, 1e-8)
    b = schedules.layerfusion(params, ready, cost)
    # the optimum: the last gradient's exchange starts as it is ready, alone (layer-wise reaches it;
    # so does any layout whose earlier buckets end before the last gradient is ready)
    assert schedules.simulate(params, b, ready, cost) == pytest.approx(ready[-1] + cost(4000))
    assert b[-1] == [5]


def test_layerfusion_two_clusters():
    """Two bursts of gradients far apart: one bucket per burst is the optimum (unique, since
    every extra call's compressor cost delays the second burst)."""
    params = fake_params([1000] * 8)
    ready = [0.001 + 1e-5 * i for i in range(4)] + [0.05 + 1e-5 * i for i in range(4)]
    cost = CallCost(1e-3, 1e-8, 1e-4, 0.0)
    b = schedules.layerfusion(params, ready, cost)
    assert b == [[0, 1, 2, 3], [4, 5, 6, 7]]
    best = min(schedules.simulate(params, schedules.from_cuts(params, c), ready, cost) for c in all_cut_sets(8))
    assert schedules.simulate(params, b, ready, cost) == pytest.approx(best)


def test_layerfusion_near_optimum_on_random_profiles():
    """On random profiles (compressor costs on the training thread included) the rule is never
    worse than one bucket under the model, mostly optimal, and never far off. It is a walk
    with a one-cut look-ahead, not a search: over 200 such profiles it hit the brute-force
    optimum in 163, worst 1.22x."""
    exact, worst = 0, 0.0
    for seed in range(100):
        rng = random.Random(seed)
        n = 9
        params = fake_params([rng.choice([100, 1000, 10000, 50000]) for _ in range(n)])
        t, ready = 0.0, []
        for _ in range(n):
            t += rng.choice([1e-5, 1e-4, 1e-3, 5e-3])
            ready.append(t)
        cost = CallCost(rng.choice([2e-4, 1e-3, 3e-3]), rng.choice([1e-9, 1e-8, 5e-8]),
                        rng.choice([0.0, 1e-4, 1e-3]), rng.choice([0.0, 1e-9, 1e-8]))
        b = schedules.layerfusion(params, ready, cost)
        schedules.check(b, params)
        mine = schedules.simulate(params, b, ready, cost)
        best = min(schedules.simulate(params, schedules.from_cuts(params, c), ready, cost) for c in all_cut_sets(n))
        assert best <= mine <= schedules.simulate(params, schedules.allinone(params), ready, cost) + 1e-12
        exact += mine <= best * (1 + 1e-9)
        worst = max(worst, mine / best)
    assert exact >= 75 and worst < 1.25, (exact, worst)


def test_layerfusion_tuner_fits_cost_and_uses_medians():
    params = fake_params([1000] * 4)
    samples = [(b, 2e-3 + 1e-9 * b) for b in (1e3, 1e4, 1e5, 1e6)]
    c = fit_cost(samples)
    assert c.fixed == pytest.approx(2e-3) and c.per_byte == pytest.approx(1e-9)
    tuner = LayerFusionTuner(params)
    steps = [[0.0, 0.1, 0.2, 0.3], [0.0, 0.1, 0.2, 0.3], [9.0, 9.0, 9.0, 9.0]]  # one outlier step
    # (bytes, total, compressor part): the compressor costs 0.5 ms + 2e-9 s/B of the total
    triples = [(b, 2.5e-3 + 3e-9 * b, 5e-4 + 2e-9 * b) for b in (1e3, 1e4, 1e5, 1e6)]
    # gradients 100 ms apart and a 2.5 ms exchange: the channel is never busy when the next
    # gradient comes, so an extra call only adds compressor time: one bucket is best
    assert tuner.propose(steps, triples) == [[0, 1, 2, 3]]
    assert tuner.ready == [0.0, 0.1, 0.2, 0.3]
    assert tuner.cost.fixed == pytest.approx(2e-3) and tuner.cost.per_byte == pytest.approx(1e-9)
    assert tuner.cost.compute_fixed == pytest.approx(5e-4) and tuner.cost.compute_per_byte == pytest.approx(2e-9)
    with pytest.raises(ValueError):
        fit_cost([(1.0, 1.0)])
    assert schedules.layerfusion(params) == [[0, 1, 2, 3]]  # no profile yet: one bucket


# -- spec ---------------------------------------------------------------------
def test_spec_options_defaulted_and_validated():
    s = JobSpec.from_dict({"schedule": "mergecomp"}).schedule
    assert (s.warmup_steps, s.steps_per_candidate, s.max_groups, s.retune, s.profile_steps) == (2, 5, 8, False, None)
    s = JobSpec.from_dict({"schedule": {"name": "layerfusion"}})
    assert s.schedule.profile_steps == 3 and JobSpec.from_dict(s.to_dict()) == s
    for data, field, hint in (
            ({"name": "bucket", "max_groups": 4}, "schedule.max_groups", "only the mergecomp"),
            ({"name": "layerfusion", "retune": True}, "schedule.retune", "only the mergecomp"),
            ({"name": "mergecomp", "profile_steps": 2}, "schedule.profile_steps", "only the layerfusion"),
            ({"name": "mergecomp", "steps_per_candidate": 0}, "schedule.steps_per_candidate", "1..1000"),
            ({"name": "mergecomp", "retune": "yes"}, "schedule.retune", "true or false")):
        with pytest.raises(SpecError) as e:
            JobSpec.from_dict({"schedule": data})
        assert str(e.value).startswith(field) and hint in str(e.value) and "\n" not in str(e.value)


def test_the_cache_key_holds_how_far_the_search_looked():
    """A search told to try one partition (a form allows 1) must not answer, through the shared cache, for runs
    of the same model that would have tried 24: the search's settings are in the key; what it does not
    depend on (the run's name, its steps) is not."""
    import commlab
    from commlab.engine.tuners.mergecomp import cache_key
    base = {"model": "mlp", "dataset": "digits", "batch_size": 16, "world_size": 2, "schedule": "mergecomp"}
    key = cache_key(commlab.spec(base))
    assert cache_key(commlab.spec({**base, "name": "mine", "steps": 7})) == key
    for field, value in (("max_candidates", 1), ("steps_per_candidate", 1), ("warmup_steps", 0), ("max_groups", 2)):
        assert cache_key(commlab.spec({**base, "schedule": {"name": "mergecomp", field: value}})) != key, field


def test_the_cache_keeps_the_newest_entries_only(tmp_path, monkeypatch):
    """Every MergeComp run reads and rewrites the whole cache beside the runs, and a room's runs of many settings
    each add an entry (a model's parameter names in it): it keeps the CACHE_ENTRIES written last."""
    import json
    from commlab.engine import runfiles
    from commlab.engine.tuners import mergecomp
    monkeypatch.setattr(mergecomp, "CACHE_ENTRIES", 4)
    for k in range(6):
        assert mergecomp.write_cache(str(tmp_path), f"k{k}", {"order": ["a"], "cuts": [], "run": str(k)}) is None
    mergecomp.write_cache(str(tmp_path), "k3", {"order": ["a"], "cuts": [], "run": "again"})  # written again: newest
    kept = json.loads((tmp_path / runfiles.MERGECOMP_CACHE).read_text())
    assert list(kept) == ["k2", "k4", "k5", "k3"] and kept["k3"]["run"] == "again"
    assert mergecomp.read_cache(str(tmp_path), "k0") is None and mergecomp.read_cache(str(tmp_path), "k5")["run"] == "5"
