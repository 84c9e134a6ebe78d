"""What every collective of the course shares: the reduction ops, input checks, chunking.

Chapter 5: what every collective shares (ops, input checks, chunks).
"""

from __future__ import annotations

import torch

from dpcourse.collectives.p2p import exchange, not_counted, rank_and_size

__all__ = ["OPS", "combine_", "finish_", "check_input", "chunk_bounds",
           "check_root"]

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

    With ``check_shapes`` the ranks also compare their tensors (:func:`_check_same_shapes`), so
    that mismatched inputs give a clear error instead of a hang or garbage; without it nothing
    is sent.
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
        _check_same_shapes(tensor, rank, world)
    return rank, world


# Every dtype torch knows, in a fixed order: a dtype travels as its index (str hashes differ
# between processes). The ranks run the same torch, so the order is the same on each.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_MAX_DIMS = 8  # dimensions sent; a shape with more is shown cut short


def _describe(numel: int, dtype: torch.dtype, shape: tuple) -> str:
    return f"a {dtype} tensor of shape {shape} ({numel} elements)"


def _check_same_shapes(tensor: torch.Tensor, rank: int, world: int) -> None:
    """Raise a ValueError unless every rank's ``tensor`` has as many elements and the same
    dtype as this one. No library collective: each rank sends its numel, dtype and shape to
    its right neighbour and compares them with what comes from its left (one small message
    each way, left out of :func:`~dpcourse.collectives.p2p.count_traffic`). If every rank
    agrees with its left neighbour, then all agree, by going round the ring. The ranks next to
    a mismatch raise; the others go on into the collective, which stalls without them (the
    launcher then stops every rank, naming the first error)."""
    dims = list(tensor.shape)[:_MAX_DIMS]
    code = _DTYPES.index(tensor.dtype)
    mine = torch.tensor(
        [tensor.numel(), code, tensor.dim(), *dims, *[0] * (_MAX_DIMS - len(dims))],
        dtype=torch.int64,
        device=tensor.device,
    )
    left = torch.empty_like(mine)
    with not_counted():
        exchange(mine, (rank + 1) % world, left, (rank - 1) % world)
    if torch.equal(mine[:2], left[:2]):
        return
    numel, code, ndim, *shape = left.tolist()
    shape = tuple(shape[: min(ndim, _MAX_DIMS)]) + (("...",) if ndim > _MAX_DIMS else ())
    theirs = _describe(numel, _DTYPES[code], shape)
    ours = _describe(tensor.numel(), tensor.dtype, tuple(tensor.shape))
    what = "the same size" if numel != tensor.numel() else "the same dtype"
    raise ValueError(
        f"rank {rank} has {ours} but its left neighbour, rank {(rank - 1) % world}, has "
        f"{theirs}: every rank must pass a tensor of {what}"
    )


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


def check_root(root: int, world: int) -> None:
    """A root rank that is one of the ``world`` ranks, or a ValueError that says which are."""
    if not 0 <= root < world:
        raise ValueError(f"the root rank must be in [0, {world - 1}], got {root}")
