"""``fully_shard``'s options as layers on our FSDP's core: mixed precision, resharding after
forward, accumulation without synchronising, recomputation in backward (chapters 9 and 11).

:class:`~dpcourse.sharding.fsdp.FSDPCore` is chapter 9's four steps: gather, compute, free;
reduce-scatter per layer; prefetch. Each class here is a layer on it: it overrides one of the
core's steps (its hooks call them: ``_pre_forward``, ``_post_forward``, ``_pre_backward``,
``_reduce``, ``_reshard``, ``forward``) and calls the core's own with ``super()``;
:class:`~dpcourse.sharding.fsdp.FSDP` stacks them, and each takes its own keyword argument of
``FSDP(...)``. The sections that teach them show them:

* :class:`MixedPrecision` (``compute_dtype``, section 9.11; ``mp_policy``, section 11.2): the
  layers are gathered and compute in the policy's ``param_dtype``, on inputs cast to it; the
  gradients are reduced in ``reduce_dtype``; the model's outputs are cast to ``output_dtype``;
* :class:`ReshardAfterForward` (``reshard_after_forward``, section 11.3): False keeps each layer
  gathered from its forward to its backward;
* :class:`Accumulation` (``no_sync``, ``set_requires_gradient_sync``, section 11.4): backward
  keeps each layer's full gradients instead of reduce-scattering them;
* :class:`Recomputation` (section 11.5): a layer's forward run again in backward by activation
  checkpointing uses the parameters that backward gathers, instead of gathering and freeing them
  as a forward would.

They live in chapter 9's layer of the package because ``FSDP(...)``, chapter 9's class, takes
their arguments, as ``fully_shard`` does; chapter 11 teaches them.

Chapter 9: fully_shard's knobs on our FSDP, as layers on its core (chapter 11 teaches them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dpcourse.one_device.memory import tensors_in
from dpcourse.sharding.fsdp_layer import ShardedLayer

__all__ = ["COMPUTE_DTYPES", "MixedPrecision", "ReshardAfterForward", "Accumulation",
           "Recomputation", "precision", "cast_floats"]

COMPUTE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------ mixed precision
class MixedPrecision:
    """The layer of the dtypes: ``compute_dtype`` (chapter 9: the sharded layers are gathered and
    compute in it, the gradients are reduced in fp32) or ``mp_policy`` (chapter 11: torch's
    ``MixedPrecisionPolicy``, read as ``fully_shard`` reads it, :func:`precision`). The core
    gathers and reduces in the dtypes it is given; this layer casts what crosses into a layer
    (its inputs, to the gathered dtype), into the replicated parameters' modules (to fp32, the
    dtype they compute in) and out of the model (``output_dtype``)."""

    def __init__(self, module: nn.Module, *,
                 compute_dtype: torch.dtype | None = None,
                 mp_policy: Any = None, **options: Any) -> None:
        param, reduce, output, cast_inputs = precision(compute_dtype, mp_policy)
        super().__init__(module, param_dtype=param, reduce_dtype=reduce,
                         **options)
        self.compute_dtype = param  # chapter 9's name for it
        self.output_dtype, self.cast_forward_inputs = output, cast_inputs
        if param is None:
            return  # every layer computes in its parameters' dtype
        if cast_inputs:
            for layer in self.layers:  # after the core's hook: it is here
                layer.module.register_forward_pre_hook(_cast_args(param))
        replicated = {id(p) for p in self.replicated}
        for m in module.modules():  # the replicated parameters': in fp32
            if any(id(p) in replicated for p in m.parameters(recurse=False)):
                m.register_forward_pre_hook(_cast_args(torch.float32))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        if self.output_dtype is None:
            return out
        return cast_floats(out, self.output_dtype)


def precision(compute_dtype: torch.dtype | None, mp_policy: Any
              ) -> tuple[torch.dtype | None, torch.dtype, torch.dtype | None, bool]:
    """(gathered parameters' dtype, reduction dtype, output dtype, cast inputs) from chapter 9's
    ``compute_dtype`` (reduction in fp32) or a ``MixedPrecisionPolicy`` (read as
    ``fully_shard`` reads it: the reduction in ``param_dtype`` unless ``reduce_dtype`` says)."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype}")
    if mp_policy is None:
        return compute_dtype, torch.float32, None, True
    if compute_dtype is not None:
        raise ValueError("pass compute_dtype or mp_policy, not both: mp_policy.param_dtype is "
                         "the compute dtype")
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    missing = [f for f in fields if not hasattr(mp_policy, f)]
    if missing:
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (from "
                        f"torch.distributed.fsdp) or have its fields; missing {missing}")
    param, reduce = mp_policy.param_dtype, mp_policy.reduce_dtype
    for name, dtype in (("param_dtype", param), ("reduce_dtype", reduce)):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"mp_policy.{name} must be one of {COMPUTE_DTYPES}, got {dtype}")
    reduce = reduce or param or torch.float32
    return param, reduce, mp_policy.output_dtype, bool(mp_policy.cast_forward_inputs)


