"""The predictions: each candidate's iteration time on the link the advice is for, from the performance model.

``network_for`` checks and settles that link (the spec's, or ``--link``/``--gbps``, or a cluster of unequal workers:
``--cluster`` or the spec's ``network.cluster``); ``link_of`` says which alpha-beta the model uses for it (a modeled
link's exactly, a shaped one's calibrated or nominal, a cluster's ring from commlab.lab.strategy.perfmodel.uneven),
and ``compute_of`` whose compute (a cluster's slowest worker's);
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
from commlab.lab.strategy.perfmodel.uneven import ClusterRing, at_speed
from commlab.lab.strategy.space import Candidate, add_note, start_iter

LINKS = ("modeled", "shaped")


def network_for(spec: dict, gbps: Optional[float] = None, link: Optional[str] = None,
                cluster: Optional[str] = None, world: Optional[int] = None) -> dict:
    """The network section the advice is for: the spec's shaped or modeled link, ``link`` at ``gbps``, or a
    cluster of unequal workers on its modeled link (``cluster``, a preset's name: ``--cluster``; else the
    spec's own ``network.cluster``), resolved for ``world`` ranks (default: the spec's world size) as
    spec.json holds one: ``{link: modeled, gbps, latency_us: None, cluster: {preset, workers}}``.
    ``gbps`` plans for one rate shared by every rank, the spec's cluster set aside."""
    net = dict(spec["network"])
    world = world or spec["world_size"]
    if link is not None and link not in LINKS:
        raise SpecError("--link", f"must be one of {', '.join(LINKS)}, got {link!r}")
    if cluster is not None:
        if gbps is not None:
            raise SpecError("--cluster", "a cluster gives each worker's rate; give --cluster or --gbps, not both")
        if link == "shaped":
            raise SpecError("--cluster", "a cluster is planned on its modeled link (each worker's delay and "
                                         "jitter, which a shaped link cannot give); leave --link out")
        return cluster_network(cluster, world, "--cluster")
    if gbps is not None and not 0.001 <= gbps <= MAX_GBPS:
        raise SpecError("--gbps", f"must be in [0.001, {MAX_GBPS:g}], got {gbps:g}")
    if gbps is None and link in (None, "modeled") and net.get("cluster") and net["link"] != "loopback":
        if net["link"] == "shaped" and link is None:
            raise SpecError("network.cluster", "the advice plans a cluster on its modeled link (each worker's delay "
                                               "and jitter); give --link modeled for these workers modeled, or "
                                               "--gbps X for one rate")
        return spec_cluster_network(net, world)
    if gbps is None and link is None:
        if net["link"] == "loopback":
            raise SpecError("network.link", "the spec's link is loopback, which has no rate to plan for; give "
                                            "--gbps X (a modeled link), --cluster PRESET, or a spec with a "
                                            "modeled or shaped link")
        return net
    kind = link or (net["link"] if net["link"] != "loopback" else "modeled")
    rate = gbps if gbps is not None else net.get("gbps")
    if rate is None:
        raise SpecError("--gbps", f"a {kind} link needs a rate; give --gbps X")
    out = {"link": kind, "gbps": float(rate), "latency_us": None}
    if kind == "modeled":
        out["latency_us"] = net.get("latency_us") if net["link"] == "modeled" else None
    return out


def cluster_network(preset: str, world: int, field: str = "--cluster") -> dict:
    """A modeled network section of the cluster preset ``preset`` for ``world`` ranks; a one-line SpecError
    naming ``field`` otherwise."""
    return {"link": "modeled", "gbps": None, "latency_us": None,
            "cluster": whatif.resolve_cluster({"preset": preset}, world, field)}


def spec_cluster_network(net: dict, world: int) -> dict:
    """The spec's own cluster (``net``: its network section, the cluster resolved for its world size) on a
    modeled link for ``world`` ranks: a preset resolved again for them, a list of workers only for as many."""
    return {"link": "modeled", "gbps": net.get("gbps"), "latency_us": None,
            "cluster": whatif.resolve_cluster(net["cluster"], world, "--workers")}


def cluster_of(net: dict) -> Optional[ClusterRing]:
    """The cluster's ring of a network section that has one (``network_for``); None for one rate."""
    cl = net.get("cluster")
    return ClusterRing(cl["workers"], cl.get("preset")) if cl and net["link"] == "modeled" else None


def network_words(net: dict) -> str:
    """A network section in a few words: ``modeled 1 Gbit/s``, or the cluster's preset, slowest link, largest
    delay and slowest worker."""
    ring = cluster_of(net)
    if ring is None:
        return f"{net['link']} {net['gbps']:g} Gbit/s"
    s = ring.summary()
    name = s["preset"] or "of the spec's workers"
    return (f"modeled cluster {name} (slowest link {s['slowest_link_gbps']:g} Gbit/s, largest delay "
            f"{s['largest_delay_ms']:g} ms, slowest worker speed {s['slowest_speed']:g})")


def compute_of(profile, net: dict):
    """The profile the predictions use on ``net``: the slowest worker's on a cluster (perfmodel.uneven's
    ``at_speed``), the profile itself on one rate."""
    ring = cluster_of(net)
    return profile if ring is None else at_speed(profile, ring.slowest_speed)


def link_of(profile, net: dict, runs=None):
    """The link the predictions use, and what it is: a modeled link is the engine's alpha-beta exactly; a
    shaped one is the profile's calibrated link, else the lab's (``commlab net check --save``), scaled to
    the rate; nominal when neither is calibrated."""
    ring = cluster_of(net)
    if ring is not None:
        return ring, (f"modeled {ring.describe()}: each ring step as slow as its slowest hop (the engine's "
                      f"modeled cluster link), compute the slowest worker's")
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
