"""What FSDP2 (ZeRO stage 3, ``torch.distributed.fsdp.fully_shard``) communicates, and when.

:func:`record_collectives` logs the collectives Python code calls through ``torch.distributed``;
:func:`fsdp_step_events` wraps a model's layers with ``fully_shard``, runs one forward and
backward and returns the collectives between markers of each layer's forward and backward.
Chapter 9's preview of stage 3 uses them; ``tests/test_zero.py`` checks them.

Chapter 9: measuring what FSDP gathers when.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["record_collectives", "fsdp_step_events"]

_COLLECTIVES = {  # torch.distributed function -> (what it is, which argument has the full size)
    "all_gather_single": ("all-gather", "output"),
    "all_gather_into_tensor": ("all-gather", "output"),
    "reduce_scatter_single": ("reduce-scatter", "input"),
    "reduce_scatter_tensor": ("reduce-scatter", "input"),
    "all_reduce": ("all-reduce", "tensor"),
}


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, str, int]]]:
    """Log the collectives that Python code calls through ``torch.distributed`` in the block.

    Yields a list that fills with ``("collective", kind, bytes)``, where bytes is the size of the
    whole tensor (the gathered output, the input that is reduce-scattered); code may append its
    own markers. It sees calls made from Python, as FSDP2's are, not those made from C++ (DDP's
    reducer). Chapter 9 uses it to show what FSDP gathers when.
    """
    import torch.distributed as dist

    log: list[tuple[str, str, int]] = []
    originals = {}

    def wrap(name: str, kind: str, arg: str, original):
        position = 0 if arg in ("output", "tensor") else 1

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            t = kwargs.get(arg, args[position] if len(args) > position else None)
            if isinstance(t, torch.Tensor):
                log.append(("collective", kind, t.numel() * t.element_size()))
            return original(*args, **kwargs)

        return recorded

    for name, (kind, arg) in _COLLECTIVES.items():
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, kind, arg, originals[name]))
    try:
        yield log
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def fsdp_step_events(
    model: nn.Module,
    layers: list[str],
    inputs: tuple,
    loss_fn: Callable,
    target: torch.Tensor,
    reshard_root: bool = True,
) -> tuple[list[tuple[str, str, int]], int]:
    """Runs on every rank: wrap ``model`` with FSDP2 (``fully_shard`` on each submodule named in
    ``layers``, then on the model, whose group holds the remaining parameters), run one forward
    and backward, and return what happened in order, ``("forward"|"backward", layer, 0)``
    markers between ``("collective", kind, bytes)`` entries, with this rank's number of
    parameter elements after sharding. ``reshard_root``: free the root's gathered parameters
    after forward too (pure ZeRO-3; FSDP's default keeps them for backward)."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    modules = dict(model.named_modules())
    with record_collectives() as log, warnings.catch_warnings():
        # FSDP2 warns that a layer returned a view (an in-place op on it would skip its
        # pre-backward hook); nothing here modifies outputs in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")

        def mark_backward(module, args, output, name) -> None:
            # the gradient of the layer's output arrives just before the layer's backward
            output.register_hook(lambda grad: log.append(("backward", name, 0)))

        for name in layers:
            module = modules[name]
            module.register_forward_pre_hook(
                lambda m, args, name=name: log.append(("forward", name, 0))
            )
            module.register_forward_hook(functools.partial(mark_backward, name=name))
            fully_shard(module)
        fully_shard(model, reshard_after_forward=reshard_root)
        local = sum(p.to_local().numel() for p in model.parameters())
        loss_fn(model(*inputs), target).backward()
    return log, local
