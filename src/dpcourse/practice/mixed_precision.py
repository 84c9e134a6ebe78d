"""Mixed precision and gradient clipping in data-parallel training (chapter 8).

A mixed-precision step computes the forward and backward passes in a 16-bit type under
``torch.autocast`` and keeps the weights and the optimizer in float32 (Micikevicius et al., 2018).
float16 has a narrow range: values below 2**-24 (about 6e-8) become 0, and many gradients are
that small. A **gradient scaler** multiplies the loss by S (2**16 to start with) so that the
gradients are S times larger during backward, then divides them by S before the optimizer step;
if a scaled gradient overflowed (inf or NaN), it skips the step and halves S. bfloat16 has
float32's range, so it needs no scaler (it has fewer mantissa bits instead).

The order of one data-parallel step with a scaler::
    with torch.autocast(device_type, dtype):      # forward in 16 bits
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()                 # gradients of S * loss
    all-reduce (average) the gradients            # still scaled: DDP does it during backward
    scaler.unscale_(optimizer)                    # once, on the averaged gradients
    clip_grad_norm_(model.parameters(), max_norm) # on the true, synchronised gradients
    scaler.step(optimizer); scaler.update()       # skipped on every rank if any had an inf

Why this order: the all-reduce is linear, so scaling commutes with it, but unscaling is also where
the scaler looks for infs; after the all-reduce an inf on one rank is an inf on every rank, and
every rank skips the step together (:func:`inf_on_one_rank`). Clipping needs the norm of the
gradient of the *global* batch: clipping each rank's gradient before the all-reduce gives a
different update from single-device training (:func:`clipping_order_on_rank`). The gradients
are averaged with chapter 7's :func:`dpcourse.ddp.ddp.all_reduce_gradients`.

Chapter 8: mixed precision and gradient clipping in data-parallel training.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.ddp.ddp import all_reduce_gradients
from dpcourse.runtime import device
from dpcourse.runtime import device as current_device

__all__ = [
    "FP16_SMALLEST_SUBNORMAL",
    "underflow_fraction",
    "autocast_gradient_zeros",
    "amp_dp_step",
    "clipping_order_on_rank",
    "inf_on_one_rank",
    "AmpChoice",
    "choose_amp",
]

FP16_SMALLEST_SUBNORMAL = 2.0**-24  # 5.96e-8: anything smaller rounds to 0 in float16


def underflow_fraction(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """The fraction of the non-zero ``values`` that become exactly 0 when ``values * scale`` is
    cast to ``dtype`` (float16 or bfloat16). Chapter 8 plots it for a range of magnitudes."""
    nonzero = values[values != 0]
    if nonzero.numel() == 0:
        raise ValueError("values has no non-zero element")
    cast = (nonzero.double() * scale).to(dtype)
    return (cast == 0).double().mean().item()


class AmpChoice(NamedTuple):
    """The 16-bit type :func:`choose_amp` picks, whether it needs a loss scaler, and why."""

    dtype: torch.dtype
    loss_scaling: bool
    reason: str


_BF16_CAPABILITY = (8, 0)  # Ampere (A100) on: tensor cores for bfloat16 as well as float16


def choose_amp(device: torch.device | str | None = None) -> AmpChoice:
    """The autocast dtype for ``device`` (default: this rank's, ``runtime.device()``).

    bfloat16, with no scaler, on a GPU of compute capability 8.0 or more (A100, H100...) and on
    the CPU (autocast's default there; CPUs have little float16 arithmetic); float16 with a loss
    scaler on older GPUs (V100 7.0, Kaggle's and Colab's T4 7.5), whose tensor cores have no
    bfloat16. Chapter 8 prints it for its machine; the trainer's ``--amp auto`` uses it.
    """
    if device is None:
        device = current_device()
    device = torch.device(device)
    if device.type != "cuda":
        return AmpChoice(torch.bfloat16, False, f"{device.type}: autocast's default, bfloat16")
    capability = torch.cuda.get_device_capability(device)
    name = f"compute capability {capability[0]}.{capability[1]}"
    if tuple(capability) >= _BF16_CAPABILITY:
        return AmpChoice(torch.bfloat16, False, f"{name}: bfloat16 tensor cores, no scaler")
    return AmpChoice(torch.float16, True,
                     f"{name}: no bfloat16 tensor cores, so float16 with loss scaling")


def autocast_gradient_zeros(
    dtype: torch.dtype = torch.float16,
    scaler: bool = False,
    loss_factor: float = 1e-6,
    seed: int = 0,
) -> float:
    """Fraction of the first layer's weight gradients that are exactly 0 after a backward pass of
    chapter 1's MLP under ``torch.autocast(device, dtype)``, with or without a
    ``torch.amp.GradScaler`` (``scaler=True``), on this process's device.

    The loss is multiplied by ``loss_factor`` (1e-6) to put the gradients where many of a real
    network's are: Micikevicius et al. (2018, figure 3) found most activation gradients of an SSD
    detector below float16's range. The weights stay float32; only the computation is 16-bit.
    """

    dev = current_device()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).to(dev)
    x = torch.randn(256, 64, device=dev)
    y = torch.randn(256, 1, device=dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    grad_scaler = torch.amp.GradScaler(dev.type, enabled=scaler)
    with torch.autocast(dev.type, dtype=dtype):
        loss = loss_factor * nn.functional.mse_loss(model(x), y)
    grad_scaler.scale(loss).backward()
    grad_scaler.unscale_(optimizer)  # back to the true gradients, in float32
    grad = model[0].weight.grad
    return (grad == 0).double().mean().item()


def amp_dp_step(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    max_norm: float,
    dtype: torch.dtype = torch.float16,
) -> float:
    """One data-parallel mixed-precision step in the right order (the module docstring says
    why): autocast forward, scaled backward, chapter 7's
    :func:`~dpcourse.ddp.ddp.all_reduce_gradients`, unscale, clip to
    ``max_norm``, ``scaler.step``, ``scaler.update``. MSE loss; returns this rank's loss.
    Run it on every rank with the rank's own ``x, y``; chapter 8's exercise asks for it."""
    with torch.autocast(x.device.type, dtype=dtype):
        loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    all_reduce_gradients(model)
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def _clipping_problem(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 2))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(32, 5, generator=g)
    # ranks get very different data, so their local gradients differ a lot
    y = torch.randn(32, 2, generator=g) + torch.arange(32).unsqueeze(1) / 4
    dev = device()  # the rank's device: NCCL all-reduces only CUDA tensors
    return model.to(dev), x.to(dev), y.to(dev)


def clipping_order_on_rank(max_norm: float = 0.5) -> dict[str, list[torch.Tensor]]:
    """Runs on every rank: the gradients of one step, clipped to ``max_norm`` three ways.

    ``"single"``: one device on the whole batch, clipped; ``"reduce_then_clip"``: each rank
    computes its shard's gradient, all-reduce (average), then clip; ``"clip_then_reduce"``: clip
    each rank's gradient, then all-reduce. The first two agree; the third does not (chapter 8).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y = _clipping_problem()
    grads = lambda: [p.grad.clone() for p in model.parameters()]  # noqa: E731

    def backward(xs, ys):
        model.zero_grad()
        nn.functional.mse_loss(model(xs), ys).backward()

    backward(x, y)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    single = grads()
    mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)

    backward(x[mine], y[mine])
    all_reduce_gradients(model)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    right = grads()

    backward(x[mine], y[mine])
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    all_reduce_gradients(model)
    wrong = grads()
    cpu = lambda ts: [t.cpu() for t in ts]  # noqa: E731
    return {"single": cpu(single), "reduce_then_clip": cpu(right), "clip_then_reduce": cpu(wrong)}


def inf_on_one_rank(order: str) -> dict[str, object]:
    """Runs on every rank: one step with a float16 loss scaler where only rank 1's gradient has
    an inf (a scaled gradient that overflowed on its data). ``order`` is ``"reduce_then_unscale"``
    (right) or ``"unscale_then_reduce"`` (wrong: each rank's scaler checks for infs before the
    all-reduce has spread rank 1's inf to the others).

    Returns whether this rank stepped, its weight after the step, and the scale afterwards. With
    the right order every rank skips the step; with the wrong one rank 0 steps on inf gradients
    and the replicas no longer agree.
    """
    if order not in ("reduce_then_unscale", "unscale_then_reduce"):
        raise ValueError(
            f"order must be 'reduce_then_unscale' or 'unscale_then_reduce', not {order!r}"
        )

    rank, dev = dist.get_rank(), device()
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**16)
    loss = model(torch.ones(2, 4, device=dev)).sum()
    scaler.scale(loss).backward()
    if rank == 1:
        model.weight.grad[0, 0] = float("inf")  # this rank's scaled gradient overflowed
    before = model.weight.detach().clone()
    if order == "reduce_then_unscale":
        all_reduce_gradients(model)
        scaler.unscale_(optimizer)
    else:
        scaler.unscale_(optimizer)
        all_reduce_gradients(model)
    scaler.step(optimizer)
    scaler.update()
    return {
        "stepped": not torch.equal(before, model.weight.detach()),
        "weight": model.weight.detach().cpu(),
        "scale": scaler.get_scale(),
    }
