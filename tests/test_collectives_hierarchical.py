"""Chapter 10's hierarchical (two-level) all-reduce against ``dist.all_reduce``.

Each world size is one launch, whose rank function runs every layout (nodes x ranks per node)
of that size and every case, and returns what failed, as in ``tests/test_collectives.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.collectives import count_traffic
from dpcourse.collectives import hierarchical as H
from dpcourse.cost import simulate
from dpcourse.harness.launch import run_ranks

# Each dtype with the ops the library has for it ("mean": floating point only). The reduction
# op is one line of the ring's code, so max and min need not run in every dtype.
CASES = {
    torch.float32: ("sum", "mean", "max", "min"),
    torch.float64: ("sum", "mean"),
    torch.bfloat16: ("sum", "mean"),
    torch.int64: ("sum", "max", "min"),
}
LIBRARY_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# world size -> the ranks per node run on it: 2x1 and 1x2; 4x1, 2x2 and 1x4; 3x2 and 2x3
LAYOUTS = {2: (1, 2), 4: (1, 2, 4), 6: (2, 3)}


def lengths(world: int) -> list[int]:
    """Empty, shorter than a node and than the world, around both, not multiples of either."""
    around = {n for k in LAYOUTS[world] for n in (k - 1, k + 1)}
    return sorted({0, 1, world - 1, world, world + 1, 2 * world + 3, 1000} | around)


def make(n: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    # Small integers: exact in every dtype (bfloat16 too, up to 256), so any order of summation
    # gives the same sum, "mean" divides that same sum once, and comparisons can be exact.
    # Drawn on the host (the same numbers on every machine), used on the rank's device.
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-8, 9, (n,), generator=g).to(runtime.device(), dtype)


def library(x: torch.Tensor, op: str, world: int) -> torch.Tensor:
    want = x.clone()
    dist.all_reduce(want, LIBRARY_OPS.get(op, dist.ReduceOp.SUM))
    return want / world if op == "mean" else want


def every_case(groups: dict[int, H.NodeGroups]) -> list[str]:
    """Every dtype, length and op on every layout, against one library all-reduce each. The
    library calls run first, then each layout's back to back, so that a rank does not switch
    process groups at every call (each gloo group has threads of its own to wake): that
    halved this test's time on a busy 2-core machine."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = [
        (dtype, n, op)
        for dtype, ops in CASES.items()
        # dtypes do not interact with the layout: the smaller worlds run them all
        if world <= 4 or dtype in (torch.float32, torch.int64)
        for n in lengths(world)
        for op in ops
    ]
    inputs = {(dtype, n): make(n, dtype, rank, n) for dtype, n, _ in cases}
    wants = [library(inputs[dtype, n], op, world) for dtype, n, op in cases]
    failures = []
    for k, g in groups.items():
        for (dtype, n, op), want in zip(cases, wants, strict=True):
            got = inputs[dtype, n].clone()
            out = H.hierarchical_all_reduce(got, k, op, g, check_shapes=False)
            if out is not got or not torch.equal(got, want):
                failures.append(
                    f"rank {rank} {world // k}x{k} {dtype} n={n} op={op}: got "
                    f"{got.tolist()[:8]}, want {want.tolist()[:8]}"
                    + ("" if out is got else " (not in place)")
                )
    return failures


def check_layout(k: int, groups: H.NodeGroups) -> list[str]:
    """Defaults, traffic, a broken variant and library collectives on ``world // k`` nodes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes, layout, dev = world // k, f"{world // k}x{k}", runtime.device()
    failures = []
    # Random floats, a 2-D shape, the shape check on and groups built by the call itself:
    # equal up to the rounding of another summation order (float32 sums of 6 values of
    # size ~1: below 1e-5; on CUDA too, where each add is a correctly rounded float32 add as
    # here and only the order differs).
    x = torch.randn(3, 333, generator=torch.Generator().manual_seed(rank)).to(runtime.device())
    # (torch.allclose, not torch.testing.assert_close: importing that costs a fresh rank 2 s.)
    got, want = H.hierarchical_all_reduce(x.clone(), k, "mean"), library(x, "mean", world)
    if got.shape != x.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
        error = (got - want).abs().max().item() if got.shape == x.shape else got.shape
        failures.append(f"rank {rank} {layout} random floats: off by {error}")

    # Traffic, for a length that divides evenly: each rank holds S/k after step 1, and only
    # step 2 crosses nodes, 2(nodes-1)/nodes of that chunk; steps 1 and 3 send 2(k-1)/k * S.
    n = 12 * world
    size = 4 * n  # float32 bytes
    with count_traffic() as t:  # (the shape check's message is not counted)
        H.hierarchical_all_reduce(torch.ones(n, device=dev), k, groups=groups)
    across = sum(b for kind, peer, b in t.log if kind == "send" and peer // k != rank // k)
    inside = sum(b for kind, peer, b in t.log if kind == "send" and peer // k == rank // k)
    received = sum(b for kind, peer, b in t.log if kind == "recv" and peer // k != rank // k)
    if (across, received) != (2 * (nodes - 1) * size // (nodes * k),) * 2:
        failures.append(f"rank {rank} {layout}: {across} B across nodes, {received} B back")
    if inside != 2 * (k - 1) * size // k or t.bytes_sent != across + inside:
        failures.append(f"rank {rank} {layout}: {inside} B inside the node, {t.bytes_sent} B")

    # A test that can fail: without step 2 each node ends with its own sum, which the
    # comparison must catch (with one node, step 2 has nothing to do).
    if nodes > 1:
        x = make(2 * world + 3, torch.float32, rank, 7)
        step2, H._all_reduce_across_nodes = H._all_reduce_across_nodes, lambda *args: None
        try:
            broken = H.hierarchical_all_reduce(x.clone(), k, groups=groups)
        finally:
            H._all_reduce_across_nodes = step2
        if torch.equal(broken, library(x, "sum", world)):
            failures.append(f"{layout}: skipping step 2 went unnoticed")

    # No library collective: each raises while the all-reduce runs.
    from dpcourse.harness.patching import library_collectives_forbidden

    try:
        with library_collectives_forbidden():
            H.hierarchical_all_reduce(torch.arange(7.0, device=dev), k, groups=groups)
    except AssertionError as exc:
        failures.append(f"{layout}: {exc}")
    return failures


def every_layout() -> list[str]:
    world = dist.get_world_size()
    groups = {k: H.node_groups(k) for k in LAYOUTS[world]}  # built once, as the docs advise
    failures = every_case(groups)
    return failures + [f for k, g in groups.items() for f in check_layout(k, g)]


@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_hierarchical_all_reduce_equals_torch_distributed(world_size):
    results = run_ranks(every_layout, world_size, timeout=120)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:20])


# ------------------------------------------------------------------------------- bad input
def bad_layouts() -> list[str]:
    messages, dev = [], runtime.device()
    for call in [
        lambda: H.hierarchical_all_reduce(torch.ones(3, device=dev), 3),  # 4 ranks: not nodes of 3
        lambda: H.node_groups(3),
        lambda: H.hierarchical_all_reduce(torch.ones(3, device=dev), 0),
        lambda: H.hierarchical_all_reduce(torch.ones(3, device=dev), 1.5),
        lambda: H.hierarchical_all_reduce(torch.ones(3, device=dev), 4, groups=H.node_groups(2)),
        lambda: H.hierarchical_all_reduce(torch.ones(3, dtype=torch.int64, device=dev), 2, "mean"),
    ]:
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def test_a_layout_that_does_not_divide_the_world_is_a_clear_error():
    for messages in run_ranks(bad_layouts, 4):
        assert messages[0].startswith("ValueError: ranks_per_node=3 does not divide")
        assert "world size 4" in messages[0] and "divisor of 4" in messages[0]
        assert messages[1] == messages[0]
        assert messages[2].startswith("ValueError: ranks_per_node=0 does not divide")
        assert messages[3].startswith("TypeError: ranks_per_node must be an int")
        assert "made for 2 nodes of 2 ranks" in messages[4] and "node_groups(4)" in messages[4]
        assert "op='mean'" in messages[5]


def test_without_a_process_group_says_how_to_run():
    with pytest.raises(RuntimeError, match="run_ranks"):
        H.hierarchical_all_reduce(torch.ones(3), 1)
    with pytest.raises(RuntimeError, match="no sub-groups"):
        simulate.run(H.node_groups, 2, 1)
