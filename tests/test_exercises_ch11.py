"""Chapter 11's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from dpcourse.harness.exercises import ch11, run_check  # noqa: F401 (registers the checks)
from dpcourse.sharding import hsdp, knobs, mesh


# ------------------------------------------------------------------------ local shapes
def cut_shape(cut, flat=False):
    def fn(shape, mesh_shape, placements, coordinate):
        local = list(shape)
        for n, p, c in zip(mesh_shape, placements, coordinate, strict=True):
            dim = p.dim if isinstance(p, Shard) else None
            if dim is None and flat:
                dim = next((q.dim for q in placements if isinstance(q, Shard)), None)
            if dim is not None:
                local[dim] = cut(local[dim], n, c)
        return tuple(local)
    return fn


def test_local_shape_check():
    assert run_check("ex-11-local-shape", mesh.local_shape).passed

    def ring(size, n, c):
        return size // n + (1 if c < size % n else 0)

    result = run_check("ex-11-local-shape", cut_shape(ring))
    assert not result.passed and "the ring's cut" in result.message
    assert "shape (10, 3), mesh (3,)" in result.message  # 7 over 4: 2, 2, 2, 1 both ways

    result = run_check("ex-11-local-shape", cut_shape(lambda s, n, c: s // n))
    assert not result.passed and "drops the remainder" in result.message

    def chunk(size, n, c):
        a, b = mesh.chunk_rows(size, n, c)
        return b - a

    result = run_check("ex-11-local-shape", cut_shape(chunk, flat=True))
    assert not result.passed and "A Replicate() mesh dimension does not cut" in result.message
    result = run_check("ex-11-local-shape", lambda *args: "7x5")
    assert not result.passed and "expected a shape" in result.message
    # the layouts themselves, by hand: 7 rows over 3 ranks are 3, 3, 1
    assert [mesh.local_shape((7, 2), (3,), (Shard(0),), (c,)) for c in range(3)] == [
        (3, 2), (3, 2), (1, 2)]
    assert mesh.local_shape((7, 2), (2, 2), (Replicate(), Shard(0)), (1, 1)) == (3, 2)


# ------------------------------------------------------------------------ bytes of a step
def test_fsdp_bytes_check():
    assert run_check("ex-11-fsdp-bytes", knobs.step_bytes).passed

    def reduce_none_is_fp32(p, n, param, reduce, reshard):
        return knobs.step_bytes(p, n, param, reduce or torch.float32, reshard)

    result = run_check("ex-11-fsdp-bytes", reduce_none_is_fp32)
    assert not result.passed and "reduce_dtype=None does not mean fp32" in result.message

    def always_two_gathers(p, n, param, reduce, reshard):
        return knobs.step_bytes(p, n, param, reduce, True)

    result = run_check("ex-11-fsdp-bytes", always_two_gathers)
    assert not result.passed and "one all-gather per step, not two" in result.message

    def whole_model_per_phase(p, n, param, reduce, reshard):
        return knobs.step_bytes(p, n, param, reduce, reshard) * n / (n - 1)

    result = run_check("ex-11-fsdp-bytes", whole_model_per_phase)
    assert not result.passed and "(N-1)/N of the data" in result.message


# -------------------------------------------------------------------------- accumulation
def test_accumulate_check():
    assert run_check("ex-11-accumulate", knobs.accumulation_cost).passed

    def held_as_shards(p, n, m, sync, reduce):
        sent, held = knobs.accumulation_cost(p, n, m, sync, reduce)
        return sent, held if sync else held / n

    result = run_check("ex-11-accumulate", held_as_shards)
    assert not result.passed and "not sharded yet" in result.message

    def one_reduce_scatter(p, n, m, sync, reduce):
        sent, held = knobs.accumulation_cost(p, n, m, sync, reduce)
        return (sent / m if sync else sent), held

    result = run_check("ex-11-accumulate", one_reduce_scatter)
    assert not result.passed and "a reduce-scatter per micro-batch" in result.message

    def held_in_fp32(p, n, m, sync, reduce):
        sent, held = knobs.accumulation_cost(p, n, m, sync, reduce)
        return sent, held if sync else p * 4

    result = run_check("ex-11-accumulate", held_in_fp32)
    assert not result.passed and "in reduce_dtype" in result.message
    result = run_check("ex-11-accumulate", lambda *args: 3)
    assert not result.passed and "Return a pair" in result.message


# ----------------------------------------------------------------- bytes across the nodes
def across(strategy, p, nodes, k, width, **kw):
    return hsdp.node_traffic(strategy, p, nodes, k, width, width, **kw).across


def test_node_bytes_check():
    assert run_check("ex-11-node-bytes", across).passed

    def hsdp_whole_model(strategy, p, nodes, k, width):
        return across(strategy, p, nodes, k, width) * (k if strategy == "hsdp" else 1)

    result = run_check("ex-11-node-bytes", hsdp_whole_model)
    assert not result.passed and "only its 1/k of the gradients" in result.message

    def fsdp_one_gather(strategy, p, nodes, k, width):
        return across(strategy, p, nodes, k, width, reshard_after_forward=False)

    result = run_check("ex-11-node-bytes", fsdp_one_gather)
    assert not result.passed and "three phases, not two" in result.message

    def every_rank_crosses(strategy, p, nodes, k, width):
        return across(strategy, p, nodes, k, width) * (1 if strategy == "hsdp" else k)

    result = run_check("ex-11-node-bytes", every_rank_crosses)
    assert not result.passed and "only the node's last rank" in result.message


def test_node_bytes_tries_one_node():
    """Kind 1, an edge size: with one node nothing crosses, whatever the strategy's formula."""

    def formula_without_the_edge(strategy, p, nodes, k, width):
        world, size = nodes * k, p * width
        if strategy == "hsdp":
            return 2 * (nodes - 1) / nodes * size
        return (2 if strategy == "ddp" else 3) * (world - 1) / world * size

    result = run_check("ex-11-node-bytes", formula_without_the_edge)
    assert not result.passed and "on 1 nodes of 4 ranks" in result.message
    assert "nothing crosses, 0 bytes" in result.message
