"""Checks for chapter 10's exercises (when data parallelism scales).

Chapter 10: checks for the scaling exercises.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from dpcourse.cost import costmodel, hardware, scaling
from dpcourse.harness.exercises.core import Mismatch, call_learner, exercise

# (world_size, compute_s, grad_bytes, alpha, beta, overlap): a 1.3B model in bf16 on H100s over
# InfiniBand, a fp32 one with no overlap, a latency-bound one, a tiny gradient, one rank.
STEP_CASES = [
    (64, 0.65, 2.6e9, 5e-6, 50e9, 2 / 3),
    (8, 0.65, 5.2e9, 3e-6, 450e9, 0.0),
    (1024, 0.01, 4e6, 20e-6, 12.5e9, 0.5),
    (16, 0.2, 1e9, 5e-6, 50e9, 2 / 3),
    (2, 1.0, 1e8, 5e-6, 12.5e9, 1.0),
    (1, 0.3, 2.6e9, 5e-6, 50e9, 0.0),
]


def _close(got, want: float, rel: float = 1e-6) -> bool:
    try:
        return math.isclose(float(got), want, rel_tol=rel, abs_tol=1e-15)
    except (TypeError, ValueError):
        return False


def _step_time_hint(got, n, compute, nbytes, alpha, beta, overlap) -> str:
    ring = costmodel.all_reduce_time("ring", n, nbytes, alpha, beta)
    wrong = {
        "compute + all-reduce: the overlap is ignored": compute + ring,
        "max(compute, all-reduce): that is full overlap, overlap=1": max(compute, ring),
        "the hidden part is overlap x all-reduce; it is overlap x compute (the all-reduce hides "
        "behind that much of the compute)": compute + ring * (1 - overlap),
        "compute + all-reduce - overlap x compute without max(0, ...): the overlap cannot hide "
        "more than the all-reduce, a step is never shorter than its compute": compute
        + ring
        - overlap * compute,
        "each rank sends (N-1)/N of the data: that is one phase; the ring has two "
        "(reduce-scatter and all-gather)": compute
        + max(0.0, (n - 1) * alpha + (n - 1) / n * nbytes / beta - overlap * compute),
        "each rank sends 2(N-1) whole gradients: that is the naive all-reduce, the ring sends "
        "2(N-1)/N": compute + max(0.0, 2 * (n - 1) * (alpha + nbytes / beta) - overlap * compute),
    }
    for why, value in wrong.items():
        if _close(got, value) and not _close(
            value, scaling.step_time(n, compute, nbytes, alpha, beta, overlap)
        ):
            return f" It looks like {why}."
    return ""


@exercise("ex-10-step-time", function="my_step_time", timeout=20)
def step_time(fn: Callable) -> str:
    """``fn(world_size, compute_s, grad_bytes, alpha, beta, overlap)``: seconds of one
    data-parallel step with a ring all-reduce, against :func:`dpcourse.cost.scaling.step_time`."""
    for n, compute, nbytes, alpha, beta, overlap in STEP_CASES:
        want = scaling.step_time(n, compute, nbytes, alpha, beta, overlap)
        got = call_learner(fn, n, compute, nbytes, alpha, beta, overlap)
        if not _close(got, want):
            hint = _step_time_hint(got, n, compute, nbytes, alpha, beta, overlap)
            raise Mismatch(
                f"N={n}, compute {compute:g} s, {nbytes:.3g} gradient bytes, alpha={alpha:g} s, "
                f"beta={beta:.3g} B/s, overlap={overlap:.3g}: expected {want:.6g} s, got "
                f"{got!r}.{hint}"
            )
    return f"equals compute + the exposed ring all-reduce in {len(STEP_CASES)} settings"


# (target, compute_s, grad_bytes, alpha, beta, overlap) with answers from 1 to tens of
# thousands, and the edges the statement names: the cap (a communication so cheap that every N
# up to 100,000 reaches the target), N = 1 alone (a target of 1: any communication misses it)
# and 0 (a target above 1, which not even one rank reaches)
LARGEST_CASES = [
    (0.9, 0.65, 2.6e9, 5e-6, 50e9, 2 / 3),
    (0.9, 0.65, 2.6e9, 5e-6, 50e9, 0.0),
    (0.95, 0.05, 1e6, 10e-6, 12.5e9, 0.0),
    (0.8, 0.02, 1e7, 5e-6, 25e9, 2 / 3),
    (0.99, 0.1, 1e9, 5e-6, 50e9, 0.0),
    (0.9, 1.0, 1e3, 1e-9, 1e12, 1.0),
    (1.0, 0.1, 1e6, 5e-6, 50e9, 0.0),
    (1.5, 0.1, 1e6, 5e-6, 50e9, 0.0),
]
LIMIT = 100_000


def _weak(target, compute, nbytes, alpha, beta, overlap):
    def at(n: int) -> float:
        return scaling.efficiency(n, compute, nbytes, alpha, beta, overlap)

    return at


@exercise("ex-10-largest-n", function="largest_world_size_for", timeout=60)
def largest_efficient_world_size(fn: Callable) -> str:
    """``fn(target, compute_s, grad_bytes, alpha, beta, overlap)``: the largest N (up to 100,000)
    whose weak-scaling efficiency is at least ``target``; 0 if none."""
    for case in LARGEST_CASES:
        at = _weak(*case)
        want = scaling.largest_world_size(case[0], at, limit=LIMIT)
        got = call_learner(fn, *case)
        if got == want:
            continue
        target = case[0]
        hint = ""
        if want == LIMIT and got == LIMIT - 1:
            hint = (f" Every N up to {LIMIT:,} reaches the target here, so the answer is the cap "
                    f"itself: does your search stop one short of {LIMIT:,}?")
        elif want == 0:
            hint = (" Not even N = 1 reaches a target above 1 (one rank's efficiency is 1): the "
                    "statement asks for 0 then")
        elif isinstance(got, (int, float)) and got >= 1 and int(got) == got:
            e_got = at(int(got))
            if got == want + 1:
                hint = (
                    f" N={int(got)} is the first N below the target (efficiency {e_got:.4f}); "
                    "the answer is the one before it"
                )
            elif e_got < target:
                hint = f" At N={int(got)} the efficiency is {e_got:.4f}, below {target}"
            elif got < want:
                hint = (
                    f" N={want} still reaches {at(want):.4f}: do you search only powers of two, "
                    "or use the strong-scaling efficiency?"
                )
        raise Mismatch(
            f"target {target}, compute {case[1]:g} s, {case[2]:.3g} gradient bytes, "
            f"alpha={case[3]:g} s, beta={case[4]:.3g} B/s, overlap={case[5]:.3g}: expected "
            f"N={want}" + (f" (efficiency {at(want):.4f})" if want >= 1 else "")
            + f", got {got!r}.{hint}"
        )
    return (f"the right N in {len(LARGEST_CASES)} settings, from 0 and 1 to the cap of "
            f"{LIMIT:,} ranks")


# (true |G|^2, true tr(Sigma), b_small, b_big): norms built as their expected values, so an
# unbiased estimator must give back the truth exactly.
NOISE_CASES = [(2.0, 40.0, 4, 64), (0.01, 3.0, 1, 8), (5.0, 1.0, 16, 1024), (0.3, 90.0, 32, 256)]


@exercise("ex-10-noise-scale", function="my_noise_scale", timeout=10)
def noise_scale(fn: Callable) -> str:
    """``fn(g_small_sq, g_big_sq, b_small, b_big)`` returns ``(|G|^2, tr(Sigma))`` estimated
    from the squared norms of gradients averaged over ``b_small`` and ``b_big`` examples."""
    for g2, trace, bs, bb in NOISE_CASES:
        small, big = g2 + trace / bs, g2 + trace / bb
        got = call_learner(fn, small, big, bs, bb)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise Mismatch(
                f"expected a pair (|G|^2, tr(Sigma)), got {got!r}"
                + (
                    " (the ratio B_simple comes after: return both estimates)"
                    if _close(got, trace / g2)
                    else ""
                )
            )
        what = (
            f"|G_small|^2={small:g} (B={bs}), |G_big|^2={big:g} (B={bb}); the truth is "
            f"|G|^2={g2:g}, tr(Sigma)={trace:g}"
        )
        if not _close(got[0], g2, 1e-6):
            hint = ""
            if _close(got[0], big):
                hint = (
                    " |G_big|^2 is biased: its expectation is |G|^2 + tr(Sigma)/B_big; combine "
                    "both norms so that the tr(Sigma) terms cancel"
                )
            elif _close(got[0], (bs * big - bb * small) / (bb - bs)):
                hint = " Check which batch size multiplies which norm."
            raise Mismatch(f"{what}: your |G|^2 is {got[0]!r}.{hint}")
        if not _close(got[1], trace, 1e-6):
            hint = ""
            if _close(got[1], -trace):
                hint = " The sign is flipped: |G_small|^2 is the larger one."
            elif _close(got[1], (small - big) * bs):
                hint = " Divide by (1/B_small - 1/B_big), not multiply by B_small."
            raise Mismatch(f"{what}: your tr(Sigma) is {got[1]!r}.{hint}")
    return "gives back |G|^2 and tr(Sigma) exactly from their expected norms in every case"


# (parameters, GPUs, bytes per value, link bytes/s, peak FLOP/s, MFU, overlap): the question's
# two settings first (8 rings over a node's 8 NDR cards, 400 GB/s; one ring through one card)
HIDE_CASES = [
    (7e9, 1024, 2, 400e9, 989e12, 0.4, 2 / 3),
    (7e9, 1024, 2, 50e9, 989e12, 0.4, 2 / 3),
    (1.3e9, 8, 2, 450e9, 989e12, 0.4, 2 / 3),
    (1.3e9, 8, 4, 450e9, 989e12, 0.5, 1.0),
    (125e6, 3, 4, 12.5e9, 312e12, 0.3, 0.5),
]


@exercise("ex-10-hide", function="my_tokens_to_hide", timeout=10)
def tokens_to_hide(fn: Callable) -> str:
    """``fn(num_params, world_size, bytes_per_value, link_bytes_per_s, peak_flops, mfu,
    overlap)``: the fewest tokens per GPU per step whose compute hides a ring all-reduce of the
    gradient (latency left out), against :func:`dpcourse.cost.scaling.tokens_to_hide` (or that
    number rounded up to whole tokens). Rejects the
    ring's 2(N-1)/N taken as 2, the whole compute taken as hiding it, and forward-only FLOPs."""

    for params, n, width, beta, flops, mfu, overlap in HIDE_CASES:
        gpu = hardware.GPU("the case's GPU", flops, "exercise")
        comm = costmodel.all_reduce_time("ring", n, params * width, 0.0, beta)
        want = scaling.tokens_to_hide(comm, params, gpu, mfu, overlap)
        got = call_learner(fn, params, n, width, beta, flops, mfu, overlap)
        if _close(got, want, 1e-6) or got == math.ceil(want):  # whole tokens: rounded up
            continue
        where = (f"{params:.3g} parameters, {width} bytes each, {n} GPUs, {beta:.3g} B/s, "
                 f"{flops:.3g} FLOP/s at MFU {mfu}, overlap {overlap:.3g}: expected "
                 f"{want:,.0f} tokens, got {got!r}.")
        hint = ""
        if _close(got, want * 2 / (2 * (n - 1) / n)):
            hint = " The ring sends 2(N-1)/N of the gradient per GPU, not 2 gradients."
        elif _close(got, want * overlap):
            hint = (" Only part of the step's compute can hide the all-reduce (the backward, "
                    "`overlap` of it): divide by overlap x compute per token.")
        elif _close(got, want * 3):
            hint = " A training step costs 6 FLOPs per parameter per token, not 2 (forward only)."
        raise Mismatch(where + hint)
    return "T* = all-reduce time / (overlap x compute per token), for every case tried"
