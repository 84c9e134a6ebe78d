"""Property-based: for any length, values, op and root, ours equal torch.distributed's.

One pool of ranks per world size keeps every example cheap (a run, not a launch).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpcourse import collectives as C
from dpcourse import runtime
from dpcourse.collectives.ops import chunk_bounds
from dpcourse.harness.launch import RankPool


def check_case(n: int, seed: int, op: str, root: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 97 + rank)
    # exact sums in any order; drawn on the host, used on the rank's device
    x = torch.randint(-50, 51, (n,), generator=g).to(runtime.device(), torch.float64)
    problems = []
    torch_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    want = x.clone()
    dist.all_reduce(want, torch_op.get(op, dist.ReduceOp.SUM))
    if op == "mean":
        want /= world
    for fn in (C.ring_all_reduce, C.tree_all_reduce, C.naive_all_reduce):
        if not torch.equal(fn(x.clone(), op=op), want):
            problems.append(f"{fn.__name__}(n={n}, op={op})")
    start, end = chunk_bounds(n, world)[rank]
    if not torch.equal(C.ring_reduce_scatter(x, op=op), want[start:end]):
        problems.append(f"ring_reduce_scatter(n={n}, op={op})")
    b = x.clone()
    dist.broadcast(b, root % world)
    if not torch.equal(C.tree_broadcast(x.clone(), src=root % world), b):
        problems.append(f"tree_broadcast(n={n}, src={root % world})")
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    if not all(torch.equal(a, b) for a, b in zip(C.ring_all_gather(x), gathered, strict=True)):
        problems.append(f"ring_all_gather(n={n})")
    return problems


@pytest.fixture(scope="module")
def pools():
    opened: dict[int, RankPool] = {}
    yield opened
    for pool in opened.values():
        pool.close()


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_any_length_any_op_any_root(world_size, pools):
    pool = pools.setdefault(world_size, RankPool(world_size).start())

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(
        n=st.integers(min_value=0, max_value=3 * world_size + 40),
        seed=st.integers(min_value=0, max_value=10**6),
        op=st.sampled_from(["sum", "mean", "max", "min"]),
        root=st.integers(min_value=0, max_value=7),
    )
    def prop(n, seed, op, root):
        problems = [p for r in pool.run(check_case, n, seed, op, root) for p in r]
        assert not problems, problems

    prop()
