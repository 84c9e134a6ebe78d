"""What every collective of the course shares: the reduction ops, input checks, chunking."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.collectives.p2p import rank_and_size

__all__ = ["OPS", "combine_", "finish_", "check_input", "chunk_bounds"]

OPS = ("sum", "mean", "max", "min")


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """``acc = acc (op) other`` in place; "mean" sums here and divides at the end."""
    if op in ("sum", "mean"):
        acc.add_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    else:
        torch.minimum(acc, other, out=acc)


def finish_(tensor: torch.Tensor, op: str, world_size: int) -> None:
    """The last step of a reduction: divide by the world size for "mean"."""
    if op == "mean":
        tensor.div_(world_size)


def check_input(tensor: torch.Tensor, op: str | None, check_shapes: bool) -> tuple[int, int]:
    """Validate a collective's input; return (rank, world size).

    With ``check_shapes`` the ranks compare the number of elements and the dtype of their
    tensors first (one tiny all-reduce), so that mismatched inputs give a clear error instead
    of a hang or garbage.
    """
    rank, world = rank_and_size()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op is not None and op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if op == "mean" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"op='mean' of a {tensor.dtype} tensor is not a {tensor.dtype}: use op='sum' and "
            "divide, or convert to a floating-point dtype first"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            "the tensor is not contiguous, so it cannot be reduced in place: pass "
            "t.contiguous() and copy the result back (t.copy_(result))"
        )
    if check_shapes and world > 1:
        # str hashes differ between processes (PYTHONHASHSEED), so encode the dtype by its name.
        code = float(sum(ord(c) * 31**i for i, c in enumerate(str(tensor.dtype))) % 1_000_003)
        device = tensor.device if dist.get_backend() == "nccl" else "cpu"
        mine = torch.tensor(
            [tensor.numel(), -tensor.numel(), code, -code], dtype=torch.float64, device=device
        )
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if mine[0] != -mine[1]:
            raise ValueError(
                f"rank {rank} has a tensor of {tensor.numel()} elements but another rank's has "
                f"{int(mine[0]) if mine[0] != tensor.numel() else int(-mine[1])}: every rank must "
                "pass a tensor of the same size"
            )
        if mine[2] != -mine[3]:
            raise ValueError(
                f"rank {rank} has a {tensor.dtype} tensor but the ranks' dtypes differ: every "
                "rank must pass the same dtype"
            )
    return rank, world


def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """(start, end) of each rank's chunk of a flat tensor: like ``torch.tensor_split``, the
    first ``numel % world_size`` chunks hold one element more; some are empty when
    ``numel < world_size``."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds
