"""Chapter 12's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import math

import numpy as np
import torch

from dpcourse.communicating_less import powersgd, quantization, step_model
from dpcourse.harness.exercises import ch12, run_check  # noqa: F401 (registers the checks)


# ------------------------------------------------------------------- PowerSGD's values
def test_powersgd_values_check():
    assert run_check("ex-12-powersgd-values", powersgd.compressed_values).passed

    def no_gain_test(shape, rank):
        n, m = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
        return (n + m) * min(n, m, rank)

    result = run_check("ex-12-powersgd-values", no_gain_test)
    assert not result.passed and "min_compression_rate = 2 times fewer" in result.message

    def p_only(shape, rank):
        n, m = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
        r = min(n, m, rank)
        return n * r if (n + m) * r * 2 < n * m else n * m

    result = run_check("ex-12-powersgd-values", p_only)
    assert not result.passed and "Q (m x r) is all-reduced too" in result.message

    def last_dimension(shape, rank):
        n, m = int(np.prod(shape[:-1])), shape[-1]
        r = min(n, m, rank)
        return (n + m) * r if (n + m) * r * 2 < n * m else n * m

    result = run_check("ex-12-powersgd-values", last_dimension)
    assert not result.passed and "first dimension by the rest" in result.message
    result = run_check("ex-12-powersgd-values", lambda shape, rank: "many")
    assert not result.passed and "expected a number of values" in result.message


# --------------------------------------------------------------------- DiLoCo's outer step
def reference_outer(start, replicas, buf, lr, momentum, heavy_ball=False, sign=1.0):
    g = sign * torch.stack([start - r for r in replicas]).mean(0)
    buf = g.clone() if buf is None else momentum * buf + g
    step = buf if heavy_ball else g + momentum * buf
    return start - lr * step, buf


def test_outer_step_check():
    assert run_check("ex-12-outer-step", reference_outer).passed

    result = run_check("ex-12-outer-step",
                       lambda *a: reference_outer(*a, sign=-1.0))
    assert not result.passed and "moved the wrong way" in result.message
    result = run_check("ex-12-outer-step",
                       lambda s, r, b, lr, mu: (torch.stack(r).mean(0), b))
    assert not result.passed and "local SGD" in result.message
    result = run_check("ex-12-outer-step",
                       lambda *a: reference_outer(*a, heavy_ball=True))
    assert not result.passed and "heavy-ball momentum" in result.message
    result = run_check("ex-12-outer-step", lambda *a: a[0])
    assert not result.passed and "expected (new weights, new momentum buffer)" in result.message


# ------------------------------------------------------------------- how often to sync
def test_sync_every_check():
    def reference(p, n, c, beta, budget, bpv):
        return max(1, math.ceil(step_model.reduction_needed(p, n, c, beta, budget, bpv)))

    assert run_check("ex-12-sync-every", reference).passed

    def once(p, n, c, beta, budget, bpv):
        return max(1, math.ceil(p * bpv / beta / (budget * c)))

    result = run_check("ex-12-sync-every", once)
    assert not result.passed and "2(N-1)/N of the bytes" in result.message

    def bits(p, n, c, beta, budget, bpv):
        return math.ceil(8 * step_model.reduction_needed(p, n, c, beta, budget, bpv))

    result = run_check("ex-12-sync-every", bits)
    assert not result.passed and "bytes per second" in result.message

    def down(p, n, c, beta, budget, bpv):
        return max(1, math.floor(step_model.reduction_needed(p, n, c, beta, budget, bpv)))

    result = run_check("ex-12-sync-every", down)
    assert not result.passed and "Round up" in result.message


# -------------------------------------------------------------------------------- fp8
def test_quantize_check():
    def reference(blocks):
        codes, scale = quantization.quantize(blocks)
        return codes.view(torch.float8_e4m3fn), scale

    assert run_check("ex-12-quantize", reference).passed

    def one_scale(blocks):
        scale = quantization.FP8_MAX / blocks.abs().max()
        return (blocks * scale).to(torch.float8_e4m3fn), scale.reshape(1)

    result = run_check("ex-12-quantize", one_scale)
    assert not result.passed and "one scale for everything" in result.message

    def int8_max(blocks):
        largest = blocks.abs().amax(-1)
        scale = torch.where(largest > 0, 127 / largest, torch.ones_like(largest))
        return (blocks * scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale

    result = run_check("ex-12-quantize", int8_max)
    assert not result.passed and "127 is int8's largest" in result.message

    def zeros_nan(blocks):
        scale = quantization.FP8_MAX / blocks.abs().amax(-1)
        return (blocks * scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale

    result = run_check("ex-12-quantize", zeros_nan)
    assert not result.passed and "came back NaN" in result.message
