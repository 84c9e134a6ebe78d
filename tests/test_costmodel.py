"""The alpha-beta cost model and the all-reduce timing helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpcourse.collectives import commbench
from dpcourse.cost import costmodel
from dpcourse.harness.launch import run_ranks


@pytest.mark.parametrize("n", [2, 3, 4, 8, 1000])
def test_terms_match_the_counted_traffic_formulas(n):
    assert costmodel.terms("ring", n) == (2 * (n - 1), 2 * (n - 1) / n)
    assert costmodel.terms("naive", n) == (2 * (n - 1), 2 * (n - 1))
    rounds = math.ceil(math.log2(n))
    assert costmodel.terms("tree", n) == (2 * rounds, 2 * rounds)


@pytest.mark.parametrize("n", [2, 4, 8, 1024])
def test_halving_doubling_has_the_ring_bytes_and_the_tree_latencies(n):
    latencies, volume = costmodel.terms("halving-doubling", n)
    assert latencies == 2 * math.log2(n) == costmodel.terms("tree", n)[0]
    assert volume == costmodel.terms("ring", n)[1]
    ring = costmodel.all_reduce_time("ring", n, 1e8, 5e-6, 12.5e9)
    halving_doubling = costmodel.all_reduce_time("halving-doubling", n, 1e8, 5e-6, 12.5e9)
    assert halving_doubling < ring if n > 2 else halving_doubling == ring


def test_halving_doubling_needs_a_power_of_two():
    assert costmodel.terms("halving-doubling", 1) == (0.0, 0.0)
    with pytest.raises(ValueError, match="power of two"):
        costmodel.terms("halving-doubling", 6)


def test_one_rank_costs_nothing_and_bad_input_is_refused():
    assert costmodel.terms("ring", 1) == (0.0, 0.0)
    with pytest.raises(ValueError, match="algorithm"):
        costmodel.terms("butterfly", 4)
    with pytest.raises(ValueError, match="world_size"):
        costmodel.terms("ring", 0)
    with pytest.raises(ValueError, match="two"):
        costmodel.fit("ring", 4, [1.0], [1.0])


@pytest.mark.parametrize("algorithm", costmodel.ALGORITHMS)
def test_fit_recovers_alpha_and_beta(algorithm):
    sizes = np.logspace(10, 26, 9, base=2)
    rng = np.random.default_rng(0)
    modelled = costmodel.all_reduce_time(algorithm, 4, sizes, 25e-6, 3e9)
    seconds = modelled * rng.uniform(0.97, 1.03, 9)
    f = costmodel.fit(algorithm, 4, sizes, seconds)
    assert f.alpha == pytest.approx(25e-6, rel=0.1)
    assert f.beta == pytest.approx(3e9, rel=0.1)
    assert f.predict(sizes) == pytest.approx(seconds, rel=0.1)


def test_ring_time_stays_bounded_as_n_grows_while_naive_does_not():
    t = {n: costmodel.all_reduce_time("ring", n, 1e8, 0.0, 1e10) for n in (2, 64, 4096)}
    assert t[4096] < 2 * 1e8 / 1e10 and t[2] == pytest.approx(1e8 / 1e10)
    naive = costmodel.all_reduce_time("naive", 4096, 1e8, 0.0, 1e10)
    assert naive == pytest.approx(2 * 4095 * 1e-2)


def test_bus_bandwidth_is_nccl_tests_definition():
    assert commbench.bus_bandwidth(1e9, 1.0, 4) == pytest.approx(1.5e9)
    assert commbench.bus_bandwidth(1e9, 1.0, 2) == pytest.approx(1e9)
    assert commbench.default_sizes() == [2**k for k in range(10, 27, 2)]


def test_timing_on_ranks_returns_a_median_per_implementation_and_size():
    sizes = [2**10, 2**14]
    results = run_ranks(commbench.time_all_reduce_on_rank, 2, sizes, repeats=3)
    assert results[0] == results[1]  # the slowest rank's time, agreed on by both
    for name in commbench.IMPLEMENTATIONS:
        assert len(results[0][name]) == len(sizes)
        assert all(0 < t < 10 for t in results[0][name])


def test_cpu_per_call_gives_wall_and_cpu_times_of_every_repetition():
    sizes, ways = [2**12, 2**16], ("library", "ring")
    results = run_ranks(commbench.cpu_per_call_on_rank, 2, sizes, ways, 3)
    assert results[0] == results[1]  # the largest over the ranks, agreed on by both
    for way in ways:
        assert [len(calls) for calls in results[0][way]] == [3, 3]
        for wall, caller, others in (c for calls in results[0][way] for c in calls):
            assert 0 < wall < 10 and 0 <= caller <= wall + 1e-3 and others >= 0
    # the library's all-reduce runs on gloo's worker thread: its CPU shows as the others'
    assert sum(others for calls in results[0]["library"] for _, _, others in calls) > 0


def test_fit_link_recovers_latency_and_bandwidth_and_ignores_a_burst():
    alpha, beta = 1e-4, 125e6
    sizes = [2**12, 2**16, 2**20, 2**22, 2**24]
    seconds = [alpha + s / beta for s in sizes]
    seconds[1] = alpha  # a token bucket let this one through at once
    got_alpha, got_beta = costmodel.fit_link(sizes, seconds)
    assert got_alpha == pytest.approx(alpha, rel=1e-6) and got_beta == pytest.approx(beta)
    with pytest.raises(ValueError, match="one message under"):
        costmodel.fit_link([2**20, 2**22], [0.1, 0.2])
