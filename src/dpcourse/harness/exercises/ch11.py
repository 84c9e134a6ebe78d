"""Checks for chapter 11's exercises (sharding at scale)

DTensor layouts, what FSDP's knobs send and hold, what hybrid sharding sends across nodes.

Chapter 11: checks for the exercises on sharding at scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import Replicate, Shard

from dpcourse.harness.exercises.core import Mismatch, call_learner, exercise
from dpcourse.sharding import hsdp, knobs, mesh


def _close(got, want: float, rel: float = 1e-9) -> bool:
    try:
        return math.isclose(float(got), want, rel_tol=rel, abs_tol=1e-9)
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------ DTensor layouts
# (global shape, mesh shape, placements): uneven cuts, a Replicate mesh dimension, two mesh
# dimensions sharding one tensor dimension, more ranks than rows
LAYOUT_CASES = [
    ((7, 5), (4,), (Shard(0),)),
    ((7, 5), (2, 2), (Replicate(), Shard(0))),
    ((10, 3), (3,), (Shard(0),)),
    ((9, 6), (2, 2), (Shard(0), Shard(1))),
    ((13,), (2, 3), (Shard(0), Shard(0))),
    ((2, 4), (4,), (Shard(0),)),
    ((6, 5), (2, 3), (Shard(1), Replicate())),
]


def _coordinates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    coords = [()]
    for n in mesh_shape:
        coords = [(*c, i) for c in coords for i in range(n)]
    return coords


def _split_like_ring(size: int, parts: int, index: int) -> int:
    base, extra = divmod(size, parts)
    return base + (1 if index < extra else 0)


def _layout_with(cut: Callable[[int, int, int], int], shape, mesh_shape, placements, coordinate,
                 flat: bool = False) -> tuple[int, ...]:
    """A wrong local shape: pieces cut by ``cut``; with ``flat``, every mesh dimension cutting
    the sharded dimension (the mesh taken for a flat world)."""
    local = list(shape)
    for n, p, c in zip(mesh_shape, placements, coordinate, strict=True):
        dim = p.dim if isinstance(p, Shard) else None
        if dim is None and flat:
            dim = next((q.dim for q in placements if isinstance(q, Shard)), None)
        if dim is not None:
            local[dim] = cut(local[dim], n, c)
    return tuple(local)


def _chunk(size: int, parts: int, index: int) -> int:
    start, end = mesh.chunk_rows(size, parts, index)
    return end - start


@exercise("ex-11-local-shape", function="my_local_shape", timeout=10)
def local_shape(fn: Callable) -> str:
    """``fn(shape, mesh_shape, placements, coordinate)``: the shape of ``to_local()`` on the rank
    at ``coordinate`` of the mesh, against :func:`dpcourse.sharding.mesh.local_shape` (itself
    tested against DTensor). Rejects the ring's cut (the first ``size % n`` pieces one longer),
    ``size // n`` for every piece, and a Replicate mesh dimension taken to cut too."""
    for shape, mesh_shape, placements in LAYOUT_CASES:
        for coordinate in _coordinates(mesh_shape):
            want = mesh.local_shape(shape, mesh_shape, placements, coordinate)
            got = call_learner(fn, shape, mesh_shape, placements, coordinate)
            try:
                got = tuple(int(n) for n in got)
            except (TypeError, ValueError):
                raise Mismatch(f"shape {shape}, mesh {mesh_shape}, placements {placements}, "
                               f"coordinate {coordinate}: expected a shape such as {want}, got "
                               f"{got!r}") from None
            if got == want:
                continue
            where = (f"shape {shape}, mesh {mesh_shape}, placements {placements}, coordinate "
                     f"{coordinate}: expected {want}, got {got}.")
            args = (shape, mesh_shape, placements, coordinate)
            if got == _layout_with(_split_like_ring, *args):
                raise Mismatch(f"{where} That is the ring's cut of chapters 6 and 9 (the first "
                               "size % n pieces one longer); Shard cuts as torch.chunk does: "
                               "pieces of ceil(size / n), the last ones shorter, or empty.")
            if got == _layout_with(lambda s, n, c: s // n, *args):
                raise Mismatch(f"{where} size // n drops the remainder: the pieces of all the "
                               "ranks must hold every row; Shard's are ceil(size / n) long, "
                               "but the last ones.")
            if got == _layout_with(_chunk, *args, flat=True):
                raise Mismatch(f"{where} A Replicate() mesh dimension does not cut the tensor: "
                               "each rank along it holds the same piece. Only the mesh "
                               "dimensions placed Shard(d) cut dimension d.")
            raise Mismatch(where)
    return "to_local()'s shape for every rank of every layout tried, as DTensor places it"


# --------------------------------------------------------------------- bytes of a step
BF16, F32 = torch.bfloat16, torch.float32
# (parameters, N, param_dtype, reduce_dtype, reshard_after_forward)
BYTES_CASES = [
    (8_398_848, 2, None, None, True),
    (8_398_848, 2, BF16, F32, True),
    (13e9, 64, BF16, None, True),
    (13e9, 64, BF16, F32, False),
    (1e6, 8, None, BF16, True),
    (7e9, 1, BF16, F32, True),
]


@exercise("ex-11-fsdp-bytes", function="my_fsdp_step_bytes", timeout=10)
def fsdp_bytes(fn: Callable) -> str:
    """``fn(num_params, world_size, param_dtype, reduce_dtype, reshard_after_forward)``: bytes
    one rank sends in one FSDP step (rings, parameters stored in fp32), against
    :func:`dpcourse.sharding.knobs.step_bytes`. Rejects ``reduce_dtype=None`` read as fp32, two
    all-gathers without resharding, and whole models per phase instead of (N-1)/N."""
    for n_params, world, param, reduce, reshard in BYTES_CASES:
        want = knobs.step_bytes(n_params, world, param, reduce, reshard)
        got = call_learner(fn, n_params, world, param, reduce, reshard)
        if _close(got, want):
            continue
        where = (f"{n_params:.4g} parameters on {world} ranks, param_dtype={param}, "
                 f"reduce_dtype={reduce}, reshard_after_forward={reshard}: expected "
                 f"{want:,.0f} bytes, got {got!r}.")
        hint = ""
        if reduce is None and param is not None and _close(
                got, knobs.step_bytes(n_params, world, param, F32, reshard)):
            hint = (" reduce_dtype=None does not mean fp32: fully_shard then reduces in "
                    "param_dtype (give reduce_dtype=torch.float32 to reduce in fp32).")
        elif not reshard and _close(got, knobs.step_bytes(n_params, world, param, reduce, True)):
            hint = (" Without resharding after forward, the parameters gathered for forward "
                    "stay for backward: one all-gather per step, not two.")
        elif world > 1 and _close(got, world / (world - 1) * want):
            hint = (" Each ring phase sends (N-1)/N of the data per rank, not all of it: a "
                    "rank's own piece never travels.")
        raise Mismatch(where + hint)
    return "the all-gathers in param_dtype and the reduce-scatter in reduce_dtype, every case"


# -------------------------------------------------------------------------- accumulation
# (parameters, N, micro-batches, sync_each, reduce_dtype)
ACCUMULATE_CASES = [
    (8_398_848, 2, 4, True, F32),
    (8_398_848, 2, 4, False, F32),
    (7e9, 64, 8, True, BF16),
    (7e9, 64, 8, False, BF16),
    (1e6, 4, 1, False, F32),
]


@exercise("ex-11-accumulate", function="my_accumulation_cost", timeout=10)
def accumulate(fn: Callable) -> str:
    """``fn(num_params, world_size, micro_batches, sync_each, reduce_dtype)``: (bytes a rank
    sends in reduce-scatters per optimizer step, bytes of gradients it holds between
    micro-batches), against :func:`dpcourse.sharding.knobs.accumulation_cost` (shards'
    gradients in fp32). Rejects unsynchronised gradients held as shards, one reduce-scatter per
    step when each micro-batch synchronises, and held gradients of fp32 when reduced in bf16."""
    for n_params, world, micro, sync, reduce in ACCUMULATE_CASES:
        want = knobs.accumulation_cost(n_params, world, micro, sync, reduce)
        got = call_learner(fn, n_params, world, micro, sync, reduce)
        if (isinstance(got, (tuple, list)) and len(got) == 2
                and all(_close(g, w) for g, w in zip(got, want, strict=True))):
            continue
        where = (f"{n_params:.4g} parameters on {world} ranks, {micro} micro-batches, "
                 f"sync_each={sync}, reduce_dtype={reduce}: expected (sent, held) = "
                 f"({want[0]:,.0f}, {want[1]:,.0f}) bytes, got {got!r}.")
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise Mismatch(where + " Return a pair: (bytes sent, bytes held).")
        hint = ""
        if not sync and _close(got[1], n_params / world * knobs.dtype_bytes(reduce)):
            hint = (" Unsynchronised gradients are not sharded yet: the reduce-scatter that "
                    "would cut them has not run, so each rank holds the whole model's.")
        elif not sync and _close(got[1], n_params * 4) and reduce != F32:
            hint = (" fully_shard accumulates unsynchronised gradients in reduce_dtype, "
                    f"{knobs.dtype_bytes(reduce)} bytes a value here, not fp32's 4.")
        elif sync and micro > 1 and _close(got[0], want[0] / micro):
            hint = (" Synchronising each micro-batch runs a reduce-scatter per micro-batch: "
                    f"{micro} per optimizer step.")
        elif not sync and micro > 1 and _close(got[0], want[0] * micro):
            hint = (" Without synchronisation the micro-batches send nothing; the last one "
                    "reduce-scatters their sum once.")
        raise Mismatch(where + hint)
    return "what each way of accumulating sends and holds, every case"


# -------------------------------------------------------------- bytes across the nodes
# (strategy, parameters, nodes, ranks per node, bytes per value)
NODE_CASES = [
    ("fsdp", 263_168, 2, 2, 4),
    ("hsdp", 263_168, 2, 2, 4),
    ("ddp", 263_168, 2, 2, 4),
    ("hsdp", 13e9, 32, 8, 2),
    ("fsdp", 13e9, 32, 8, 2),
    ("hsdp", 70e9, 16, 8, 4),
    ("fsdp", 1e9, 4, 1, 2),
    ("ddp", 1e6, 1, 4, 4),  # one node: nothing crosses
    ("hsdp", 1e6, 1, 8, 2),
]


@exercise("ex-11-node-bytes", function="my_bytes_across", timeout=10)
def node_bytes(fn: Callable) -> str:
    """``fn(strategy, num_params, nodes, ranks_per_node, bytes_per_value)``: bytes one node sends
    to the other nodes per step ("ddp", "fsdp" or "hsdp"; rings, ranks node-major, parameters
    and gradients of ``bytes_per_value`` each), against
    :func:`dpcourse.sharding.hsdp.node_traffic`. Rejects HSDP all-reducing the whole model
    across nodes, FSDP with one all-gather, and every rank of a node sending across in a flat
    ring."""
    for strategy, n_params, nodes, k, width in NODE_CASES:
        want = hsdp.node_traffic(strategy, n_params, nodes, k, width, width).across
        got = call_learner(fn, strategy, n_params, nodes, k, width)
        if _close(got, want):
            continue
        where = (f"{strategy} with {n_params:.4g} parameters on {nodes} nodes of {k} ranks, "
                 f"{width} bytes a value: expected {want:,.0f} bytes across per node, got "
                 f"{got!r}.")
        hint = ""
        if nodes == 1:
            hint = " With one node there are no other nodes: nothing crosses, 0 bytes."
        elif strategy == "hsdp" and k > 1 and _close(got, want * k):
            hint = (" After the reduce-scatter inside the node, a rank all-reduces across nodes "
                    "only its 1/k of the gradients (the rows it owns), not the whole model.")
        elif strategy == "fsdp" and _close(
                got, hsdp.node_traffic("fsdp", n_params, nodes, k, width, width,
                                       reshard_after_forward=False).across):
            hint = (" FSDP gathers each layer twice per step (for forward and again for "
                    "backward) before its reduce-scatter: three phases, not two.")
        elif strategy in ("ddp", "fsdp") and k > 1 and _close(got, want * k):
            hint = (" In a ring over every rank numbered node by node, only the node's last "
                    "rank sends to another node; the other k-1 send to their neighbours inside.")
        raise Mismatch(where + hint)
    return "the bytes each strategy sends between nodes, every case, one node included"
