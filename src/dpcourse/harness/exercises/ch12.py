"""Checks for chapter 12's exercises (training over slow links by communicating less)

What PowerSGD sends, DiLoCo's outer step, how often a link lets a model synchronise, and fp8
quantisation with a scale per block.

Chapter 12: checks for the exercises on communicating less.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from dpcourse.communicating_less import powersgd, quantization, step_model
from dpcourse.harness.exercises.core import Mismatch, call_learner, exercise

# ------------------------------------------------------------------- PowerSGD's values
# (shape, rank): a big matrix, a vector, a matrix smaller than the rank, a conv kernel, a matrix
# that rank 4 does not gain on, a tall thin one
VALUE_CASES = [((256, 256), 1), ((256,), 4), ((3, 2), 4), ((64, 32, 3, 3), 2), ((12, 10), 4),
               ((1000, 8), 2), ((4096, 4096), 4), ((8, 256), 1)]


def _values_as(shape, rank, view: str, gain_test: bool = True, p_only: bool = False) -> int:
    """PowerSGD's values with a wrong view, no gain test, or P counted without Q."""
    if view == "last":
        n, m = int(np.prod(shape[:-1])), shape[-1]
    else:
        n, m = shape[0], int(np.prod(shape[1:])) if len(shape) > 1 else 1
    r = min(n, m, rank)
    sent = n * r if p_only else (n + m) * r
    if not gain_test:
        return sent
    return sent if (n + m) * r * 2 < n * m else n * m


@exercise("ex-12-powersgd-values", function="my_powersgd_values", timeout=10)
def powersgd_values(fn: Callable) -> str:
    """``fn(shape, rank)``: how many values PowerSGD sends for a gradient of ``shape`` (torch's
    ``min_compression_rate`` of 2), against :func:`dpcourse.communicating_less.powersgd.
    compressed_values`. Rejects no gain test, P counted without Q, and a conv kernel viewed as
    (everything but the last dimension) x (the last)."""
    for shape, rank in VALUE_CASES:
        want = powersgd.compressed_values(shape, rank)
        got = call_learner(fn, shape, rank)
        try:
            if int(got) == want and float(got) == want:
                continue
        except (TypeError, ValueError):
            raise Mismatch(f"shape {shape}, rank {rank}: expected a number of values such as "
                           f"{want}, got {got!r}") from None
        where = f"shape {shape}, rank {rank}: expected {want} values, got {got}."
        if got == _values_as(shape, rank, "first", gain_test=False):
            raise Mismatch(f"{where} (n + m) r is what PowerSGD would send; it sends it only "
                           "where that is min_compression_rate = 2 times fewer than n m, and "
                           "the gradient whole otherwise (vectors, small matrices).")
        if got == _values_as(shape, rank, "first", p_only=True):
            raise Mismatch(f"{where} P (n x r) is half of it: Q (m x r) is all-reduced too, "
                           "(n + m) r values in all.")
        if got == _values_as(shape, rank, "last"):
            raise Mismatch(f"{where} torch views a gradient as its first dimension by the "
                           "rest (a conv kernel (out, in, kh, kw) as out x in kh kw), not as "
                           "everything but the last dimension by the last.")
        raise Mismatch(where)
    return "the values of every gradient tried, compressed or whole as torch's hook decides"


# --------------------------------------------------------------------- DiLoCo's outer step
def _outer_reference(start, replicas, buf, lr, momentum, nesterov=True, sign=1.0,
                     average_weights=False):
    if average_weights:
        return torch.stack(replicas).mean(0), buf
    p = start.clone().requires_grad_()
    p.grad = sign * torch.stack([start - r for r in replicas]).mean(0)
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, nesterov=nesterov)
    if buf is not None:
        opt.state[p]["momentum_buffer"] = buf.clone()
    opt.step()
    return p.detach(), opt.state[p]["momentum_buffer"].clone()


def _outer_cases() -> list[tuple]:
    g = torch.Generator().manual_seed(12)
    cases = []
    for n_rep, lr, mu in ((2, 0.7, 0.9), (4, 0.5, 0.9), (3, 1.0, 0.5)):
        start = torch.randn(5, 3, generator=g)
        replicas = [start + 0.1 * torch.randn(5, 3, generator=g) for _ in range(n_rep)]
        cases.append((start, replicas, None, lr, mu))
        buf = 0.05 * torch.randn(5, 3, generator=g)
        cases.append((start, replicas, buf, lr, mu))
    return cases


