"""Chapter 10's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import math

from dpcourse.cost import costmodel, hardware, noise_scale, scaling
from dpcourse.harness.exercises import ch10, run_check


def _ring(n, nbytes, alpha, beta):
    return costmodel.all_reduce_time("ring", n, nbytes, alpha, beta)


# ------------------------------------------------------------------------------- step time
def test_step_time_check():
    assert run_check("ex-10-step-time", scaling.step_time).passed

    def no_overlap(n, c, b, a, beta, o):
        return c + _ring(n, b, a, beta)

    result = run_check("ex-10-step-time", no_overlap)
    assert not result.passed and "the overlap is ignored" in result.message
    assert "N=64" in result.message and "expected" in result.message

    def overlap_times_comm(n, c, b, a, beta, o):
        return c + (1 - o) * _ring(n, b, a, beta)

    result = run_check("ex-10-step-time", overlap_times_comm)
    assert not result.passed and "it is overlap x compute" in result.message

    def no_max(n, c, b, a, beta, o):
        return c + _ring(n, b, a, beta) - o * c

    result = run_check("ex-10-step-time", no_max)
    assert not result.passed and "never shorter than its compute" in result.message

    def naive_volume(n, c, b, a, beta, o):
        return c + max(0.0, costmodel.all_reduce_time("naive", n, b, a, beta) - o * c)

    result = run_check("ex-10-step-time", naive_volume)
    assert not result.passed and "naive all-reduce" in result.message

    def one_phase(n, c, b, a, beta, o):
        return c + max(0.0, (n - 1) * a + (n - 1) / n * b / beta - o * c)

    result = run_check("ex-10-step-time", one_phase)
    assert not result.passed and "that is one phase" in result.message

    result = run_check("ex-10-step-time", lambda *args: "fast")
    assert not result.passed and "got 'fast'" in result.message


# ------------------------------------------------------------------------ largest N at 90%
def reference_largest(target, c, b, a, beta, o):
    return scaling.largest_world_size(
        target, lambda n: scaling.efficiency(n, c, b, a, beta, o), limit=100_000
    )


def test_largest_world_size_check():
    assert run_check("ex-10-largest-n", reference_largest).passed

    def loop(target, c, b, a, beta, o):  # the plain loop a learner writes passes too
        if scaling.efficiency(1, c, b, a, beta, o) < target:
            return 0
        n = 1
        while n < 100_000 and scaling.efficiency(n + 1, c, b, a, beta, o) >= target:
            n += 1
        return n

    assert run_check("ex-10-largest-n", loop).passed

    def first_below(target, c, b, a, beta, o):
        return reference_largest(target, c, b, a, beta, o) + 1

    result = run_check("ex-10-largest-n", first_below)
    assert not result.passed and "the first N below the target" in result.message

    def powers_of_two(target, c, b, a, beta, o):
        n = 1
        while scaling.efficiency(2 * n, c, b, a, beta, o) >= target:
            n *= 2
        return n

    result = run_check("ex-10-largest-n", powers_of_two)
    assert not result.passed and "powers of two" in result.message

    def strong_scaling(target, c, b, a, beta, o):
        return scaling.largest_world_size(
            target, lambda n: scaling.efficiency(n, c, b, a, beta, o, mode="strong"), 100_000
        )

    result = run_check("ex-10-largest-n", strong_scaling)
    assert not result.passed and "strong-scaling" in result.message


# ------------------------------------------------------------------------------ noise scale
def test_noise_scale_check():
    def reference(small, big, bs, bb):
        est = noise_scale.noise_scale_from_norms(small, big, bs, bb)
        return est.g2, est.trace

    assert run_check("ex-10-noise-scale", reference).passed

    def biased(small, big, bs, bb):
        return big, (small - big) / (1 / bs - 1 / bb)

    result = run_check("ex-10-noise-scale", biased)
    assert not result.passed and "|G_big|^2 is biased" in result.message

    def flipped(small, big, bs, bb):
        est = noise_scale.noise_scale_from_norms(small, big, bs, bb)
        return est.g2, -est.trace

    result = run_check("ex-10-noise-scale", flipped)
    assert not result.passed and "sign is flipped" in result.message

    def swapped_sizes(small, big, bs, bb):
        return (bs * big - bb * small) / (bb - bs), (small - big) / (1 / bs - 1 / bb)

    result = run_check("ex-10-noise-scale", swapped_sizes)
    assert not result.passed and "which batch size multiplies which norm" in result.message

    def ratio_only(small, big, bs, bb):
        return noise_scale.noise_scale_from_norms(small, big, bs, bb).b_simple

    result = run_check("ex-10-noise-scale", ratio_only)
    assert not result.passed and "return both estimates" in result.message


# ------------------------------------------------------------------- tokens that hide it
def tokens_reference(params, n, width, beta, flops, mfu, overlap):
    comm = 2 * (n - 1) / n * params * width / beta
    return comm / (overlap * 6 * params / (flops * mfu))


def test_tokens_to_hide_check_accepts_the_formula_and_names_three_slips():
    assert run_check("ex-10-hide", tokens_reference).passed
    # the question's answers (its solution's text): a node's 8 cards of 50 GB/s, one card
    node, card = ch10.HIDE_CASES[:2]
    assert node[3] == scaling.cross_node_link(8).beta and card[3] == hardware.IB_NDR.beta
    assert round(tokens_reference(*node), -1) == 990 and round(tokens_reference(*card), -2) == 7900
    two = lambda p, n, w, b, f, m, o: tokens_reference(p, n, w, b, f, m, o) * n / (n - 1)  # noqa: E731
    result = run_check("ex-10-hide", two)
    assert not result.passed and "2(N-1)/N" in result.message
    all_compute = lambda p, n, w, b, f, m, o: tokens_reference(p, n, w, b, f, m, o) * o  # noqa: E731
    result = run_check("ex-10-hide", all_compute)
    assert not result.passed and "overlap x compute per token" in result.message
    forward = lambda p, n, w, b, f, m, o: tokens_reference(p, n, w, b, f, m, o) * 3  # noqa: E731
    result = run_check("ex-10-hide", forward)
    assert not result.passed and "6 FLOPs per parameter" in result.message


# ------------------------------------------------ the wrong answers students write (issue 43)
def _search(target, c, b, a, beta, o, cap=100_000, zero=True):
    if zero and scaling.efficiency(1, c, b, a, beta, o) < target:
        return 0
    lo, hi = 1, cap
    if scaling.efficiency(hi, c, b, a, beta, o) >= target:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if scaling.efficiency(mid, c, b, a, beta, o) >= target else (lo, mid)
    return lo


def test_largest_world_size_tries_the_edges_of_its_statement():
    # kind 1, edge sizes: a search that stops one short of the cap, and one that returns 1
    # where not even one rank reaches the target
    def one_short(*case):
        return min(_search(*case), 99_999)

    result = run_check("ex-10-largest-n", one_short)
    assert not result.passed and "expected N=100000" in result.message
    assert "does your search stop one short" in result.message
    result = run_check("ex-10-largest-n", lambda *case: _search(*case, zero=False))
    assert not result.passed and "expected N=0, got 1" in result.message


def test_tokens_to_hide_takes_the_fewest_whole_tokens():
    """The fewest tokens is a whole number: the real number rounded up is right too."""
    assert run_check("ex-10-hide", lambda *a: math.ceil(tokens_reference(*a))).passed