def cast_floats(out: Any, dtype: torch.dtype) -> Any:
    """``out`` with its floating-point tensors cast to ``dtype`` (tuples, lists, dicts kept)."""
    if isinstance(out, torch.Tensor):
        return out.to(dtype) if out.is_floating_point() else out
    if isinstance(out, (tuple, list)):
        return type(out)(cast_floats(o, dtype) for o in out)
    if isinstance(out, dict):
        return {k: cast_floats(v, dtype) for k, v in out.items()}
    return out


def _cast_args(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple) -> tuple:  # a forward pre-hook
        return tuple(cast_floats(a, dtype) if isinstance(a, torch.Tensor) else a for a in args)
    return hook


# ------------------------------------------------------------------ reshard after forward
class ReshardAfterForward:
    """The layer of ``reshard_after_forward``: False keeps a layer's gathered parameters from
    its forward until its gradients are reduced, so backward does not gather it again (one
    all-gather per layer and step instead of two, for the memory of every layer gathered at
    once: ZeRO-2's communication)."""

    def __init__(self, module: nn.Module, *, reshard_after_forward: bool = True,
                 **options: Any) -> None:
        super().__init__(module, **options)
        self.reshard_after_forward = reshard_after_forward

    def _reshard(self, layer: ShardedLayer) -> None:
        if self.reshard_after_forward:
            super()._reshard(layer)


# ------------------------------------------------------------------ accumulation, no sync
class Accumulation:
    """The layer of gradient accumulation without synchronising: while the gradients are not to
    be synchronised (:meth:`set_requires_gradient_sync`, :meth:`no_sync`), a layer whose
    backward is over keeps its full gradients, added up in the reduce dtype
    (:meth:`~dpcourse.sharding.fsdp_layer.ShardedLayer.accumulate`), instead of reduce-scattering
    them; the next backward that synchronises reduce-scatters the sum."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync = True  # reduce-scatter in this backward

    def _reduce(self, layer: ShardedLayer) -> None:
        if self._sync:
            super()._reduce(layer)
        else:  # accumulating: keep the full gradients, send nothing
            layer.accumulate()

    def finish_gradient_synchronization(self) -> None:
        sync, self._sync = self._sync, True  # what is left is reduced now, accumulated or not
        try:
            super().finish_gradient_synchronization()
        finally:
            self._sync = sync

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """Whether the backward passes that follow reduce-scatter the gradients (True, the
        default) or keep each layer's full gradients on this rank, added up over the
        micro-batches, in the reduce dtype (False): no communication, the memory of unsharded
        gradients. The backward after turning it on again reduces the sum. As ``fully_shard``'s
        method of the same name."""
        if not isinstance(requires, bool):
            raise TypeError(f"requires must be True or False, got {requires!r}")
        self._sync = requires

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, backward accumulates full gradients without synchronising them
        (as DDP's ``no_sync``): run the last micro-batch outside it."""
        before = self._sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)


# ------------------------------------------------------------------------- recomputation
class Recomputation:
    """The layer for activation checkpointing: a layer's forward that runs while backward is
    under way (:meth:`in_backward`) is a recomputation. It uses the parameters that backward
    gathers (or gathers them for backward), does not record the order, prefetch nor free, and
    registers no backward hook; and backward puts the gathered parameters in the module too,
    since a recomputation inside a sharded unit runs its inner modules, which read them there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward = False  # this forward's backward has begun

    def in_backward(self) -> bool:
        """Whether the backward of the last forward has begun (the gradient of the wrapped
        model's output has arrived) and not yet been synchronised. A layer's forward that runs
        then is a recomputation (activation checkpointing)."""
        return self._backward

    def _pre_forward(self, layer: ShardedLayer, args: tuple) -> tuple:
        if not self.in_backward():
            return super()._pre_forward(layer, args)
        self._unshard(layer)  # it finds the layer gathered for its backward
        layer.use_full(True)
        return args

    def _post_forward(self, layer: ShardedLayer, output: Any) -> None:
        if not self.in_backward():
            return super()._post_forward(layer, output)
        layer.use_full(False)  # not freed: backward uses these parameters next

    def _pre_backward(self, layer: ShardedLayer) -> None:
        super()._pre_backward(layer)
        if not layer.reduced:  # in the module: a recomputation inside reads it
            layer.use_full(True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._backward = False
        out = super().forward(*args, **kwargs)
        for t in tensors_in(out):  # backward starts here: the first gradient is the output's
            if t.requires_grad:
                t.register_hook(self._backward_begins)
        return out

    def _backward_begins(self, grad: torch.Tensor) -> None:
        self._backward = True

    def finish_gradient_synchronization(self) -> None:
        self._backward = False
        super().finish_gradient_synchronization()
