"""Memory per rank under ZeRO: what sharding the optimizer state, the gradients and the
parameters (stages 1-3) saves on each rank, for any dtype mix, and "will it fit?" on N GPUs.

:func:`zero_memory_per_rank` is the ZeRO paper's formula (mixed-precision Adam, K = 12) and
:func:`zero_table` its Table 1; :func:`memory_per_rank` splits the bytes by part for any
:data:`PRECISIONS` and optimizer; :func:`will_it_fit_sharded` and :func:`min_world_size` answer
chapter 1's question on N ranks. The parts and their formulas are chapter 1's
(:mod:`dpcourse.one_device.memory`).

Chapter 9: memory per rank under ZeRO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal

from dpcourse.one_device.memory import (
    OPTIMIZER_STATES,
    MemoryBreakdown,
    format_bytes,
    optimizer_name,
)

__all__ = [
    "zero_memory_per_rank",
    "Precision",
    "PRECISIONS",
    "memory_per_rank",
    "zero_table",
    "will_it_fit_sharded",
    "min_world_size",
    "format_paper_gb",
]


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
        return self.master_bytes + OPTIMIZER_STATES[optimizer_name(optimizer)] * self.state_bytes


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
            f"precision must be one of {sorted(PRECISIONS)} or a zero_memory.Precision, got "
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
    activations of one rank's local batch (estimate or measure them with chapter 1's
    ``estimate_training_memory`` / ``measure_training_memory``); ZeRO does not shard them. With
    ``precision="mixed"`` and Adam the total equals :func:`zero_memory_per_rank` to within the
    rounding of each part (2 bytes). Chapter 9.
    """
    _check_stage_and_world(stage, world_size)
    if num_params < 0 or activation_bytes < 0:
        raise ValueError("num_params and activation_bytes must be non-negative")
    prec, name = _precision(precision), optimizer_name(optimizer)
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
    """Chapter 1's ``will_it_fit`` for one rank of ``world_size`` under ZeRO ``stage`` (see
    :func:`memory_per_rank`). Returns ``(fits, breakdown)``, the answer in ``breakdown.note``.
    Like chapter 1's ``will_it_fit``, it leaves out the CUDA context, fragmentation and temporaries
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

    d = Decimal(num_bytes) / Decimal(10**9)
    if d == 0:
        return "0"
    digits = min(2, max(0, 2 - d.adjusted()))
    text = str(d.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text
