"""Appendix: find the bugs. The seed script's bugs, each shown by a measurement, and the fixes.

:mod:`dpcourse.debugging.bug_hunt_seed` trains a small Transformer with DDP, mixed precision,
clipping and the Noam schedule, and runs without an error. Its bugs, and the function here that
shows
each one's symptom on the CPU in well under a second:

1. the first step runs at learning rate 0 (:func:`first_step`);
2. ``nn.Transformer`` reads ``(batch, seq)`` data as ``(seq, batch)``, so examples attend to
   each other (:func:`batch_mixing`);
3. padding: variable-length sequences cannot be stacked, and padding that is neither masked in
   attention nor ignored by the loss changes outputs and loss (:func:`padding_effects`);
4. ``torch.cuda.amp``: deprecated, and on a machine without CUDA it turns mixed precision off
   (:func:`cuda_amp_effects`); clipping before ``scaler.unscale_`` clips the scaled gradient
   (:func:`clipping_before_unscale`);
5. DDP: a ``DistributedSampler`` without ``set_epoch`` repeats its order every epoch
   (:func:`sampler_orders`), and a loss logged on rank 0 is rank 0's loss only.

The fixed pieces: :class:`Seq2Seq` (``batch_first=True``, key padding masks), :func:`pad_collate`,
:func:`token_loss`, :func:`fixed_step` (``torch.amp``, unscale before clipping) and
:func:`train_fixed`, which gives the same weights on 2 ranks as in one process, with the Noam
schedule scaled by :data:`NOAM_FACTOR` (the seed's scale peaks too high for this model to learn).

Appendix: find the bugs (the symptoms and the fixes).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from dpcourse import runtime
from dpcourse.one_device.data import (
    PAD,
    VOCAB_SIZE,
    DigitsToWords,
    collate_seq2seq,
    digits_to_words,
    encode_digits,
    encode_words,
)
from dpcourse.one_device.models import sequence_cross_entropy
from dpcourse.practice.lr_schedule import noam_lr

__all__ = [
    "digit_pairs", "make_transformer", "Seq2Seq", "pad_collate", "token_loss", "fixed_step",
    "train_fixed", "first_step", "batch_mixing", "padding_effects", "cuda_amp_effects",
    "clipping_before_unscale", "sampler_orders", "D_MODEL", "WARMUP", "NOAM_FACTOR",
]  # fmt: skip

D_MODEL, WARMUP = 32, 4  # the seed's model width and warm-up steps
# The fixed schedule's scale. Noam's rate, d_model^-1/2 x min(s^-1/2, s x warmup^-3/2), was made
# for d_model 512 and 4,000 warm-up steps (a peak of 7e-4); on the seed's 32 and 4 it peaks at
# 0.088, far above what Adam trains this model with, and the loss stalls near 2.2. Scaled by 0.1
# it peaks at 0.0088 and the loss falls (the appendix trains both; tests/test_bug_hunt.py too).
NOAM_FACTOR = 0.1


def digit_pairs(n: int, seed: int = 0, min_len: int = 1, max_len: int = 6) -> list:
    """``n`` pairs ``(src, tgt)`` of the digits task at their own lengths, without padding:
    ``src`` is digits + EOS, ``tgt`` BOS + words + EOS (1-D int64 tensors on the CPU)."""
    strings = DigitsToWords(n, min_len, max_len, seed=seed).strings
    return [(encode_digits(s), encode_words(digits_to_words(s))) for s in strings]


# ----------------------------------------------------------------------------- the fixes
def make_transformer(
    d_model: int = D_MODEL, nhead: int = 2, layers: int = 1, ff: int = 64
) -> nn.Transformer:
    """The seed's ``nn.Transformer`` for ``(batch, seq, d_model)`` tensors (``batch_first``);
    no dropout, so that 2 ranks and one process can give the same weights."""
    return nn.Transformer(d_model, nhead, layers, layers, ff, dropout=0.0, batch_first=True)


class Seq2Seq(nn.Module):
    """The seed's model fixed: ``(batch, seq)`` ids in, ``(batch, seq, vocab)`` logits out;
    positions and the causal mask run along dim 1, and padded source positions are masked."""

    def __init__(self, d_model: int = D_MODEL, nhead: int = 2, layers: int = 1, ff: int = 64):
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(VOCAB_SIZE, d_model)
        self.transformer = make_transformer(d_model, nhead, layers, ff)
        self.out = nn.Linear(d_model, VOCAB_SIZE)
        pos = torch.arange(64).unsqueeze(1)  # the seed's sinusoids, along dim 1
        freq = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        self.register_buffer("pe", torch.zeros(1, 64, d_model))
        self.pe[0, :, 0::2], self.pe[0, :, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)

    def forward(
        self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed(src) * math.sqrt(self.d_model) + self.pe[:, : src.size(1)]
        y = self.embed(tgt) * math.sqrt(self.d_model) + self.pe[:, : tgt.size(1)]
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=src.device)
        out = self.transformer(
            x,
            y,
            tgt_mask=mask,
            tgt_is_causal=True,
            src_key_padding_mask=src_pad,
            memory_key_padding_mask=src_pad,
        )
        return self.out(out)


def pad_collate(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Variable-length ``(src, tgt)`` pairs to ``(src, tgt_in, tgt_out, src_pad)``: each padded
    with PAD at the end to the longest in the batch; ``src_pad`` is True at padded positions
    (what ``key_padding_mask`` expects); ``tgt_in``/``tgt_out`` are ``tgt`` without its last/first
    token, so ``tgt_out`` is PAD where the loss must ignore it."""
    src, tgt_in, tgt_out = collate_seq2seq(samples)  # chapter 1's, which pads
    return src, tgt_in, tgt_out, src == PAD


