"""Where the memory of training goes: parameters, gradients, optimizer state and activations.

Chapter 1 estimates each part from formulas, measures it for real, and answers "will my model fit
on my GPU?"; chapter 9 uses :func:`zero_memory_per_rank` to show what sharding the optimizer
state, the gradients and the parameters (ZeRO stages 1-3) saves on each rank, and
:func:`memory_per_rank` / :func:`will_it_fit_sharded` to answer "will it fit?" for any dtype mix
(:data:`PRECISIONS`) and stage.

The bookkeeping, per parameter of ``b`` bytes (4 in fp32):

* parameters: ``b``; gradients: ``b`` (one per parameter, same dtype);
* optimizer state: plain SGD keeps nothing, SGD with momentum one buffer (``b``), Adam two
  (``2b``: the running mean and the running mean of squares) plus one scalar step counter per
  parameter tensor;
* activations: whatever the forward pass keeps for the backward pass; it grows with the batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "OPTIMIZER_STATES",
    "ADAM_STEP_BYTES",
    "count_parameters",
    "MemoryBreakdown",
    "format_bytes",
    "format_table",
    "estimate_training_memory",
    "measure_training_memory",
    "saved_activations_by_op",
    "will_it_fit",
    "max_batch_size",
    "zero_memory_per_rank",
    "Precision",
    "PRECISIONS",
    "memory_per_rank",
    "zero_table",
    "will_it_fit_sharded",
    "min_world_size",
    "format_paper_gb",
]

# Tensors of optimizer state kept per parameter, by optimizer name.
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
# torch's Adam keeps a float32 scalar ``step`` per parameter tensor (not per element).
ADAM_STEP_BYTES = 4

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_PARTS = ("parameters", "gradients", "optimizer_state", "activations")


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements of ``model`` (a parameter shared by two layers counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _auto_unit(num_bytes: float) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if abs(num_bytes) >= _UNITS[unit]:
            return unit
    return "B"


def format_bytes(num_bytes: float, unit: str = "auto") -> str:
    """``1536`` -> ``"1.50 KiB"``; ``unit`` is one of B, KiB, MiB, GiB, TiB or "auto"."""
    unit = _auto_unit(num_bytes) if unit == "auto" else unit
    if unit == "B":
        return f"{int(num_bytes):,} B"
    return f"{num_bytes / _UNITS[unit]:,.2f} {unit}"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of training memory by part. ``total`` is their sum.

    ``peak_allocated`` is what ``torch.cuda.max_memory_allocated`` saw during a measured step (CUDA
    only, else ``None``); it also counts temporaries that are freed within the step. ``note`` says
    how the numbers were obtained, or answers :func:`will_it_fit`.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    peak_allocated: int | None = None
    note: str = ""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations

    def as_dict(self) -> dict[str, int]:
        """The four parts and the total, in bytes."""
        return {**{p: getattr(self, p) for p in _PARTS}, "total": self.total}

    def table(self, unit: str = "auto") -> str:
        """A small text table; ``unit`` "auto" picks one unit from the total."""
        unit = _auto_unit(self.total) if unit == "auto" else unit
        rows = [(k.replace("_", " "), format_bytes(v, unit)) for k, v in self.as_dict().items()]
        if self.peak_allocated is not None:
            rows.append(("peak allocated (CUDA)", format_bytes(self.peak_allocated, unit)))
        width = max(len(r[1]) for r in rows)
        lines = [f"{name:<22}{value:>{width}}" for name, value in rows]
        return "\n".join(([self.note] if self.note else []) + lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        # IPython shows the table, not the dataclass fields, when a cell ends with a breakdown.
        printer.text(self.table())


def format_table(breakdowns: dict[str, MemoryBreakdown], unit: str = "auto") -> str:
    """Several breakdowns side by side, one column each (the column names are the keys)."""
    if unit == "auto":
        unit = _auto_unit(max(b.total for b in breakdowns.values()))
    columns = [
        [name] + [format_bytes(v, unit) for v in b.as_dict().values()]
        for name, b in breakdowns.items()
    ]
    labels = [""] + [p.replace("_", " ") for p in (*_PARTS, "total")]
    widths = [max(len(c) for c in column) for column in columns]
    return "\n".join(
        f"{label:<17}" + "  ".join(f"{col[i]:>{w}}" for col, w in zip(columns, widths, strict=True))
        for i, label in enumerate(labels)
    )


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())  # nn.Module.parameters() already skips duplicates


def _optimizer_name(optimizer: str | torch.optim.Optimizer) -> str:
    if isinstance(optimizer, str):
        name = optimizer.lower()
    elif isinstance(optimizer, torch.optim.SGD):
        name = "sgd_momentum" if optimizer.defaults.get("momentum", 0) else "sgd"
    else:
        name = type(optimizer).__name__.lower()
    if name not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    return name


# ---------------------------------------------------------------------------------- estimate
def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def estimate_training_memory(
    model: nn.Module,
    sample_input: torch.Tensor | Sequence[torch.Tensor],
    optimizer: str | torch.optim.Optimizer = "adam",
    dtype_bytes: int | None = None,
) -> MemoryBreakdown:
    """Estimate training memory from formulas and one forward pass without gradients.

    Parameters, gradients and optimizer state follow the formulas in this module's docstring.
    Activations follow a rule of thumb: **every module that owns parameters keeps its inputs for
    the backward pass** (it needs them for the gradient of its weights), **and the loss keeps the
    model's output**. Parameter-free functions (ReLU, softmax, attention scores, ...) are not
    counted: in an MLP what they keep is the next layer's input, counted already; in a Transformer
    it is not, so there the rule undercounts (chapter 1 shows by how much).

    ``sample_input`` is one batch of inputs (a tensor or a tuple of them, passed as
    ``model(*inputs)``) on the model's device. Put the model and the input on the ``meta`` device
    to estimate a model too large to allocate. ``dtype_bytes`` (e.g. 2 for fp16) prices every
    floating-point element at that many bytes instead of its actual size.
    """
    name = _optimizer_name(optimizer)
    params = _unique_parameters(model)

    def nbytes(t: torch.Tensor) -> int:
        if dtype_bytes is not None and t.is_floating_point():
            return t.numel() * dtype_bytes
        return t.numel() * t.element_size()

    param_bytes = sum(nbytes(p) for p in params)
    # Frozen parameters get neither gradients nor optimizer state.
    trainable = [p for p in params if p.requires_grad]
    grad_bytes = sum(nbytes(p) for p in trainable)
    state_bytes = OPTIMIZER_STATES[name] * grad_bytes
    if name in ("adam", "adamw"):
        state_bytes += ADAM_STEP_BYTES * len(trainable)

    # Keep references to every counted tensor: ids of freed tensors can be reused.
    counted: dict[int, torch.Tensor] = {}

    def keep_inputs(module: nn.Module, args: tuple, output) -> None:
        if next(module.parameters(recurse=False), None) is not None:
            for t in _tensors(args):
                counted.setdefault(id(t), t)

    hooks = [m.register_forward_hook(keep_inputs) for m in model.modules()]
    inputs = (sample_input,) if isinstance(sample_input, torch.Tensor) else tuple(sample_input)
    was_training = model.training
    # Training mode, as in training: in eval mode without gradients some layers (e.g.
    # nn.TransformerEncoderLayer) may take a fused fast path that never calls their submodules,
    # whose hooks would then see nothing.
    model.train()
    try:
        with torch.no_grad():
            output = model(*inputs)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    for t in _tensors(output):
        counted.setdefault(id(t), t)
    activation_bytes = sum(nbytes(t) for t in counted.values())
    return MemoryBreakdown(
        parameters=param_bytes,
        gradients=grad_bytes,
        optimizer_state=state_bytes,
        activations=activation_bytes,
        note=f"estimated ({name}; activations: inputs of layers with weights + output)",
    )


def max_batch_size(
    model: nn.Module,
    sample: torch.Tensor | Sequence[torch.Tensor],
    gpu_memory_bytes: int,
    optimizer: str | torch.optim.Optimizer = "adam",
) -> int:
    """The largest batch whose *estimated* training memory fits in ``gpu_memory_bytes``.

    ``sample`` is a batch of one (batch dimension 1). Parameters, gradients and optimizer state
    do not depend on the batch and the estimated activations grow in proportion to it, so one
    estimate is enough. Returns 0 when not even a batch of one fits. The reference answer of
    chapter 1's exercise ``ex-1-max-batch``.
    """
    one = estimate_training_memory(model, sample, optimizer)
    fixed = one.parameters + one.gradients + one.optimizer_state
    if one.activations <= 0:
        raise ValueError("the estimate found no activations: is `sample` a batch of inputs?")
    return max(0, (gpu_memory_bytes - fixed) // one.activations)


# ---------------------------------------------------------------------------------- measure
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
    params = _unique_parameters(model)
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved_model = copy.deepcopy(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    device = params[0].device
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
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
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - baseline
    grad_bytes = sum(p.grad.nbytes for p in params if p.grad is not None)
    state_bytes = sum(t.nbytes for state in optimizer.state.values() for t in _tensors(state))

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
            for t in _tensors(value):
                storage = t.untyped_storage()
                if storage.data_ptr() in skip:
                    continue
                skip.add(storage.data_ptr())
                by_op[op] = by_op.get(op, 0) + storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------ will it fit
def will_it_fit(
    num_params: int,
    gpu_memory_bytes: int,
    optimizer: str = "adam",
    bytes_per_param: int = 4,
    activation_bytes: int = 0,
) -> tuple[bool, MemoryBreakdown]:
    """Will a model of ``num_params`` parameters train on a GPU with ``gpu_memory_bytes``?

    Counts parameters, gradients and optimizer state at ``bytes_per_param`` each (Adam in fp32:
    4 + 4 + 8 = 16 bytes per parameter) plus ``activation_bytes`` that you estimate for your batch.
    Returns ``(fits, breakdown)``; ``breakdown.note`` says the answer in words. Memory the CUDA
    context, the allocator's fragmentation and temporaries take is not counted, so "fits" with
    little to spare may still fail. Chapter 1.
    """
    if num_params < 0 or gpu_memory_bytes <= 0 or bytes_per_param <= 0 or activation_bytes < 0:
        raise ValueError("num_params and activation_bytes must be >= 0, the others > 0")
    name = _optimizer_name(optimizer)
    p = num_params * bytes_per_param
    parts = dict(parameters=p, gradients=p, optimizer_state=OPTIMIZER_STATES[name] * p)
    need = sum(parts.values()) + activation_bytes
    fits = need <= gpu_memory_bytes
    verdict = "fits" if fits else f"does NOT fit ({need / gpu_memory_bytes:.1f}x too big)"
    note = (
        f"{num_params:,} parameters with {name}: needs {format_bytes(need)} "
        f"of {format_bytes(gpu_memory_bytes)}: {verdict}"
    )
    return fits, MemoryBreakdown(**parts, activations=activation_bytes, note=note)


def _check_stage_and_world(stage: int, world_size: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def zero_memory_per_rank(num_params: int, world_size: int, stage: int, k: int = 12) -> int:
    """Bytes per rank for model states under ZeRO, mixed-precision Adam (Rajbhandari et al. 2020).

    With Ψ = ``num_params`` and N = ``world_size``: fp16 parameters take 2Ψ, fp16 gradients 2Ψ,
    and the optimizer states kΨ (k = 12: fp32 master weights, momentum and variance).

    * stage 0 (plain data parallelism): (2 + 2 + k)Ψ
    * stage 1 (optimizer states sharded): 2Ψ + 2Ψ + kΨ/N
    * stage 2 (and gradients): 2Ψ + (2 + k)Ψ/N
    * stage 3 (and parameters): (2 + 2 + k)Ψ/N

    Rounded up to whole bytes. Activations are not included. Chapter 9 plots it.
    """
    _check_stage_and_world(stage, world_size)
    if num_params < 0 or k < 0:
        raise ValueError("num_params and k must be non-negative")
    replicated, sharded = {0: (4 + k, 0), 1: (4, k), 2: (2, 2 + k), 3: (0, 4 + k)}[stage]
    # Integer arithmetic: floats would lose whole bytes at trillions of parameters.
    return replicated * num_params + -(-sharded * num_params // world_size)


# ------------------------------------------------------------------- per rank, any dtype mix
@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, for a choice of dtypes.

    ``param_bytes`` and ``grad_bytes``: the weights and gradients that forward and backward use;
    ``master_bytes``: a separate fp32 copy of the weights that the optimizer updates (mixed
    precision keeps one; 0 if the weights are fp32 already); ``state_bytes``: the size of each
    element of each optimizer-state tensor (Adam keeps two such tensors, SGD with momentum one).
    With mixed-precision Adam, K = master + 2 x state = 4 + 8 = 12 bytes (the ZeRO paper's K).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int

    def k(self, optimizer: str = "adam") -> int:
        """Optimizer bytes per parameter: master copy plus state (the ZeRO paper's K)."""
        return self.master_bytes + OPTIMIZER_STATES[_optimizer_name(optimizer)] * self.state_bytes


PRECISIONS = {
    "fp32": Precision("fp32 weights, gradients and state", 4, 4, 0, 4),
    "mixed": Precision("fp16/bf16 weights and gradients, fp32 master and state", 2, 2, 4, 4),
    "bf16": Precision("bf16 everything (no master copy)", 2, 2, 0, 2),
}


def _precision(precision: str | Precision) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {sorted(PRECISIONS)} or a memory.Precision, got "
            f"{precision!r}"
        )
    return PRECISIONS[precision]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def memory_per_rank(
    num_params: int,
    world_size: int = 1,
    stage: int = 0,
    precision: str | Precision = "mixed",
    optimizer: str = "adam",
    activation_bytes: int = 0,
) -> MemoryBreakdown:
    """Training memory on each of ``world_size`` ranks, by part, under ZeRO ``stage`` 0-3.

    Stage 0 is plain data parallelism (everything replicated); stage 1 shards the optimizer
    state (with the master weights, if any), stage 2 also the gradients, stage 3 also the
    parameters; a sharded part takes ceil(bytes / N) on each rank. ``activation_bytes`` is the
    activations of one rank's local batch (estimate or measure them with
    :func:`estimate_training_memory` / :func:`measure_training_memory`); ZeRO does not shard
    them. With ``precision="mixed"`` and Adam the total equals :func:`zero_memory_per_rank` to
    within the rounding of each part (2 bytes). Chapter 9.
    """
    _check_stage_and_world(stage, world_size)
    if num_params < 0 or activation_bytes < 0:
        raise ValueError("num_params and activation_bytes must be non-negative")
    prec, name = _precision(precision), _optimizer_name(optimizer)
    whole = {
        "parameters": prec.param_bytes * num_params,
        "gradients": prec.grad_bytes * num_params,
        "optimizer_state": prec.k(name) * num_params,
    }
    sharded = {"optimizer_state": stage >= 1, "gradients": stage >= 2, "parameters": stage >= 3}
    parts = {k: _ceil_div(v, world_size) if sharded[k] else v for k, v in whole.items()}
    note = f"ZeRO stage {stage} on {world_size} ranks, {name}, {prec.name}"
    return MemoryBreakdown(**parts, activations=activation_bytes, note=note)


