"""The course's collectives against torch.distributed's, on world sizes 1-8.

Each world size is one launch: the rank function runs every case and returns what failed, so
that a failure names the case instead of hiding in a rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dpcourse import collectives as C
from dpcourse import runtime
from dpcourse.collectives.ops import chunk_bounds
from dpcourse.harness.launch import RankError, run_ranks

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def lengths(world: int) -> list[int]:
    """Awkward lengths: empty, shorter than N, around N and 2N, not multiples of N."""
    return sorted({0, 1, max(world - 1, 1), world, world + 1, 2 * world + 3, 1000})


def make(n: int, dtype: torch.dtype, rank: int, seed: int) -> torch.Tensor:
    # Small integers are exact in every dtype, so any summation order gives the same result
    # and comparisons can be exact; the random-float cases below use tolerances instead.
    # Drawn on the host (the same numbers on every machine), used on the rank's device.
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-8, 9, (n,), generator=g).to(runtime.device(), dtype)


def compare_everything(world: int) -> list[str]:
    rank = dist.get_rank()
    failures = []

    def fail(what, got, want):
        failures.append(f"rank {rank}: {what}: got {got.tolist()[:8]}, want {want.tolist()[:8]}")

    # Dtypes do not interact with the world size: beyond 4 ranks two of them are enough.
    for dtype in DTYPES if world <= 4 else [torch.float32, torch.int64]:
        for n in lengths(world):
            x = make(n, dtype, rank, n)
            for op in ("sum", "mean", "max", "min"):
                if op == "mean" and not dtype.is_floating_point:
                    continue
                want = x.clone()
                dist.all_reduce(want, OPS.get(op, dist.ReduceOp.SUM))
                if op == "mean":
                    want /= world
                for name, fn in [
                    ("ring", C.ring_all_reduce),
                    ("tree", C.tree_all_reduce),
                    ("naive", C.naive_all_reduce),
                ]:
                    got = x.clone()
                    out = fn(got, op=op)
                    if out is not got:
                        failures.append(f"{name}_all_reduce did not work in place")
                    if not torch.equal(got, want):
                        fail(f"{name}_all_reduce {dtype} n={n} op={op}", got, want)
                # reduce-scatter: this rank's chunk of the all-reduced tensor
                start, end = chunk_bounds(n, world)[rank]
                got = C.ring_reduce_scatter(x, op=op)
                if not torch.equal(got, want[start:end]):
                    fail(f"ring_reduce_scatter {dtype} n={n} op={op}", got, want[start:end])
                if not torch.equal(x, make(n, dtype, rank, n)):
                    failures.append("ring_reduce_scatter modified its input")
            # reduce to every root (beyond 4 ranks: the first, a middle and the last one;
            # test_collectives_properties draws other roots at random)
            roots = range(world) if world <= 4 else sorted({0, world // 2, world - 1})
            for dst in roots:
                want = x.clone()
                dist.reduce(want, dst)
                got = C.tree_reduce(x.clone(), dst=dst)
                if rank == dst and not torch.equal(got, want):
                    fail(f"tree_reduce {dtype} n={n} dst={dst}", got, want)
            # broadcast from every root (as above)
            for src in roots:
                want = x.clone()
                dist.broadcast(want, src)
                for name, fn in [("tree", C.tree_broadcast), ("linear", C.linear_broadcast)]:
                    got = fn(x.clone(), src=src)
                    if not torch.equal(got, want):
                        fail(f"{name}_broadcast {dtype} n={n} src={src}", got, want)
            # all-gather
            shaped = x[: (n // 2) * 2].reshape(-1, 2) if n >= 2 else x
            want = [torch.empty_like(shaped) for _ in range(world)]
            dist.all_gather(want, shaped)
            got = C.ring_all_gather(shaped)
            same = len(got) == world and all(
                torch.equal(g, w) for g, w in zip(got, want, strict=True)
            )
            if not same:
                failures.append(f"rank {rank}: ring_all_gather {dtype} n={n} differs")

    # random floats: equal up to the rounding of a different summation order
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 333, generator=g).to(runtime.device())
    want = x.clone()
    dist.all_reduce(want)
    for fn in (C.ring_all_reduce, C.tree_all_reduce, C.naive_all_reduce):
        got = fn(x.clone())
        # float32 sums of up to 8 values of size ~1: rounding below 1e-5. On CUDA too: each
        # step is a correctly rounded float32 add there as here, only the order differs.
        try:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        except AssertionError as exc:
            failures.append(f"rank {rank}: {fn.__name__} on random floats: {exc}")
    return failures


@pytest.mark.parametrize(
    "world_size", [1, 2, 3, 4, *(pytest.param(n, marks=pytest.mark.slow) for n in (5, 6, 7, 8))]
)
def test_collectives_equal_torch_distributed(world_size):
    results = run_ranks(compare_everything, world_size, world_size, timeout=600)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------------------- traffic counts
def traffic_of_each(world: int, n: int) -> dict:
    rank = dist.get_rank()
    out = {}
    for name, fn in [
        ("ring", C.ring_all_reduce),
        ("naive", C.naive_all_reduce),
        ("tree", C.tree_all_reduce),
        ("tree_broadcast", C.tree_broadcast),
        ("linear_broadcast", C.linear_broadcast),
    ]:
        x = torch.ones(n, device=runtime.device())
        dist.barrier()
        with C.count_traffic() as t:
            fn(x, check_shapes=False)
        out[name] = (t.bytes_sent, t.bytes_received, t.messages_sent)
    return {"rank": rank, **out}


@pytest.mark.parametrize("world_size,n", [(2, 1000), (3, 1001), (4, 4096), (5, 7)])
def test_bytes_sent_match_the_formulas(world_size, n):
    results = run_ranks(traffic_of_each, world_size, world_size, n)
    total = 4 * n  # float32
    chunk = [4 * (e - s) for s, e in chunk_bounds(n, world_size)]
    rounds = C.tree_rounds(world_size)
    for r, res in enumerate(results):
        # ring: every chunk but one in each phase. Rank r sends all but chunk r (reduce-scatter)
        # and all but chunk r+1 (all-gather); it receives all but r-1, then all but r.
        sent = (total - chunk[r]) + (total - chunk[(r + 1) % world_size])
        received = (total - chunk[(r - 1) % world_size]) + (total - chunk[r])
        assert res["ring"][:2] == (sent, received)
        if n % world_size == 0:
            assert res["ring"][0] == 2 * (world_size - 1) * total // world_size
        # naive: everything goes through rank 0
        if r == 0:
            assert res["naive"][:2] == ((world_size - 1) * total, (world_size - 1) * total)
        else:
            assert res["naive"][:2] == (total, total)
        # broadcasts: N-1 messages in all; the root sends log2(N) of them in the tree
        assert res["linear_broadcast"][2] == (world_size - 1 if r == 0 else 0)
        if r == 0:
            assert res["tree_broadcast"][2] == rounds
    assert sum(res["tree_broadcast"][2] for res in results) == world_size - 1
    assert sum(res["tree_broadcast"][1] for res in results) == (world_size - 1) * total


# ------------------------------------------------------------------------------- bad input
def test_without_a_process_group_says_how_to_run():
    with pytest.raises(RuntimeError, match="run_ranks"):
        C.ring_all_reduce(torch.ones(3))


def bad_inputs() -> list[str]:
    rank, dev = dist.get_rank(), runtime.device()
    messages = []
    for call in [
        lambda: C.ring_all_reduce(torch.ones(4, 4, device=dev).t()),  # not contiguous
        lambda: C.ring_all_reduce(torch.ones(3, dtype=torch.int64, device=dev), op="mean"),
        lambda: C.ring_all_reduce(torch.ones(3, device=dev), op="prod"),
        lambda: C.tree_broadcast(torch.ones(3, device=dev), src=5),
        lambda: C.ring_all_reduce(torch.ones(3 + rank, device=dev)),  # sizes differ across ranks
        lambda: C.ring_all_reduce(
            torch.ones(3, dtype=torch.float64 if rank else torch.float32, device=dev)
        ),
    ]:
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    return messages


def test_bad_input_gives_clear_errors_on_every_rank():
    for messages in run_ranks(bad_inputs, 2):
        assert "not contiguous" in messages[0] and "contiguous()" in messages[0]
        assert "op='mean'" in messages[1] and "op='sum'" in messages[1]
        assert "op must be one of" in messages[2]
        assert "root rank must be in [0, 1]" in messages[3]
        assert "same size" in messages[4]
        assert "same dtype" in messages[5]
    rank0, rank1 = (m[4] for m in run_ranks(bad_inputs, 2))
    assert "rank 0 has a torch.float32 tensor of shape (3,)" in rank0
    assert "rank 1, has a torch.float32 tensor of shape (4,)" in rank0
    assert "rank 1 has a torch.float32 tensor of shape (4,)" in rank1


def no_library_collective() -> list[str]:
    """Every library collective raises here: ours, shape check included, must not need one."""
    from dpcourse.collectives.p2p import posts_ahead
    from dpcourse.harness.patching import library_collectives_forbidden

    problems = []
    x = torch.arange(7.0, device=runtime.device())
    with library_collectives_forbidden():
        for name, call in [
            ("ring", lambda: C.ring_all_reduce(x.clone())),
            ("ring step by step", lambda: C.ring_all_reduce(x.clone(), post_ahead=False)),
            ("ring posted ahead", lambda: C.ring_all_reduce_posted_ahead(x.clone())),
            ("tree", lambda: C.tree_all_reduce(x.clone())),
            ("naive", lambda: C.naive_all_reduce(x.clone())),
            ("reduce-scatter", lambda: C.ring_reduce_scatter(x)),
            ("all-gather", lambda: C.ring_all_gather(x)),
            ("broadcast", lambda: C.tree_broadcast(x.clone())),
        ]:
            try:
                call()
                if name == "ring posted ahead" and not posts_ahead():
                    problems.append(f"{name}: ran on NCCL, which it must refuse")
            except AssertionError as exc:
                problems.append(f"{name}: {exc}")
            except ValueError as exc:  # NCCL refuses receives posted ahead, before any message
                if not (name == "ring posted ahead" and not posts_ahead()):
                    raise
                if "cannot run on NCCL" not in str(exc):
                    problems.append(f"{name}: {exc}")
    return problems


def test_no_library_collective_is_called_not_even_for_the_shape_check():
    assert run_ranks(no_library_collective, 3) == [[], [], []]


def test_an_error_inside_a_collective_names_the_rank():
    def mismatched_without_check():
        rank = dist.get_rank()
        # check_shapes=False: the sizes differ and nothing catches it before the messages fly
        if rank == 1:
            raise RuntimeError("rank 1 gives up before the ring starts")
        C.ring_all_reduce(torch.ones(10, device=runtime.device()), check_shapes=False)

    with pytest.raises(RankError) as info:
        run_ranks(mismatched_without_check, 3, timeout=30)
    assert info.value.rank == 1


# ------------------------------------------------------------------------------------- GPU
def on_cuda(backend_ok: str) -> bool:
    rank = dist.get_rank()
    device = runtime.device()
    x = torch.arange(10, dtype=torch.float32, device=device) * (rank + 1)
    want = x.clone()
    dist.all_reduce(want)
    got = C.ring_all_reduce(x.clone())
    b = C.tree_broadcast(x.clone(), src=0)
    return (
        got.device.type == "cuda"
        and torch.equal(got, want)
        and torch.equal(b.cpu(), torch.arange(10, dtype=torch.float32))
    )


@pytest.mark.gpu
def test_ring_on_cuda_with_gloo_shares_one_gpu():
    assert all(run_ranks(on_cuda, 3, "gloo", backend="gloo"))


@pytest.mark.gpu
def test_ring_on_cuda_with_nccl_world_size_one():
    assert all(run_ranks(on_cuda, 1, "nccl", backend="nccl"))


@pytest.mark.multigpu
def test_ring_on_cuda_with_nccl():
    assert all(run_ranks(on_cuda, 2, "nccl"))


def ring_both_ways(ahead: bool) -> bool:
    """The ring with receives posted ahead (gloo, MPI) and step by step (what NCCL runs),
    chosen here on gloo so that the NCCL path is tested without GPUs (NCCL refuses the
    receives posted ahead: the test passes backend="gloo")."""
    ok = []
    for n in (0, 1, 3, 13, 50, 101, 1000):
        for op in ("sum", "max"):
            x = torch.randint(-9, 10, (n,)).float().to(runtime.device())
            want = x.clone()
            dist.all_reduce(want, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
            with C.count_traffic() as t:
                got = C.ring_all_reduce(x.clone(), op, post_ahead=ahead)
            if ahead:  # the variant on its own, as chapter 6 shows it
                ok.append(torch.equal(C.ring_all_reduce_posted_ahead(x.clone(), op), got))
            chunks = [e - s for s, e in chunk_bounds(n, dist.get_world_size())]
            r = dist.get_rank()
            expected_bytes = 4 * ((n - chunks[r]) + (n - chunks[(r + 1) % len(chunks)]))
            ok.append(torch.equal(got, want) and t.bytes_sent == expected_bytes)
    return all(ok)


@pytest.mark.parametrize("ahead", [True, False], ids=["posted-ahead", "step-by-step"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_both_ways_of_running_the_ring_equal_the_library_and_send_the_same_bytes(
    world_size, ahead
):
    assert all(run_ranks(ring_both_ways, world_size, ahead, backend="gloo"))


def _counted_from_another_thread() -> int:
    import threading

    from dpcourse import runtime
    from dpcourse.collectives import count_traffic, p2p

    peer = 1 - dist.get_rank()
    x = torch.ones(10, device=runtime.device())

    def backward_thread():  # a thread that never counted, as autograd's device thread on a GPU
        p2p.exchange(x.clone(), peer, torch.empty_like(x), peer)

    with count_traffic() as traffic:
        worker = threading.Thread(target=backward_thread)
        worker.start()
        worker.join()
    return traffic.bytes_sent


def test_messages_from_a_thread_that_never_counted_count_for_the_rank():
    """On the H200, chapter 9's FSDP step counted a third of its bytes: on a GPU autograd runs
    the backward hooks, which launch FSDP's collectives, on a thread of its own."""
    assert run_ranks(_counted_from_another_thread, 2) == [40, 40]
