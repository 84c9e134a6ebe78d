"""Measuring the memory of a real training step: chapter 1 checks its estimates against this.

:func:`measure_training_memory` runs one step and counts what it holds: the parameters, the
gradients, the optimizer's state (:func:`optimizer_state_bytes`) and the activations that the
forward pass saves for the backward pass, caught with ``saved_tensors_hooks``.
:func:`saved_activations_by_op` says which operations saved them. The formulas they are
compared with are in :mod:`dpcourse.one_device.memory`.

Chapter 1: where the memory of training goes, measured.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dpcourse.one_device.memory import MemoryBreakdown, tensors_in, unique_parameters
from dpcourse.runtime import synchronize

__all__ = ["optimizer_state_bytes", "measure_training_memory", "saved_activations_by_op"]


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (a torch optimizer, or anything with such a
    ``state``, like chapter 9's ShardedOptimizer): what is kept for the optimizer, measured."""
    return sum(t.nbytes for state in optimizer.state.values() for t in tensors_in(state))


def measure_training_memory(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> MemoryBreakdown:
    """Measure the memory of one real training step on ``batch`` ``(inputs..., target)``.

    * parameters and gradients: the bytes of the tensors themselves after ``backward``;
    * optimizer state: the bytes of every tensor in ``optimizer.state`` after one ``step``;
    * activations: every tensor that autograd saves for the backward pass, caught with
      ``torch.autograd.graph.saved_tensors_hooks``, counted once per storage (many saved tensors
      are views of the same memory) and leaving out the parameters, which are saved too but
      counted above;
    * on CUDA, ``peak_allocated``: ``torch.cuda.max_memory_allocated`` during the step, above
      what was allocated before it.

    The batch must be on the model's device; the model runs in whatever mode it is in (training
    mode is what training uses). The model's weights and the optimizer's state are restored
    afterwards, and the gradients set to ``None``, so measuring does not train.
    """
    params = unique_parameters(model)
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved_model = copy.deepcopy(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    device = params[0].device
    on_cuda = device.type == "cuda"
    if on_cuda:
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs:
            saved[ptr] = max(saved.get(ptr, 0), storage.nbytes())
        return t

    *inputs, target = batch
    optimizer.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(*inputs), target)
    loss.backward()
    optimizer.step()
    if on_cuda:
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline
    grad_bytes = sum(p.grad.nbytes for p in params if p.grad is not None)
    state_bytes = optimizer_state_bytes(optimizer)

    optimizer.zero_grad(set_to_none=True)
    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    return MemoryBreakdown(
        parameters=sum(p.nbytes for p in params),
        gradients=grad_bytes,
        optimizer_state=state_bytes,
        activations=sum(saved.values()),
        peak_allocated=peak if on_cuda else None,
        note=f"measured ({type(optimizer).__name__}, one step on {device})",
    )


def saved_activations_by_op(loss: torch.Tensor, model: nn.Module | None = None) -> dict[str, int]:
    """Bytes that autograd keeps for the backward pass of ``loss``, by the operation keeping them.

    Walks the graph back from ``loss.grad_fn`` (call it before ``backward``, which frees the saved
    tensors) and reads each node's saved tensors (its ``_saved_*`` attributes). Each block of
    memory counts once, under the first operation found that keeps it; the parameters of
    ``model`` are left out. Keys are operation names such as ``"Addmm"`` (a Linear layer),
    ``"NativeLayerNorm"`` or ``"ScaledDotProductFlashAttentionForCpu"``, largest first. The total
    equals the ``activations`` of :func:`measure_training_memory`. Chapter 1 uses it to show what a
    Transformer keeps that the rule of thumb does not count.
    """
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
    by_op: dict[str, int] = {}
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        op = type(node).__name__.removesuffix("Backward0").removesuffix("Backward1")
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except RuntimeError:  # already freed, or not a tensor PyTorch can hand back
                continue
            for t in tensors_in(value):
                storage = t.untyped_storage()
                if storage.data_ptr() in skip:
                    continue
                skip.add(storage.data_ptr())
                by_op[op] = by_op.get(op, 0) + storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))