@exercise("ex-12-outer-step", function="my_outer_step", timeout=10)
def outer_step(fn: Callable) -> str:
    """``fn(start, replicas, buf, lr, momentum)``: DiLoCo's outer step on one tensor, returning
    (the new global weights, the new momentum buffer), against ``torch.optim.SGD(nesterov=True)``
    on the averaged pseudo-gradient. Rejects the pseudo-gradient's sign flipped, the replicas'
    weights averaged (local SGD), and heavy-ball momentum instead of Nesterov's."""
    for start, replicas, buf, lr, mu in _outer_cases():
        want_p, want_buf = _outer_reference(start, replicas, buf, lr, mu)
        got = call_learner(fn, start.clone(), [r.clone() for r in replicas],
                           None if buf is None else buf.clone(), lr, mu)
        where = (f"{len(replicas)} replicas, lr {lr}, momentum {mu}, "
                 f"{'a first round (buf None)' if buf is None else 'a later round'}")
        try:
            got_p, got_buf = got
            got_p = torch.as_tensor(got_p)
            got_buf = None if got_buf is None else torch.as_tensor(got_buf)
        except (TypeError, ValueError, RuntimeError):
            raise Mismatch(f"{where}: expected (new weights, new momentum buffer), got "
                           f"{got!r}") from None
        weights_right = got_p.shape == want_p.shape and torch.allclose(got_p, want_p, atol=1e-6)
        if weights_right and got_buf is not None and torch.allclose(got_buf, want_buf, atol=1e-6):
            continue
        wrong = {name: torch.allclose(got_p, ref[0], atol=1e-6) for name, ref in (
            ("sign", _outer_reference(start, replicas, buf, lr, mu, sign=-1.0)),
            ("average", _outer_reference(start, replicas, buf, lr, mu, average_weights=True)),
            ("heavy ball", _outer_reference(start, replicas, buf, lr, mu, nesterov=False)))}
        if got_p.shape == want_p.shape and wrong["sign"]:
            raise Mismatch(f"{where}: the weights moved the wrong way. The pseudo-gradient is "
                           "start - local (it points back, as a gradient does, and SGD "
                           "subtracts it), not local - start.")
        if got_p.shape == want_p.shape and wrong["average"]:
            raise Mismatch(f"{where}: that is the replicas' average (local SGD): DiLoCo steps "
                           "an optimizer with momentum on the averaged pseudo-gradient, from "
                           "start.")
        if got_p.shape == want_p.shape and wrong["heavy ball"]:
            raise Mismatch(f"{where}: that is heavy-ball momentum (step by buf). Nesterov's "
                           "steps by g + momentum x buf, buf = momentum x buf + g.")
        if weights_right:
            raise Mismatch(f"{where}: the weights are right, the momentum buffer is not "
                           f"(expected momentum x buf + g, the first round g; got {got_buf}).")
        raise Mismatch(f"{where}: expected weights {want_p.flatten()[:3].tolist()}..., got "
                       f"{got_p.flatten()[:3].tolist()}...")
    return "the outer step and its momentum, first and later rounds, on 2 to 4 replicas"


# ------------------------------------------------------------------- how often to sync
# (parameters, N, compute seconds, link bytes/s, budget, bytes per value)
SYNC_CASES = [(76_296, 2, 1e-3, 1.25e6, 0.1, 4), (1.3e9, 8, 2.6, 1.25e9, 0.05, 2),
              (7e9, 64, 5.0, 12.5e9, 0.1, 2), (1e8, 2, 0.2, 125e6, 0.5, 4),
              (2e6, 4, 0.01, 1.25e9, 0.25, 4)]


