"""Chapter 10's step-time model for methods that send less: compressed by c, or every H steps.

Chapter 10 modelled a step as compute plus the part of the gradient all-reduce that compute does
not hide (:func:`dpcourse.cost.scaling.overlapped_step_time`, with chapter 6's
:func:`dpcourse.cost.costmodel.all_reduce_time`). Every method of chapter 12 is that model with
two more knobs:

* a **payload** smaller than the gradients: half for fp16, (n + m) r of n m values per matrix
  for PowerSGD (:func:`payload_bytes`), a quarter plus the scales for fp8;
* an all-reduce **every H steps** instead of every step (local SGD, DiLoCo), whose cost is
  spread over the H steps, and for Streaming DiLoCo hidden behind ``delay`` steps of compute.

So a method's mean step is ``compute + overhead + max(0, T(payload) - hidden) / H``
(:func:`step_time`), and its time to a loss is the steps it needs times that. The steps are
the statistical side, which no cost model gives (chapter 10's noise scale is the closest):
the chapter measures them, and the model says how the seconds follow, link by link
(:func:`time_to_target`). :func:`reduction_needed` inverts it: how much H x c a link needs so
that communication costs at most a given fraction of the compute.

Chapter 12: the step-time model of methods that communicate less.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpcourse.communicating_less.powersgd import compressed_values
from dpcourse.communicating_less.quantization import BLOCK
from dpcourse.cost import costmodel

__all__ = ["payload_bytes", "step_time", "time_to_target", "reduction_needed"]


def payload_bytes(method: str, shapes: Sequence[tuple[int, ...]], world_size: int = 2, *,
                  rank: int = 1, fragments: int = 1, min_compression_rate: float = 2) -> float:
    """Bytes one synchronisation all-reduces for a model of parameter ``shapes`` (fp32):
    ``"ddp"``, ``"local_sgd"`` and ``"diloco"`` 4 per value; ``"fp16"`` 2; ``"powersgd"``
    4 per value of :func:`~dpcourse.communicating_less.powersgd.compressed_values` at
    ``rank``; ``"streaming"`` one of ``fragments`` equal fragments in fp8, 1 byte a value
    plus a 4-byte scale per block of 256 (padded to whole blocks, an equal number per rank)."""
    values = sum(int(np.prod(s)) for s in shapes)
    if method in ("ddp", "local_sgd", "diloco"):
        return 4.0 * values
    if method == "fp16":
        return 2.0 * values
    if method == "powersgd":
        return 4.0 * sum(compressed_values(s, rank, min_compression_rate) for s in shapes)
    if method == "streaming":
        per_fragment = values / fragments
        blocks = world_size * np.ceil(per_fragment / (world_size * BLOCK))
        return float(blocks * (BLOCK + 4))
    raise ValueError(f"method must be ddp, fp16, powersgd, local_sgd, diloco or streaming; got "
                     f"{method!r}")


def step_time(
    world_size: int, compute_s: float, payload: float, alpha: float,
    beta: float, *, every: float = 1, all_reduces: int = 1,
    hidden_s: float = 0.0, overhead_s: float = 0.0,
) -> float:
    """Modelled mean seconds per step: ``compute_s + overhead_s`` plus a ring
    all-reduce of ``payload`` bytes in ``all_reduces`` all-reduces (each pays
    the latency) on links of ``alpha`` and ``beta``, less the ``hidden_s``
    seconds of compute it runs behind, once every ``every`` steps. DDP:
    ``every=1`` and ``hidden_s`` the overlapped share of backward (chapter
    10); DiLoCo: ``every=H``; Streaming DiLoCo: ``every=H/F`` with
    ``payload`` a fragment and ``hidden_s`` its ``delay`` steps of compute."""
    if every < 1:
        raise ValueError(f"every (steps between synchronisations) must be 1 "
                         f"or more, got {every}")
    comm = costmodel.all_reduce_time("ring", world_size, payload, alpha, beta,
                                     buckets=all_reduces)
    return compute_s + overhead_s + max(0.0, comm - hidden_s) / every


def time_to_target(steps: float | None, step_s: float) -> float | None:
    """Seconds to the target loss: the steps a method needs (measured) times its step (modelled
    or measured); None when it never got there."""
    return None if steps is None else steps * step_s


def reduction_needed(num_params: float, world_size: int, compute_s: float, beta: float,
                     budget: float = 0.1, bytes_per_value: float = 2.0, alpha: float = 0.0
                     ) -> float:
    """The factor H x c by which a method must cut what DDP sends (every H steps, compressed by
    c) for the ring all-reduce of the model to cost at most ``budget`` of a step's
    ``compute_s``, without overlap: ``T_allreduce(bytes) / (budget x compute)``."""
    if not 0 < budget:
        raise ValueError(f"budget is a fraction of the compute, above 0; got {budget}")
    comm = costmodel.all_reduce_time("ring", world_size, num_params * bytes_per_value, alpha, beta)
    return comm / (budget * compute_s)
