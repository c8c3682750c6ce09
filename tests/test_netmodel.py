"""The alpha-beta model of ring collectives and the modeled link."""
import pytest

from commlab.engine.netmodel import (ModeledLink, allgather_s, busbw_factor, from_spec, reduce_scatter_s,
                             ring_allreduce_s, seconds_per_byte)

GB = 125_000_000  # bytes that take exactly 1 s at 1 Gbit/s


def test_known_numbers():
    assert seconds_per_byte(1.0) == pytest.approx(8e-9)
    # p = 2: each rank sends n bytes in all; 1 Gbit/s moves 125 MB in 1 s
    assert ring_allreduce_s(GB, 2, 1.0) == pytest.approx(1.0)
    # p = 4: 2(p-1)/p = 1.5 of the bytes, 2(p-1) = 6 steps of 100 us
    assert ring_allreduce_s(GB, 4, 1.0, 100) == pytest.approx(1.5 + 6e-4)
    # all-gather: every rank contributes 125 MB, p = 4: (p-1) * m = 3 x 125 MB, 3 steps
    assert allgather_s(GB, 4, 1.0, 100) == pytest.approx(3.0 + 3e-4)
    # reduce-scatter of 125 MB, p = 4: (p-1)/p of it, 3 steps
    assert reduce_scatter_s(GB, 4, 1.0, 100) == pytest.approx(0.75 + 3e-4)
    # 0.1 Gbit/s is ten times slower
    assert ring_allreduce_s(GB, 2, 0.1) == pytest.approx(10.0)
    # latency only
    assert ring_allreduce_s(0, 8, 10.0, 50) == pytest.approx(14 * 50e-6)


def test_ring_identity_allreduce_is_reduce_scatter_plus_allgather():
    for p in (2, 3, 4, 8, 16):
        n = 12_345_678
        ar = ring_allreduce_s(n, p, 2.5, 30)
        assert ar == pytest.approx(reduce_scatter_s(n, p, 2.5, 30) + allgather_s(n / p, p, 2.5, 30))


def test_world_one_costs_nothing():
    for f in (ring_allreduce_s, allgather_s, reduce_scatter_s):
        assert f(10 ** 9, 1, 0.1, 1000) == 0.0
    link = ModeledLink(0.1, 1000)
    for op in ("allreduce", "allgather", "reduce_scatter"):
        assert link.duration(op, 10 ** 9, 1) == 0.0


@pytest.mark.parametrize("f", [ring_allreduce_s, allgather_s, reduce_scatter_s])
def test_monotone(f):
    sizes = [0, 1, 1000, 10 ** 6, 10 ** 9]
    t = [f(n, 4, 1.0, 10) for n in sizes]
    assert all(a < b for a, b in zip(t, t[1:])), "more bytes must cost more"
    t = [f(10 ** 6, 4, g, 10) for g in (0.01, 0.1, 1, 10, 100)]
    assert all(a > b for a, b in zip(t, t[1:])), "more bandwidth must cost less"
    t = [f(10 ** 6, 4, 1.0, lat) for lat in (0, 1, 10, 1000)]
    assert all(a < b for a, b in zip(t, t[1:])), "more latency must cost more"
    t = [f(10 ** 6, p, 1.0, 10) for p in (1, 2, 3, 4, 8, 64)]
    assert all(a < b for a, b in zip(t, t[1:])), "more ranks must cost more (same bytes per rank)"


def test_allreduce_bandwidth_term_bounded_by_twice_the_bytes():
    # 2(p-1)/p < 2: however many ranks, a rank never sends more than twice its buffer
    for p in (2, 16, 1024):
        assert ring_allreduce_s(GB, p, 1.0) < 2.0
    assert busbw_factor("allreduce", 2) == 1.0
    assert busbw_factor("reduce_scatter", 4) == 0.75
    assert busbw_factor("allgather", 4) == 3.0
    assert busbw_factor("all_to_all", 4) == 0.75


def test_an_all_to_all_costs_what_the_reduce_scatter_it_stands_for_does():
    """dear's shard codecs reduce-scatter by an all-to-all: each rank sends (p-1)/p of its bytes."""
    link = ModeledLink(1.0, 10.0)
    for p in (1, 2, 8):
        assert link.duration("all_to_all", 10 ** 6, p) == link.duration("reduce_scatter", 10 ** 6, p)
    assert link.duration("all_to_all", 10 ** 6, 4) == reduce_scatter_s(10 ** 6, 4, 1.0, 10.0) > 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        ring_allreduce_s(-1, 2, 1.0)
    with pytest.raises(ValueError):
        allgather_s(10, 0, 1.0)
    with pytest.raises(ValueError):
        reduce_scatter_s(10, 2, 0.0)
    with pytest.raises(ValueError):
        ModeledLink(-1.0)
    with pytest.raises(ValueError, match="allowed"):
        ModeledLink(1.0).duration("broadcast", 10, 2)


def test_modeled_link_dispatch_and_fifo_with_a_fake_clock():
    now = [100.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s
    link = ModeledLink(1.0, 10, clock=lambda: now[0], sleep=sleep)
    assert link.duration("allreduce", GB, 2) == pytest.approx(ring_allreduce_s(GB, 2, 1.0, 10))
    assert link.duration("allgather", GB, 3) == pytest.approx(allgather_s(GB, 3, 1.0, 10))
    assert link.duration("reduce_scatter", GB, 3) == pytest.approx(reduce_scatter_s(GB, 3, 1.0, 10))
    # two collectives issued at once share the link: the second ends after both
    d1 = link.issue("allreduce", GB, 2)
    d2 = link.issue("allreduce", GB // 2, 2)
    assert d1 == pytest.approx(100.0 + 1.0 + 20e-6)
    assert d2 == pytest.approx(d1 + 0.5 + 20e-6)
    assert link.hold_until(d1) == pytest.approx(d1 - 100.0)
    assert link.hold_until(d1) == 0.0  # already past
    assert link.hold_until(d2) == pytest.approx(d2 - d1)
    # a collective issued after the link went idle starts at its issue time
    now[0] += 5
    d3 = link.issue("allgather", 0, 2)
    assert d3 == pytest.approx(now[0] + 10e-6)


def test_hold_never_returns_early_when_sleep_wakes_early():
    """time.sleep may return a little early: hold_until sleeps again until the clock reads the deadline."""
    now = [10.0]
    asked = []

    def early_sleep(s):  # wakes after 60% of what was asked, and at least a microsecond
        asked.append(s)
        now[0] += max(0.6 * s, 1e-6)
    link = ModeledLink(0.1, clock=lambda: now[0], sleep=early_sleep)
    for want in (0.0, 0.01, 0.05):
        start = now[0]
        slept = link.hold_until(start + want)
        assert now[0] >= start + want and slept == pytest.approx(now[0] - start)
    assert len(asked) > 2  # it did have to sleep again


def test_from_spec():
    assert from_spec({"link": "loopback"}) is None
    link = from_spec({"link": "modeled", "gbps": 0.5, "latency_us": 20})
    assert (link.gbps, link.latency_us) == (0.5, 20)
    assert from_spec({"link": "modeled", "gbps": 2, "latency_us": None}).latency_us == 0.0
    with pytest.raises(ValueError, match="gbps"):
        from_spec({"link": "modeled"})


# -- real collectives, held by the modeled link (its clock is fake, so nothing here is timed; ----
# -- bench/modeled_link.py measures the same on the real clock) -------------------------------

class FakeClock:
    """A clock that moves only when the link sleeps: what it reads after a wait is the model's time."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def _held_allreduces(rank, world, nbytes, gbps, latency_us, reps):
    import torch
    from commlab.engine.comm.collectives import issue_allreduce
    clock = FakeClock()
    link = ModeledLink(gbps, latency_us, clock=clock, sleep=clock.sleep)
    out = []
    for i in range(reps):
        t = torch.full((nbytes // 4,), float(rank + i))
        t0 = clock()
        (summed,) = issue_allreduce([t], link=link).wait()
        out.append((clock() - t0, summed[0].item()))
    return out


def test_a_real_allreduce_is_held_to_the_models_time():
    from distutil import run_world
    nbytes, gbps, lat = 1 << 20, 0.05, 100.0
    pred = ring_allreduce_s(nbytes, 2, gbps, lat)
    for held in run_world(_held_allreduces, nbytes, gbps, lat, 3):
        for i, (seconds, value) in enumerate(held):
            assert seconds == pytest.approx(pred, rel=1e-9)
            assert value == 0 + i + 1 + i  # the collective itself still happened


def _dp_step(rank, world, gbps):
    import torch
    from commlab.engine.comm.wfbp import Sync
    from commlab.engine.compressors import make
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    clock = FakeClock()
    link = ModeledLink(gbps, clock=clock, sleep=clock.sleep)
    dp = Sync(model, lambda infos: [[i] for i in range(len(infos))], lambda: make("none"), link=link)
    times = []
    for _ in range(3):
        model(torch.randn(8, 256)).sum().backward()
        t0 = clock()
        dp.finish()
        times.append(clock() - t0)
        dp.zero_grad()
    nbytes = [p.numel() * 4 for p in model.parameters()]
    return times, nbytes


def test_dataparallel_buckets_queue_on_a_modeled_link():
    from distutil import run_world
    gbps = 0.02
    for times, nbytes in run_world(_dp_step, gbps):
        # four buckets issued together share one link: finish() ends when the last one's model time does
        pred = sum(ring_allreduce_s(n, 2, gbps) for n in nbytes)
        assert times == pytest.approx([pred] * 3, rel=1e-9)