@exercise("ex-12-sync-every", function="my_sync_every", timeout=10)
def sync_every(fn: Callable) -> str:
    """``fn(num_params, world_size, compute_s, beta, budget, bytes_per_value)``: the smallest
    whole H for which a ring all-reduce of the model every H steps costs, per step, at most
    ``budget`` of the compute (latency left out), against :func:`dpcourse.communicating_less.
    step_model.reduction_needed` rounded up. Rejects the ring's 2(N-1)/N left out, bits taken
    for bytes, and rounding down."""
    for params, world, compute, beta, budget, bpv in SYNC_CASES:
        exact = step_model.reduction_needed(params, world, compute, beta, budget, bpv)
        want = max(1, math.ceil(exact))
        got = call_learner(fn, params, world, compute, beta, budget, bpv)
        where = (f"{params:.4g} parameters of {bpv} bytes on {world} ranks, {compute} s of "
                 f"compute, {beta:.4g} bytes/s, budget {budget}: expected H = {want}, got "
                 f"{got!r}.")
        try:
            if int(got) == want and float(got) == int(got):
                continue
        except (TypeError, ValueError):
            raise Mismatch(where + " H is a whole number of steps.") from None
        ring = 2 * (world - 1) / world
        if int(got) == max(1, math.floor(exact)):
            raise Mismatch(where + " Round up: with the H below it, communication costs more "
                           "than the budget.")
        if ring != 1 and int(got) == math.ceil(exact / ring):
            raise Mismatch(where + " A ring all-reduce sends 2(N-1)/N of the bytes per rank, "
                           "not the bytes once.")
        if int(got) in (math.ceil(exact * 8), math.ceil(exact / 8)):
            raise Mismatch(where + " beta is in bytes per second here: a link of 10 Gbit/s "
                           "moves 1.25e9 bytes a second.")
        raise Mismatch(where)
    return "the smallest H within the budget, for every model and link tried"


# -------------------------------------------------------------------------------- fp8
def _quantize_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    spread = torch.randn(4, quantization.BLOCK, generator=g) * torch.tensor(
        [[1e-3], [1.0], [50.0], [1e-6]])
    zeros = torch.randn(3, quantization.BLOCK, generator=g)
    zeros[1] = 0.0
    return [spread, zeros, torch.randn(2, 5, quantization.BLOCK, generator=g)]


@exercise("ex-12-quantize", function="my_quantize", timeout=10)
def quantize(fn: Callable) -> str:
    """``fn(blocks)``: (e4m3 values as ``torch.float8_e4m3fn``, fp32 scale per block) for
    ``blocks`` of shape (..., BLOCK), read back as ``values.float() / scale[..., None]``,
    against :func:`dpcourse.communicating_less.quantization.quantize`. Rejects one scale for
    every block, int8's 127 for e4m3's 448, and a block of zeros that comes back NaN."""
    for blocks in _quantize_cases():
        codes, scale = quantization.quantize(blocks)
        want = quantization.dequantize(codes, scale)
        got = call_learner(fn, blocks.clone())
        where = f"blocks of shape {tuple(blocks.shape)}"
        try:
            values, got_scale = got
            back = values.float() / torch.as_tensor(got_scale).float().unsqueeze(-1)
        except (TypeError, ValueError, RuntimeError, AttributeError):
            raise Mismatch(f"{where}: expected (e4m3 values, a scale per block), got "
                           f"{got!r}") from None
        if back.shape == want.shape and torch.equal(back, want):
            continue
        if torch.isnan(back).any():
            raise Mismatch(f"{where}: a block of zeros came back NaN: its largest magnitude is "
                           "0, so 448 / 0 is infinite; give such a block a scale of 1.")
        if torch.as_tensor(got_scale).numel() == 1:
            raise Mismatch(f"{where}: one scale for everything flushes the small blocks to "
                           "zero (the 1e-6 block here): scale each block by its own largest "
                           "magnitude.")
        largest = blocks.abs().amax(-1, keepdim=True)
        int8_like = (blocks * (127 / largest)).to(quantization.FP8).float() / (127 / largest)
        if torch.allclose(back, torch.nan_to_num(int8_like), atol=0):
            raise Mismatch(f"{where}: 127 is int8's largest value; e4m3's is 448 "
                           "(quantization.FP8_MAX): scale each block so that its largest "
                           "magnitude becomes 448.")
        gap = (back - want).abs().max().item()
        raise Mismatch(f"{where}: read back, the values differ from the reference by up to "
                       f"{gap:.3g}.")
    return "every block read back as the reference's fp8 with a scale per block"