def zero_table(num_params: int, world_sizes: Sequence[int], k: int = 12) -> list[dict[str, int]]:
    """The ZeRO paper's Table 1 computed from :func:`zero_memory_per_rank`: one row per N, with
    the bytes per rank for plain DP and stages 1, 2 and 3 (keys ``N``, ``dp``, ``os``,
    ``os+g``, ``os+g+p``). Chapter 9 prints it for Ψ = 7.5 B."""
    return [
        {
            "N": n,
            "dp": zero_memory_per_rank(num_params, n, 0, k),
            "os": zero_memory_per_rank(num_params, n, 1, k),
            "os+g": zero_memory_per_rank(num_params, n, 2, k),
            "os+g+p": zero_memory_per_rank(num_params, n, 3, k),
        }
        for n in world_sizes
    ]


def will_it_fit_sharded(
    num_params: int,
    gpu_memory_bytes: int,
    world_size: int,
    stage: int,
    precision: str | Precision = "mixed",
    optimizer: str = "adam",
    activation_bytes: int = 0,
) -> tuple[bool, MemoryBreakdown]:
    """:func:`will_it_fit` for one rank of ``world_size`` under ZeRO ``stage`` (see
    :func:`memory_per_rank`). Returns ``(fits, breakdown)``, the answer in ``breakdown.note``.
    Like :func:`will_it_fit`, it leaves out the CUDA context, fragmentation and temporaries
    (stage 3 also needs room for the gathered parameters of the largest layer). Chapter 9."""
    if gpu_memory_bytes <= 0:
        raise ValueError(f"gpu_memory_bytes must be > 0, got {gpu_memory_bytes}")
    need = memory_per_rank(num_params, world_size, stage, precision, optimizer, activation_bytes)
    fits = need.total <= gpu_memory_bytes
    verdict = "fits" if fits else f"does NOT fit ({need.total / gpu_memory_bytes:.1f}x too big)"
    note = (
        f"{num_params:,} parameters, {need.note}: needs {format_bytes(need.total)} per rank of "
        f"{format_bytes(gpu_memory_bytes)}: {verdict}"
    )
    return fits, MemoryBreakdown(
        need.parameters, need.gradients, need.optimizer_state, need.activations, note=note
    )


