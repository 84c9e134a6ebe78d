"""DeviceMesh and DTensor, as far as FSDP2 needs them: which rows of a tensor each rank holds.

``fully_shard`` turns each parameter into a ``DTensor``: a tensor described whole (its global
shape) but stored in pieces, one per rank of a ``DeviceMesh``. A mesh is the world's ranks laid
out as an array, ``init_device_mesh("cpu", (2, 2))`` two rows of two, each of its dimensions a
process group; a DTensor's ``placements`` say, per mesh dimension, what it does along it:
``Shard(d)`` cuts the tensor's dim ``d`` into as many chunks as the mesh dimension has ranks,
``Replicate()`` keeps a copy on each. ``to_local()`` is this rank's piece (a plain tensor);
``full_tensor()`` all-gathers the pieces into the whole tensor, on every rank (a collective).

The chunks are ``torch.chunk``'s: every piece ``ceil(size / n)`` long but the last ones, which
get what is left, possibly nothing (7 rows over 3 ranks: 3, 3, 1). Chapter 9's ring chunks are
``tensor_split``'s instead (3, 2, 2): :func:`chunk_rows` and :func:`local_shape` compute torch's,
for any mesh and placements, as DTensor does (mesh dimensions applied from the first).

Chapter 11: DeviceMesh and DTensor, as FSDP2 uses them.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Replicate, Shard

__all__ = ["chunk_rows", "local_shape", "describe"]


def chunk_rows(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, end) along a dimension of ``size`` of piece ``index`` of ``parts``, as
    ``torch.chunk`` (and so ``Shard``) cuts it: pieces of ``ceil(size / parts)``, the last ones
    shorter or empty. Chapter 11 (exercise ex-11-local-shape)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"need 0 <= index < parts, got index {index} of {parts}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    step = -(-size // parts)  # ceil
    start = min(size, index * step)
    return start, min(size, start + step)


def local_shape(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence,
                coordinate: Sequence[int]) -> tuple[int, ...]:
    """The shape of ``to_local()`` on the rank at ``coordinate`` of a mesh of ``mesh_shape``,
    for a DTensor of global ``shape`` with ``placements`` (one ``Shard(d)`` or ``Replicate()``
    per mesh dimension). Mesh dimensions apply in order: with ``(Shard(0), Shard(0))`` the rows
    are cut by mesh dimension 0, and each piece again by dimension 1. Chapter 11."""
    if not (len(mesh_shape) == len(placements) == len(coordinate)):
        raise ValueError(f"mesh_shape {tuple(mesh_shape)}, placements and coordinate "
                         f"{tuple(coordinate)} need one entry per mesh dimension")
    local = list(shape)
    for n, placement, c in zip(mesh_shape, placements, coordinate, strict=True):
        if isinstance(placement, Shard):
            if not 0 <= placement.dim < len(local):
                raise ValueError(f"{placement} on a tensor of {len(local)} dimensions")
            start, end = chunk_rows(local[placement.dim], n, c)
            local[placement.dim] = end - start
        elif not isinstance(placement, Replicate):
            raise TypeError(f"placements are Shard(d) or Replicate(), got {placement!r}")
    return tuple(local)


def describe(tensor) -> str:
    """One line on a DTensor: its global and local shapes, placements and mesh (for the
    chapter's cells)."""
    return (f"DTensor {tuple(tensor.shape)} as {tuple(tensor.placements)} on mesh "
            f"{tuple(tensor.device_mesh.shape)}: this rank holds {tuple(tensor.to_local().shape)}")
