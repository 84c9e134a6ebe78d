"""What every rank must agree on under FSDP, ours and ``fully_shard`` on the same input: an fp16
sum that would overflow, a ``GradScaler``'s decision, and the norm that clipping divides by.

Each function runs on every rank and returns this rank's view, ours and torch's side by side:

* :func:`fp16_reduction_on_rank`: a ``Linear(2, 2)`` whose row-0 gradient is the same on every
  rank, reduced in fp16 (``MixedPrecisionPolicy(param_dtype=torch.float16)``), optionally scaled
  by a ``GradScaler`` that then steps SGD once;
* :func:`clipping_on_rank`: one backward of a small MLP on every rank's batch, clipped by
  ``FSDP.clip_grad_norm_``, by torch's ``clip_grad_norm_`` on ``fully_shard``, and on one process
  over every rank's batch; and the norm each rank would take of its own shards, which is what
  torch's utility computes on plain tensors (our shards refuse it: the error is returned too).

Chapters 9 (clipping) and 11 (fp16 reductions) show them; ``tests/test_fsdp_torch_loops.py``
checks them on 2 and 3 ranks.

Chapter 11: what the ranks agree on, measured beside ``fully_shard``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from dpcourse import runtime
from dpcourse.harness.bench.fsdp import fully_shard_placement
from dpcourse.sharding.fsdp import FSDP

__all__ = ["fp16_reduction_on_rank", "clipping_on_rank"]


def _fully_shard(model: nn.Module, mesh, **options) -> nn.Module:
    """``fully_shard`` on each direct child with parameters, then on the root."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's warnings about views returned by a module
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
    return model


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a gradient, as a plain tensor: a DTensor's local piece, or ours."""
    return grad.to_local() if hasattr(grad, "to_local") else grad.as_subclass(torch.Tensor)


def _linear_2x2(device: torch.device) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(2, 2, bias=False)).to(device)
    nn.init.zeros_(net[0].weight)
    return net


def fp16_reduction_on_rank(row0: float = 40000.0, scale: float | None = None) -> dict:
    """Runs on every rank: the gradient of row 0 of a ``Linear(2, 2)`` (zero weights, one input
    of ones) is ``row0`` on every rank, computed and reduced in fp16. Returns ``{"ours": ...,
    "fully_shard": ...}``, each ``{"grad": this rank's rows of the averaged gradient}``; with a
    ``scale``, the loss is scaled by a ``GradScaler(init_scale=scale)`` that then steps SGD (lr
    0.1) and updates, and each also holds ``"scale"`` (after the update) and ``"weight"`` (whole).
    ``fully_shard`` runs where :func:`~dpcourse.harness.bench.fsdp.fully_shard_placement` says."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    device, mesh = fully_shard_placement()
    out = {}
    for impl in ("ours", "fully_shard"):
        if impl == "ours":
            net = FSDP(_linear_2x2(runtime.device()), mp_policy=policy)
        else:
            net = _fully_shard(_linear_2x2(device), mesh, mp_policy=policy)
        params = list(net.parameters())
        x = torch.ones(1, 2, device=params[0].device)
        loss = net(x).float()[:, 0].sum() * row0
        if scale is not None:
            opt = torch.optim.SGD(params, lr=0.1)
            scaler = torch.amp.GradScaler(params[0].device.type, init_scale=scale)
            loss = scaler.scale(loss)
        loss.backward()
        if impl == "ours":
            net.finish_gradient_synchronization()
        out[impl] = {"grad": _local(params[0].grad).float().cpu().tolist()}
        if scale is not None:
            scaler.step(opt)
            scaler.update()
            weight = (net.full_state_dict()["0.weight"] if impl == "ours"
                      else params[0].full_tensor())
            out[impl].update(scale=scaler.get_scale(), weight=weight.float().cpu().tolist())
        if impl == "ours":
            net.close()
    return out


def _mlp(device: torch.device | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).to(device or runtime.device())


def clipping_on_rank(max_norm: float = 0.1, norm_type: float = 2.0) -> dict:
    """Runs on every rank: one backward of a small MLP (layers of 16, 16 and 3 rows) on this
    rank's batch, then clipping at ``max_norm``. Returns the norm that clipping divided by
    (``"one process"``, on every rank's batch at once, what the average must equal; ``"ours"``,
    ``FSDP.clip_grad_norm_``; ``"fully_shard"``, torch's ``clip_grad_norm_`` on its DTensors),
    ``"own shards"``: the norm of this rank's own gradient shards alone, which
    ``torch.nn.utils.clip_grad_norm_`` would take on plain shards, and ``"torch on ours"``: the
    error it raises on our marked shards."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def data(r: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(r)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
        return x.to(device), y.to(device)

    def loss(model: nn.Module, r: int, device: torch.device) -> torch.Tensor:
        x, y = data(r, device)
        return nn.functional.mse_loss(model(x), y)

    def clipped(norm: torch.Tensor) -> float:
        return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()

    device = runtime.device()
    single = _mlp(device)
    torch.stack([loss(single, r, device) for r in range(world)]).mean().backward()
    out = {"one process": clipped(nn.utils.clip_grad_norm_(single.parameters(), max_norm,
                                                           norm_type))}
    ours = FSDP(_mlp(device))
    loss(ours, rank, device).backward()
    ours.finish_gradient_synchronization()
    own = [_local(p.grad).float() for p in ours.parameters() if p.grad is not None]
    out["own shards"] = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g, norm_type) for g in own]), norm_type).item()
    try:
        nn.utils.clip_grad_norm_(ours.parameters(), max_norm, norm_type)
        out["torch on ours"] = None
    except RuntimeError as exc:
        out["torch on ours"] = str(exc)
    out["ours"] = clipped(ours.clip_grad_norm_(max_norm, norm_type))
    ours.close()
    there, mesh = fully_shard_placement()
    theirs = _fully_shard(_mlp(there), mesh)
    loss(theirs, rank, there).backward()
    out["fully_shard"] = clipped(nn.utils.clip_grad_norm_(theirs.parameters(), max_norm,
                                                          norm_type))
    return out
