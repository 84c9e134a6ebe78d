"""Where the memory of training goes: parameters, gradients, optimizer state and activations.

Chapter 1 estimates each part from formulas (measuring it for real is
:mod:`dpcourse.one_device.memory_measurement`) and answers "will my model fit on my GPU?" (chapter
9's
:mod:`dpcourse.sharding.zero_memory` does the same per rank under ZeRO).

The bookkeeping, per parameter of ``b`` bytes (4 in fp32):

* parameters: ``b``; gradients: ``b`` (one per parameter, same dtype);
* optimizer state: plain SGD keeps nothing, SGD with momentum one buffer (``b``), Adam two
  (``2b``: the running mean and the running mean of squares) plus one scalar step counter per
  parameter tensor;
* activations: whatever the forward pass keeps for the backward pass; it grows with the batch.

Chapter 1: where the memory of training goes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "OPTIMIZER_STATES",
    "ADAM_STEP_BYTES",
    "count_parameters",
    "unique_parameters",
    "tensors_in",
    "MemoryBreakdown",
    "format_bytes",
    "format_table",
    "estimate_training_memory",
    "will_it_fit",
    "max_batch_size",
    "transformer_activation_bytes",
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


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Each parameter of ``model`` once, however many modules share it."""
    return list(model.parameters())  # nn.Module.parameters() already skips duplicates


def optimizer_name(optimizer: str | torch.optim.Optimizer) -> str:
    """The name under which :data:`OPTIMIZER_STATES` counts an optimizer's state (a name or an
    optimizer object)."""
    if isinstance(optimizer, str):
        name = optimizer.lower()
    elif isinstance(optimizer, torch.optim.SGD):
        name = "sgd_momentum" if optimizer.defaults.get("momentum", 0) else "sgd"
    else:
        name = type(optimizer).__name__.lower()
    if name not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    return name


# ----------------------------------------------------------------------- published formula
def transformer_activation_bytes(
    seq_len: int,
    batch_size: int,
    hidden: int,
    heads: int,
    layers: int = 1,
    recompute: str = "none",
) -> int:
    """Bytes of activations a GPT-style Transformer keeps for backward: the published formula
    ``s b h (34 + 5 a s / h)`` per layer (Korthikanti et al. 2022, section 4.1, eq. 1; the
    Ultra-Scale Playbook's ``m_act`` multiplies it by the layers), times ``layers``.

    Per layer, in units of ``s b h`` bytes: attention 11 (its inputs and Q, K, V in 16 bits, a
    1-byte dropout mask) plus ``5 a s^2 b`` bytes for the attention scores, softmax output and
    its dropout mask; the MLP (hidden size 4h) 19; two layer norms 4. It assumes 16-bit
    activations, no tensor or sequence parallelism and no fused attention; embeddings, the
    output layer and the loss are not counted. ``recompute``: ``"none"``; ``"selective"``
    (recompute the attention scores, drop the ``5as/h`` term: ``34 s b h``); ``"full"`` (keep
    only each layer's input, ``2 s b h``). Chapter 1's rule of thumb estimates activations by
    hooks instead; chapter 9 adds them to the sharded model states. Chapter 1.
    """
    sizes = (seq_len, batch_size, hidden, heads, layers)
    if any(not isinstance(v, int) or v < 1 for v in sizes):
        raise ValueError(f"seq_len, batch_size, hidden, heads and layers must be positive ints, "
                         f"got {sizes}")
    sbh = seq_len * batch_size * hidden
    per_layer = {
        "none": 34 * sbh + 5 * heads * seq_len * seq_len * batch_size,  # = sbh(34 + 5as/h)
        "selective": 34 * sbh,
        "full": 2 * sbh,
    }
    if recompute not in per_layer:
        raise ValueError(f"recompute must be one of {sorted(per_layer)}, got {recompute!r}")
    return layers * per_layer[recompute]


# ---------------------------------------------------------------------------------- estimate
def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in ``obj``: a tensor, or lists, tuples and dicts of them (optimizer state)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
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
    name = optimizer_name(optimizer)
    params = unique_parameters(model)

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
            for t in tensors_in(args):
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
    for t in tensors_in(output):
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
    name = optimizer_name(optimizer)
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
