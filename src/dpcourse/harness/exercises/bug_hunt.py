"""Checks for the "find the bugs" appendix: the learner fixes the seed script piece by piece.

Each check runs the learner's piece where the seed's went wrong and compares it with the fix in
:mod:`dpcourse.debugging.bug_hunt`; the seed's own piece and the plausible half-fixes fail with
what they get wrong. The appendix's labels are ``ex-bugs-<slug>`` and its exercises are numbered
Bugs.1 to Bugs.4 (:mod:`dpcourse.harness.exercises.numbering`), so that the grader, which finds a
notebook's part from its labels, grades each appendix on its own exercises.

Appendix: find the bugs (exercise checks).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn as nn

from dpcourse.debugging import bug_hunt
from dpcourse.harness.exercises.core import (
    Mismatch,
    call_learner,
    exercise,
    expect_close,
    expect_equal,
)
from dpcourse.one_device.data import PAD
from dpcourse.practice.lr_schedule import noam_lr

CASES = [(32, 4), (512, 4000), (16, 1)]  # (d_model, warmup)


@exercise("ex-bugs-noam", function="my_noam_lambda", timeout=10)
def noam_lambda(fn: Callable) -> str:
    """``fn(step, d_model, warmup)``: the Noam multiplier of step ``step`` (from 0), the
    formula at s = step + 1, for ``LambdaLR``."""
    for d_model, warmup in CASES:
        for step in sorted({0, 1, 2, warmup - 1, warmup, 3 * warmup}):
            got, want = call_learner(fn, step, d_model, warmup), noam_lr(step, d_model, warmup)
            if not isinstance(got, (int, float)) or isinstance(got, bool):
                raise Mismatch(f"expected a number for step {step}, got {got!r}")
            if abs(got - want) <= 1e-9 * want:
                continue
            where = f"step {step} (d_model={d_model}, warmup={warmup}): expected {want:.6g}, "
            if step == 0 and got == 0:
                raise Mismatch(
                    where + "got 0. LambdaLR applies the multiplier of step 0 before the first "
                    "optimizer step, so that step does not move the weights: count s from 1."
                )
            if step == 1 and abs(got - noam_lr(0, d_model, warmup)) <= 1e-9 * want:
                raise Mismatch(
                    where + f"got {got:.6g}, the rate of step 0 again. Clamping s to at least 1 "
                    "repeats the first rate and puts the schedule one step late from then on "
                    "(its peak at step warmup instead of warmup - 1): use s = step + 1."
                )
            ratio = got / want if want else float("nan")
            raise Mismatch(where + f"got {got:.6g} (got/expected = {ratio:.4g})")
    return "never 0, peaks at step warmup - 1, and decays as 1/sqrt(step + 1)"


def _mixing_inputs(seed: int, batch: int, src_len: int, tgt_len: int, d_model: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, src_len, d_model, generator=g),
            torch.randn(batch, tgt_len, d_model, generator=g))  # fmt: skip


@exercise("ex-bugs-batch-first", function="my_make_transformer", timeout=30)
def make_transformer(fn: Callable) -> str:
    """``fn(d_model, nhead, layers, ff)`` returns the seed's ``nn.Transformer`` fixed for
    ``(batch, seq, d_model)`` tensors: the sizes it is given (two settings: parameters counted,
    attention heads read), no dropout (two forwards in training mode agree), and examples kept
    apart."""
    for d_model, nhead, layers, ff in ((16, 2, 1, 32), (24, 3, 2, 40)):
        model = call_learner(fn, d_model, nhead, layers, ff)
        if not isinstance(model, nn.Module):
            raise Mismatch(f"expected an nn.Module, got {type(model).__name__}")
        want = bug_hunt.make_transformer(d_model, nhead, layers, ff)
        counts = [sum(p.numel() for p in m.parameters()) for m in (model, want)]
        if counts[0] != counts[1]:
            raise Mismatch(
                f"expected nn.Transformer(d_model={d_model}, nhead={nhead}, {layers} encoder and "
                f"{layers} decoder layer(s), dim_feedforward={ff}): {counts[1]} parameters, got "
                f"{counts[0]}"
            )
        heads = sorted({m.num_heads for m in model.modules()
                        if isinstance(m, nn.MultiheadAttention)})
        if heads != [nhead]:
            raise Mismatch(f"nhead={nhead}: your Transformer's attention has {heads} head(s); "
                           "pass nhead on")
        _expect_no_dropout(model, d_model)
    model.eval()
    # batch = source = target length: the case where the seed's model runs without an error
    src, tgt = _mixing_inputs(0, 6, 6, 6, d_model)
    other = src.clone()
    other[1] = torch.randn(6, d_model, generator=torch.Generator().manual_seed(1))
    mask = nn.Transformer.generate_square_subsequent_mask(6)
    with torch.no_grad():
        out, changed = model(src, tgt, tgt_mask=mask), model(other, tgt, tgt_mask=mask)
    if out.shape != tgt.shape:
        raise Mismatch(f"for (batch, seq, d_model) inputs the output should have the target's "
                       f"shape {tuple(tgt.shape)}, got {tuple(out.shape)}")  # fmt: skip
    if (out[0] - changed[0]).abs().max() > 1e-5:
        raise Mismatch(
            "example 0's output changed when only example 1's source changed: the Transformer "
            "reads dim 0 of (batch, seq, d_model) tensors as the sequence and dim 1 as the "
            "batch, so it attends across the examples of a batch. Build it with "
            "batch_first=True."
        )
    src, tgt = _mixing_inputs(2, 3, 7, 5, d_model)
    try:
        with torch.no_grad():
            out = model(src, tgt, tgt_mask=nn.Transformer.generate_square_subsequent_mask(5))
    except RuntimeError as exc:
        raise Mismatch(
            f"on 3 examples of 7 source and 5 target positions your Transformer raised: {exc}"
        ) from None
    expect_equal(tuple(out.shape), (3, 5, d_model), "the output's shape for 3 examples, 7 source "
                 "and 5 target positions")  # fmt: skip
    return "keeps the examples of a batch apart, for sources and targets of any lengths"


def _expect_no_dropout(model: nn.Module, d_model: int) -> None:
    """Two forwards of one batch in training mode must agree: the seed's model has no dropout
    (so that 2 ranks and one process can give the same weights)."""
    src, tgt = _mixing_inputs(3, 3, 3, 3, d_model)  # runs whichever dimension is the batch
    mask = nn.Transformer.generate_square_subsequent_mask(3)
    model.train()
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            first = model(src, tgt, tgt_mask=mask)
            second = model(src, tgt, tgt_mask=mask)
    except RuntimeError as exc:
        raise Mismatch(f"your Transformer raised on 3 examples of 3 positions: {exc}") from None
    if not torch.equal(first, second):
        raise Mismatch("in training mode two forwards of the same batch differ: your Transformer "
                       "drops out (nn.Transformer's default is dropout=0.1). The seed's has no "
                       "dropout: pass dropout=0.0")


def _pairs_for_collate():
    pairs = bug_hunt.digit_pairs(6, seed=3, min_len=1, max_len=6)
    pairs.sort(key=lambda p: -len(p[0]))
    return pairs[1:]  # the longest first but not of the data set's maximum length


@exercise("ex-bugs-collate", function="my_collate", timeout=10)
def collate(fn: Callable) -> str:
    """``fn(samples)``: a list of variable-length ``(src, tgt)`` pairs to ``(src, tgt_in,
    tgt_out, src_pad)``, as :func:`dpcourse.debugging.bug_hunt.pad_collate` returns them."""
    for pairs in (_pairs_for_collate(), bug_hunt.digit_pairs(5, seed=4)[::-1]):
        got = call_learner(fn, [(s.clone(), t.clone()) for s, t in pairs])
        want = bug_hunt.pad_collate(pairs)
        if not isinstance(got, (tuple, list)) or len(got) != 4:
            raise Mismatch(f"expected a tuple (src, tgt_in, tgt_out, src_pad), got {got!r:.200}")
        names = ("src", "tgt_in", "tgt_out", "src_pad")
        for name, g, w in zip(names, got, want, strict=True):
            if not isinstance(g, torch.Tensor):
                raise Mismatch(f"{name}: expected a tensor, got {type(g).__name__}")
            if g.shape != w.shape:
                longest = max(len(s) for s, _ in pairs)
                raise Mismatch(
                    f"{name}: expected shape {tuple(w.shape)}, got {tuple(g.shape)}. Pad to the "
                    f"longest sequence of the batch (here {longest} source tokens), no further"
                )
        src, tgt_in, tgt_out, src_pad = got
        if src_pad.dtype != torch.bool:
            raise Mismatch(f"src_pad: expected a bool mask, got {src_pad.dtype}")
        if torch.equal(src_pad, ~want[3]):
            raise Mismatch(
                "src_pad is True at the real tokens: nn.Transformer's key_padding_mask is True "
                "where a position must be ignored, the padding"
            )
        if torch.equal(src[~want[3]], want[0][~want[3]]) and not torch.equal(src, want[0]):
            raise Mismatch(
                f"src: the padding holds {sorted(set(src[want[3]].tolist()))}, expected PAD "
                f"({PAD}): the embedding, the mask and the loss's ignore_index all know PAD"
            )
        for name, g, w in zip(names, got, want, strict=True):
            expect_equal(g, w, f"{name} (sequences padded at the end with PAD)")
    return "pads each batch to its longest sequence, with PAD, and masks exactly the padding"


# ------------------------------------------------------------------------------ ex-bugs-step
def _step_setup():
    torch.manual_seed(0)
    model = bug_hunt.Seq2Seq(d_model=16, ff=32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    lam = lambda s: noam_lr(s, 16, 2)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lam)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    batches = [bug_hunt.pad_collate(bug_hunt.digit_pairs(6, seed=s)) for s in (5, 6)]
    return model, optimizer, scheduler, scaler, batches


def _run_steps(step: Callable, max_norm: float = 0.5, dtype: torch.dtype = torch.bfloat16):
    model, optimizer, scheduler, scaler, batches = _step_setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = [step(model, b, optimizer, scheduler, scaler, max_norm, dtype)
                  for b in batches]  # fmt: skip
    cuda_amp = [w for w in caught if "torch.cuda.amp" in str(w.message)]
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses, weights, optimizer.param_groups[0]["lr"], cuda_amp


@exercise("ex-bugs-step", function="my_train_step", timeout=60)
def train_step(fn: Callable) -> str:
    """``fn(model, batch, optimizer, scheduler, scaler, max_norm, dtype)``: one step of the
    seed, fixed, on a :class:`dpcourse.debugging.bug_hunt.Seq2Seq` and :func:`pad_collate`'s
    batches, two steps with ``dtype`` bfloat16 and two with float16 (the dtype given is the one
    to autocast to, on the batch's device)."""
    want_losses, want_w, want_lr, _ = _run_steps(bug_hunt.fixed_step)
    losses, weights, lr, cuda_amp = _run_steps(lambda *a: call_learner(fn, *a))
    if cuda_amp:
        raise Mismatch(
            f"your step used torch.cuda.amp ({cuda_amp[0].message}). It is deprecated, and on "
            "a machine without CUDA its autocast and GradScaler switch themselves off: use "
            "torch.autocast(device_type, dtype=...) and the scaler you are given"
        )
    if not all(isinstance(v, float) for v in losses):
        raise Mismatch(f"expected the loss as a float (loss.item()), got {losses!r:.200}")
    if abs(losses[0] - want_losses[0]) > 1e-3 * want_losses[0]:
        raise Mismatch(_loss_problem(losses[0], want_losses[0]))
    if abs(lr - want_lr) > 1e-9:
        raise Mismatch(
            f"after two steps the learning rate is {lr:.6g}, expected {want_lr:.6g}: call "
            "scheduler.step() once per step, after scaler.step(optimizer)"
        )
    variants = {
        "clip_scaled": "you clipped the scaled gradients: clip_grad_norm_ saw them 1024 times "
        "too large, so after unscaling their norm is max_norm / 1024. Call "
        "scaler.unscale_(optimizer) before clipping",
        "no_clip": "the gradients were not clipped to max_norm after unscaling",
    }
    variants["no_autocast"] = (
        "your forward did not run under autocast here: autocast on the batch's device, "
        "torch.autocast(src.device.type, dtype=dtype), which is the CPU here and a GPU there (a "
        "hard-coded 'cuda' autocasts nothing on a CPU)")
    for name, message in variants.items():
        _, w, _, _ = _run_steps(_variant(name))
        if torch.allclose(weights, w, rtol=1e-4, atol=1e-6):
            raise Mismatch(message)
    expect_close(weights, want_w, "the weights after two steps", rtol=1e-4, atol=1e-6)
    _, want_w16, _, _ = _run_steps(bug_hunt.fixed_step, dtype=torch.float16)
    _, w16, _, _ = _run_steps(lambda *a: call_learner(fn, *a), dtype=torch.float16)
    if not torch.allclose(w16, want_w16, rtol=1e-4, atol=1e-6):
        if torch.allclose(w16, want_w, rtol=1e-4, atol=1e-6):
            raise Mismatch("with dtype=torch.float16 your step gives the bfloat16 step's weights: "
                           "autocast to the dtype you are given, torch.autocast(..., dtype=dtype)")
        expect_close(w16, want_w16, "with dtype=torch.float16, the weights after two steps",
                     rtol=1e-4, atol=1e-6)
    return ("torch.amp on the batch's device and in the dtype given (bfloat16 and float16), the "
            "loss over real tokens, unscale before clipping, one scheduler step")


def _loss_problem(got: float, want: float) -> str:
    """Why the learner's first loss is ``got`` where the fixed step's is ``want``."""
    model, _, _, _, batches = _step_setup()
    src, tgt_in, tgt_out, src_pad = batches[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, unmasked = model(src, tgt_in, src_pad), model(src, tgt_in)
        flat = logits.reshape(-1, logits.size(-1)).float(), tgt_out.reshape(-1)
        counted = nn.functional.cross_entropy(*flat).item()
        no_mask = bug_hunt.token_loss(unmasked, tgt_out).item()
    where = f"the first step's loss is {got:.4f}, expected {want:.4f}"
    pads = int((tgt_out == PAD).sum())
    if abs(got - counted) <= 1e-3 * counted:
        return (f"{where}: it averages over every target position, {pads} of the "
                f"{tgt_out.numel()} of which are PAD. Ignore them (ignore_index=PAD)")  # fmt: skip
    if abs(got - no_mask) <= 1e-3 * no_mask:
        return (f"{where}: the model attended to the padding. Pass the batch's src_pad to the "
                "model, model(src, tgt_in, src_pad)")  # fmt: skip
    return (f"{where}. The loss is the cross-entropy over the real target tokens, computed "
            "under torch.autocast(device_type, dtype=dtype) with the padding mask")  # fmt: skip


def _variant(name: str) -> Callable:
    def step(model, batch, optimizer, scheduler, scaler, max_norm, dtype):
        src, tgt_in, tgt_out, src_pad = batch
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(src.device.type, dtype=dtype, enabled=name != "no_autocast"):
            loss = bug_hunt.token_loss(model(src, tgt_in, src_pad), tgt_out)
        scaler.scale(loss).backward()
        if name == "clip_scaled":
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.unscale_(optimizer)
        if name == "no_autocast":
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        return loss.item()

    return step
