"""What FSDP's knobs cost, counted: the bytes a rank sends per step and what it holds.

``fully_shard``'s choices, priced per rank for a model of ``num_params`` parameters sharded over
N ranks, every collective a ring (a phase sends (N-1)/N of its data per rank):

* **mixed precision** (:func:`policy_dtypes`, :func:`step_bytes`): the all-gathers carry
  ``param_dtype``, the reduce-scatter ``reduce_dtype``, which ``fully_shard`` takes to be
  ``param_dtype`` when it is not given;
* **reshard_after_forward** (:func:`gathered_after_forward`): two all-gathers per layer and
  step, or one and every layer's parameters held from forward to backward;
* **gradient accumulation** (:func:`accumulation_cost`): a reduce-scatter per micro-batch, or the
  full gradients kept (in ``reduce_dtype``) until the last one.

``tests/test_fsdp_knobs.py`` and the chapter's measurement
(:mod:`dpcourse.harness.bench.fsdp_knobs`) check them against the bytes counted and the memory
measured, ours and ``fully_shard``'s.

Chapter 11: what FSDP's knobs cost, counted.
"""

from __future__ import annotations

import torch

__all__ = ["policy_dtypes", "dtype_bytes", "step_bytes", "gathered_after_forward",
           "accumulation_cost"]


def policy_dtypes(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                  stored: torch.dtype = torch.float32) -> tuple[torch.dtype, torch.dtype]:
    """(the all-gathers' dtype, the reduction's dtype) of a ``MixedPrecisionPolicy`` on
    parameters stored in ``stored``: ``param_dtype or stored``, and ``reduce_dtype``, else
    ``param_dtype``, else ``stored`` (``fully_shard``'s rule)."""
    gathered = param_dtype or stored
    return gathered, reduce_dtype or gathered


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes of one value of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def _check(num_params: float, world_size: int) -> None:
    if num_params < 0:
        raise ValueError(f"num_params must be >= 0, got {num_params}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def step_bytes(num_params: float, world_size: int, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
               stored: torch.dtype = torch.float32) -> float:
    """Bytes one rank sends in one FSDP step (rings): ``2`` all-gathers of the parameters in the
    gathered dtype (1 with ``reshard_after_forward=False``) and a reduce-scatter of the
    gradients in the reduction dtype, each (N-1)/N of the model. Chapter 11 (exercise
    ex-11-fsdp-bytes)."""
    _check(num_params, world_size)
    gathered, reduced = policy_dtypes(param_dtype, reduce_dtype, stored)
    gathers = 2 if reshard_after_forward else 1
    per_value = gathers * dtype_bytes(gathered) + dtype_bytes(reduced)
    return (world_size - 1) / world_size * num_params * per_value


def gathered_after_forward(layer_params: list[float], world_size: int,
                           param_dtype: torch.dtype | None = None,
                           reshard_after_forward: bool = True,
                           stored: torch.dtype = torch.float32) -> float:
    """Bytes of gathered parameters a rank holds between forward and backward: none when each
    layer is resharded after its forward; every layer's (``layer_params``: parameters per layer)
    in the gathered dtype otherwise. (While a layer runs, it and the one prefetched are held
    either way.)"""
    _check(sum(layer_params), world_size)
    if reshard_after_forward:
        return 0.0
    return float(sum(layer_params)) * dtype_bytes(param_dtype or stored)


def accumulation_cost(num_params: float, world_size: int, micro_batches: int, sync_each: bool,
                      reduce_dtype: torch.dtype = torch.float32,
                      stored: torch.dtype = torch.float32) -> tuple[float, float]:
    """(bytes a rank sends in reduce-scatters per optimizer step, bytes of gradients it holds
    between micro-batches) for ``micro_batches`` micro-batches. ``sync_each``: a reduce-scatter
    per micro-batch, each added into the shard's gradient (held: the shard, 1/N of the model in
    the stored dtype); otherwise the full gradients are added up in ``reduce_dtype`` (held:
    the whole model's) and reduce-scattered once. The all-gathers are the same either way, two
    per micro-batch. Chapter 11 (exercise ex-11-accumulate)."""
    _check(num_params, world_size)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
    one = (world_size - 1) / world_size * num_params * dtype_bytes(reduce_dtype)
    if sync_each:
        return micro_batches * one, num_params / world_size * dtype_bytes(stored)
    return one, float(num_params) * dtype_bytes(reduce_dtype)