def min_world_size(
    num_params: int,
    gpu_memory_bytes: int,
    stage: int,
    precision: str | Precision = "mixed",
    optimizer: str = "adam",
    activation_bytes: int = 0,
    limit: int = 1 << 20,
) -> int | None:
    """The fewest ranks on which the model's states fit in ``gpu_memory_bytes`` per rank under
    ZeRO ``stage``, or ``None`` if no number of ranks up to ``limit`` is enough (the replicated
    part alone is too big: more ranks shrink only the sharded parts). Chapter 9."""

    def fits(n: int) -> bool:
        return will_it_fit_sharded(
            num_params, gpu_memory_bytes, n, stage, precision, optimizer, activation_bytes
        )[0]

    if not fits(limit):
        return None
    low, high = 1, limit  # memory per rank never grows with N: binary search
    while low < high:
        mid = (low + high) // 2
        if fits(mid):
            high = mid
        else:
            low = mid + 1
    return low


def format_paper_gb(num_bytes: int) -> str:
    """Bytes as the ZeRO paper's Table 1 prints them: GB (1e9 bytes) to three significant
    figures, at most two decimals, halves rounded up, no trailing zeros (41.25 GB -> "41.3",
    0.1171875 GB -> "0.12", 7.5 GB -> "7.5"). Chapter 9."""
    from decimal import ROUND_HALF_UP, Decimal

    d = Decimal(num_bytes) / Decimal(10**9)
    if d == 0:
        return "0"
    digits = min(2, max(0, 2 - d.adjusted()))
    text = str(d.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text
