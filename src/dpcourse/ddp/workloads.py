"""The two models chapter 7 times DDP on, with a batch per rank (chapter 7).

``"mlp"``: four 1024 x 1024 linear layers with ReLUs between (4.2 million parameters, 16 MiB of
fp32 gradients), on random regression data; ``"transformer"``: chapter 1's ``TinyTransformer``
on the digits-to-words data. The benchmarks (``python -m dpcourse.harness.bench ddp``) and the
diagnosis lab use the same ones.

Chapter 7: DDP from scratch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dpcourse import runtime
from dpcourse.one_device import data, models

__all__ = ["model_and_batch"]


def model_and_batch(name: str, batch: int, rank: int
                    ) -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable]:
    """``(model, inputs, loss_fn)`` on this rank's device (:func:`dpcourse.runtime.device`):
    the model the same on every rank (seeded), ``batch`` samples that differ between ranks
    (seeded by ``rank``); the loss is ``loss_fn(model(*inputs[:-1]), inputs[-1])``."""
    device = runtime.device()
    g = torch.Generator().manual_seed(rank)
    if name == "mlp":
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(4):
            layers += [nn.Linear(1024, 1024), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        inputs = (torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g))
        loss_fn = nn.functional.mse_loss
    elif name == "transformer":
        torch.manual_seed(0)
        model = models.TinyTransformer()
        inputs = data.digits_batch(batch, seed=rank)
        loss_fn = models.sequence_cross_entropy
    else:
        raise ValueError(f"unknown model {name!r}: use 'mlp' or 'transformer'")
    return model.to(device), tuple(t.to(device) for t in inputs), loss_fn
