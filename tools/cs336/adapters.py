"""Stanford CS336's assignment 2 tests, run on this course's DDP, sharded optimizer and FSDP.

CS336 (assignment 2, "systems", release 26.1.1) tests a learner's implementations through the
functions of its ``tests/adapters.py``. This file is that module written with ``dpcourse``'s
public classes, one call each:

* ``get_ddp``: :class:`dpcourse.ddp.ddp.PerParameterDDP`, chapter 7's step 3 (one asynchronous
  all-reduce per parameter, launched from a hook while backward runs: CS336's "DDP overlapping
  individual parameters"); ``ddp_on_after_backward`` waits for them
  (``finish_gradient_synchronization``).
* ``get_sharded_optimizer``: :class:`dpcourse.sharding.zero.ShardedOptimizer` (ZeRO stage 1,
  chapter 9). Ours also averages the gradients (a reduce-scatter), so it takes DDP's place
  instead of sitting beside it; CS336's test gives every rank the same batch, where the average
  is the gradient itself.
* ``get_fsdp``: :class:`dpcourse.sharding.fsdp.FSDP` (chapter 9) sharding every submodule whose
  class is named ``Linear`` or ``Embedding`` and replicating the rest (the norms), as CS336's
  FSDP does; by name, so that cs336-basics', torch's and a learner's own assignment-1 classes
  count. ``fsdp_on_after_backward`` waits for the reduce-scatters;
  ``fsdp_gather_full_params`` is ``full_state_dict()`` (every parameter whole, and the buffers).
* FlashAttention's adapters are not this course's subject: they raise ``NotImplementedError``,
  as CS336 ships them.

To run CS336's tests on the course's classes: copy this file over ``tests/adapters.py`` of a
CS336 assignment-2 checkout, add ``dpcourse`` to its environment (``uv pip install -e
/path/to/this/repository``: its torch range, 2.11 to 2.13, keeps CS336's torch), and run their
pytest: ``uv run pytest tests/test_ddp.py tests/test_sharded_optimizer.py tests/test_fsdp.py``.

Observed on 2026-11-28, on the course's 2-core machine without a GPU (Python 3.11.7, torch
2.13.0+cpu, gloo; CS336's tests unchanged, cs336-basics on ``PYTHONPATH``): 7 of the 8 tests
pass, ``test_DistributedDataParallel`` and ``test_sharded_optimizer`` (both models),
``test_fsdp_gradient_sync`` (fp32, fp16) and ``test_fsdp_correctness[fp16]``.
``test_fsdp_correctness[fp32]`` fails: it asks the weights after a step on the mean of two
half-batches' gradients to equal, bit for bit, those after one step on the whole batch, and on
this CPU the two gradients are summed in different orders (after the first SGD step 119 weights
differ, by 1.5e-8 at most). The mean of the halves' gradients computed in one process with plain
torch fails it the same way, and so does torch's ``fully_shard`` (the same 119 weights); our
FSDP's weights equal that one-process mean's bit for bit. Not yet run on a GPU. CONTRIBUTING.md
("CS336's tests") has the details; ``tests/test_cs336_adapter.py`` keeps this file working
without CS336's code.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.ddp.ddp import PerParameterDDP
from dpcourse.sharding.fsdp import FSDP
from dpcourse.sharding.zero import ShardedOptimizer

SHARDED_LAYERS = ("Linear", "Embedding")  # class names: CS336's FSDP shards these, no others


def get_flashattention_autograd_function_pytorch() -> type:
    raise NotImplementedError


def get_flashattention_autograd_function_triton() -> type:
    raise NotImplementedError


def get_ddp(module: nn.Module) -> nn.Module:
    return PerParameterDDP(module)


def ddp_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_fsdp(module: nn.Module, compute_dtype: torch.dtype | None = None) -> nn.Module:
    layers = [name for name, m in module.named_modules() if type(m).__name__ in SHARDED_LAYERS]
    return FSDP(module, layers=layers, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.full_state_dict()


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer],
                          **kwargs) -> torch.optim.Optimizer:
    return ShardedOptimizer(params, optimizer_cls, **kwargs)
