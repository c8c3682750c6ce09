"""The predictions: each candidate's iteration time on the link the advice is for, from the performance model.

``network_for`` checks and settles that link (the spec's, or ``--link``/``--gbps``); ``link_of`` says which
alpha-beta the model uses for it (a modeled link's exactly, a shaped one's calibrated or nominal);
``predict_candidate`` drives commlab.lab.strategy.perfmodel.predict for one candidate, and for MergeComp
``search_mergecomp`` runs MergeComp's own search fed with predicted step times.

Apart from the trials (commlab.lab.strategy.trials), which measure what these only predict, and from the advice
(commlab.lab.strategy.advisor), which decides which candidates are worth predicting (MERGECOMP_MARGIN) and ranks them.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from commlab.engine.schedules import ParamInfo
from commlab.engine.spec import MAX_GBPS, SpecError
from commlab.lab.strategy.perfmodel import calibrate as cal
from commlab.lab.strategy.perfmodel import predict as pr
from commlab.lab.strategy.perfmodel import whatif
from commlab.lab.strategy.perfmodel.costs import Link
from commlab.lab.strategy.space import Candidate, add_note, start_iter

LINKS = ("modeled", "shaped")


def network_for(spec: dict, gbps: Optional[float] = None, link: Optional[str] = None) -> dict:
    """The network section the advice is for: the spec's shaped or modeled link, or ``link`` at ``gbps``."""
    net = dict(spec["network"])
    if link is not None and link not in LINKS:
        raise SpecError("--link", f"must be one of {', '.join(LINKS)}, got {link!r}")
    if gbps is not None and not 0.001 <= gbps <= MAX_GBPS:
        raise SpecError("--gbps", f"must be in [0.001, {MAX_GBPS:g}], got {gbps:g}")
    if gbps is None and link is None:
        if net.get("cluster"):
            raise SpecError("network.cluster", "the advice plans for one rate shared by every rank, not for a "
                                               "cluster of unequal workers yet; give --gbps X")
        if net["link"] == "loopback":
            raise SpecError("network.link", "the spec's link is loopback, which has no rate to plan for; give "
                                            "--gbps X (a modeled link) or a spec with a modeled or shaped link")
        return net
    kind = link or (net["link"] if net["link"] != "loopback" else "modeled")
    rate = gbps if gbps is not None else net.get("gbps")
    if rate is None:
        raise SpecError("--gbps", f"a {kind} link needs a rate; give --gbps X")
    out = {"link": kind, "gbps": float(rate), "latency_us": None}
    if kind == "modeled":
        out["latency_us"] = net.get("latency_us") if net["link"] == "modeled" else None
    return out


def link_of(profile, net: dict, runs=None):
    """The link the predictions use, and what it is: a modeled link is the engine's alpha-beta exactly; a
    shaped one is the profile's calibrated link, else the lab's (``commlab net check --save``), scaled to
    the rate; nominal when neither is calibrated."""
    if net["link"] == "modeled":
        return Link.from_gbps(net["gbps"], net.get("latency_us") or 0.0), "modeled: the engine's alpha-beta delays"
    if profile.link:
        return profile.link_at(net["gbps"]), f"shaped: calibrated at {profile.link['nominal_gbps']:g} Gbit/s, scaled"
    lab_link = whatif.saved_shaped_link(runs)
    if lab_link:
        return cal.link_scaled(lab_link, net["gbps"]), (f"shaped: the lab's calibration ({lab_link['source']}; {lab_link['alpha'] * 1e6:.0f} us "
                        "per ring step), scaled")
    return Link.from_gbps(net["gbps"]), ("shaped: nominal alpha-beta (no link calibrated; `commlab net check "
                                         "--gbps 1 --save` measures one)")


def predict_candidate(profile, spec: dict, cand: Candidate, link, world: int) -> None:
    s = {**spec, **cand.strategy()}
    if cand.local:
        try:
            cand.predicted_ms = pr.predict(profile, s, link.gbps, world, link=link).total * 1e3
        except SpecError as e:  # the model does not fit the method's parameters (more fragments than tensors)
            add_note(cand, f"not predicted: {e}")
        return
    if cand.schedule["name"] == "mergecomp":
        cuts_ms, groups, cuts, steady = search_mergecomp(profile, s, link, world)
        cand.predicted_ms, cand.layout_groups, cand.layout_cuts, cand.steady_ms = cuts_ms, groups, cuts, steady
        cand.note = (f"predicted over {spec['steps']} steps: its search (fed the model's times) settles on "
                     f"{groups} groups; the run searches by measurement")
        return
    cand.predicted_ms = pr.predict(profile, s, link.gbps, world, link=link).total * 1e3


def search_mergecomp(profile, spec: dict, link, world: int) -> Tuple[float, int, List[int], float]:
    """Drive MergeComp's own search (a pure object) with predicted instead of measured step times.
    Returns the mean predicted step time over the spec's steps after the compressor's plain start (which
    the engine's tuner does not time, and which no other prediction counts either), the search included
    (its warm-up and every candidate's 1 + steps_per_candidate steps, as commlab.engine.tuners runs them), the
    groups and cuts of the partition it settles on, and its predicted step time."""
    from commlab.engine.tuners.mergecomp import MergeCompSearch
    infos = [ParamInfo(name=n, numel=b // 4, element_size=4, dtype="float32", device="cpu")
             for n, b in profile.params]
    sched = spec["schedule"]
    search = MergeCompSearch(infos, max_groups=sched.get("max_groups") or 8,
                             max_candidates=sched.get("max_candidates") or 24)
    cuts = search.next_candidate()
    while cuts is not None:
        layout = [[profile.params[i][0] for i in g] for g in search.layout(cuts)]
        search.report(pr.predict(profile, spec, link.gbps, world, link=link, layout=layout).total)
        cuts = search.next_candidate()
    best_cuts, best = search.best
    per = 1 + (sched.get("steps_per_candidate") or 5)
    steps = [search.trace[0][1]] * (sched.get("warmup_steps") or 2)
    for _, t in search.trace:
        steps += [t] * per
    total = max(spec["steps"] - (start_iter(spec["compressor"]) or 0), 1)
    steps = steps[:total]
    steps += [best] * (total - len(steps))
    return 1e3 * sum(steps) / len(steps), len(best_cuts) + 1, list(best_cuts), 1e3 * best