def token_loss(logits: torch.Tensor, tgt_out: torch.Tensor, tokens: float | None = None):
    """Cross-entropy summed over the non-PAD targets and divided by ``tokens`` (by default their
    number: the mean per real token). Under DDP pass the global count / world size, so that the
    averaged gradient is that of the mean over the global batch's tokens."""
    mean = sequence_cross_entropy(logits.float(), tgt_out)  # over the real tokens (chapter 1)
    return mean if tokens is None else mean * (tgt_out != PAD).sum() / tokens


def fixed_step(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler,
    scaler: torch.amp.GradScaler,
    max_norm: float,
    dtype: torch.dtype,
    tokens: float | None = None,
) -> float:
    """One step of the seed, fixed: autocast on the batch's device type (``torch.amp``), the
    loss over real tokens, scaled backward, ``unscale_`` *then* clip, ``scaler.step``,
    ``update``, ``scheduler.step``. ``batch`` is :func:`pad_collate`'s, on the model's device.
    Returns the loss (this process's part of it)."""
    src, tgt_in, tgt_out, src_pad = batch
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(src.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = token_loss(model(src, tgt_in, src_pad), tgt_out, tokens)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # the true gradients, so that max_norm means what it says
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    return loss.item()


def train_fixed(
    steps: int = 6,
    global_batch: int = 16,
    samples: int = 48,
    seed: int = 0,
    dtype: torch.dtype = torch.float16,
    lr_factor: float = NOAM_FACTOR,
) -> dict:
    """The seed script fixed, on every rank of a process group or in one process: each step's
    global batch is the same set of sequences on any number of ranks (the sampler's order,
    reshuffled every epoch by ``set_epoch``). ``lr_factor`` scales the Noam schedule (1 is the
    seed's scale). Returns the global mean loss per step, the lr per step and the final weights
    (CPU). ``samples // global_batch`` steps make one pass over the same ``samples`` pairs."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = runtime.device()
    torch.manual_seed(seed)
    model = Seq2Seq().to(device)
    if world > 1:
        ids = [device] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    pairs = digit_pairs(samples, seed)
    sampler = DistributedSampler(pairs, world, rank, shuffle=True, seed=seed)
    per_rank = global_batch // world
    loader = DataLoader(pairs, per_rank, sampler=sampler, collate_fn=pad_collate)
    params = model.parameters()
    optimizer = torch.optim.Adam(params, lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: noam_lr(s, D_MODEL, WARMUP, lr_factor)
    )
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    log = {"loss": [], "lr": []}
    for epoch in range(steps):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = [t.to(device) for t in batch]
            real = (batch[2] != PAD).sum().item()  # this rank's real tokens
            count = torch.tensor([real], device=device, dtype=torch.float64)
            if world > 1:  # every rank divides by the global number of tokens
                dist.all_reduce(count)
            log["lr"].append(optimizer.param_groups[0]["lr"])
            loss = fixed_step(
                model, batch, optimizer, scheduler, scaler, 1.0, dtype,
                tokens=count.item() / world,
            )
            total = count.new_tensor([loss / world])  # float64, on the device
            if world > 1:  # the loss of the global batch, not rank 0's part
                dist.all_reduce(total)
            log["loss"].append(total.item())
            if len(log["loss"]) == steps:
                inner = getattr(model, "module", model)
                weights = [p.detach().cpu() for p in inner.parameters()]
                return {**log, "weights": weights}
    raise ValueError(f"{steps} steps need more than {samples} samples")


# ---------------------------------------------------------------------------- the symptoms
def first_step(lr_lambda: Callable[[int], float]) -> dict[str, float | bool]:
    """One Adam step of a small layer under ``LambdaLR(optimizer, lr_lambda)`` with a base rate
    of 1: the rate the first step used, and whether that step moved the weights."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(layer.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    before = layer.weight.detach().clone()
    lr = optimizer.param_groups[0]["lr"]  # LambdaLR has already applied lr_lambda(0)
    layer(torch.ones(3, 4)).square().sum().backward()
    optimizer.step()
    scheduler.step()
    return {"lr": lr, "moved": not torch.equal(before, layer.weight)}


def batch_mixing(model: nn.Module, batch: int = 4, seed: int = 0) -> float:
    """How much example 0's output changes (largest absolute change of its logits) when only
    example 1's source is changed; 0 for a model that keeps the examples of a batch apart."""
    src, tgt_in, _, _ = pad_collate(digit_pairs(batch, seed, 6, 6))  # equal lengths: no padding
    other = src.clone()
    other[1, :-1] = (other[1, :-1] - 3 + 5) % 10 + 3  # other digits for example 1 only
    model.eval()
    with torch.no_grad():
        a, b = model(src, tgt_in), model(other, tgt_in)
    return (a[0] - b[0]).abs().max().item()


def padding_effects(seed: int = 0) -> dict[str, object]:
    """What goes wrong around padding: the error of the default collate on variable-length
    pairs; the share of the seed's target positions that are PAD; the seed's loss with the
    PAD targets counted and ignored; and how much one sequence's logits change when the batch
    is padded 4 positions wider, without and with the key padding mask (:class:`Seq2Seq`)."""
    pairs = digit_pairs(8, seed, 1, 6)
    try:
        default_collate(pairs)
        error = ""
    except RuntimeError as exc:
        error = str(exc)
    data = DigitsToWords(8, 1, 6, seed=seed)
    src, tgt = data.src, data.tgt
    torch.manual_seed(seed)
    model = Seq2Seq()  # no dropout; training mode avoids the nested-tensor fast path
    with torch.no_grad():
        logits = model(src, tgt[:, :-1])
        flat = logits.reshape(-1, VOCAB_SIZE), tgt[:, 1:].reshape(-1)
        counted = nn.functional.cross_entropy(*flat).item()
        ignored = nn.functional.cross_entropy(*flat, ignore_index=PAD).item()
        s, t_in, _, s_pad = pad_collate(pairs[:1])
        wide = nn.functional.pad(s, (0, 4), value=PAD)
        change = {}
        for masked in (False, True):
            narrow = model(s, t_in, s_pad if masked else None)
            padded = model(wide, t_in, wide == PAD if masked else None)
            change["masked" if masked else "unmasked"] = (narrow - padded).abs().max().item()
    return {
        "collate_error": error,
        "pad_share": (tgt[:, 1:] == PAD).float().mean().item(),
        "loss_counting_pad": counted,
        "loss_ignoring_pad": ignored,
        "change": change,
    }


def cuda_amp_effects() -> dict[str, object]:
    """The seed's ``torch.cuda.amp`` on this machine: the warnings it raises, whether its
    scaler is enabled, and the dtype of a matmul inside its autocast on ``runtime.device()``;
    beside them the dtype under ``torch.autocast`` of that device's type (float16)."""
    device = runtime.device()
    x = torch.ones(2, 2, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = torch.cuda.amp.GradScaler()
        with torch.cuda.amp.autocast():
            cuda_amp_dtype = (x @ x).dtype
    with torch.autocast(device.type, dtype=torch.float16):
        amp_dtype = (x @ x).dtype
    return {
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "scaler_enabled": scaler.is_enabled(),
        "cuda_amp_dtype": cuda_amp_dtype,
        "torch_amp_dtype": amp_dtype,
    }


def clipping_before_unscale(scale: float = 2.0**10, max_norm: float = 1.0) -> dict[str, float]:
    """The norm of the gradient that the optimizer gets, from a gradient scaled by ``scale``:
    clipped to ``max_norm`` before ``unscale_`` (the seed's order) and after it. The first is
    ``max_norm / scale``: the scaled gradient was clipped, then divided by the scale."""
    norms = {}
    for order in ("clip_then_unscale", "unscale_then_clip"):
        torch.manual_seed(0)
        layer = nn.Linear(8, 4).to(runtime.device())
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(runtime.device().type, init_scale=scale)
        scaler.scale(layer(torch.ones(16, 8, device=runtime.device())).sum() * 10).backward()
        if order == "clip_then_unscale":
            nn.utils.clip_grad_norm_(layer.parameters(), max_norm)
        scaler.unscale_(optimizer)
        if order == "unscale_then_clip":
            nn.utils.clip_grad_norm_(layer.parameters(), max_norm)
        norms[order] = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in layer.parameters()])
        ).item()
    return norms


def sampler_orders(
    set_epoch: bool, epochs: int = 3, size: int = 12, world: int = 2, rank: int = 0
) -> list[list[int]]:
    """The indices rank ``rank`` of ``world`` draws from a shuffling ``DistributedSampler`` in
    each epoch, with and without calling ``set_epoch(epoch)`` first (no process group needed)."""
    sampler = DistributedSampler(range(size), world, rank, shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders
