"""Chapter 9's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.harness import device_audit
from dpcourse.harness.exercises import ch09, run_check
from dpcourse.sharding import flat_shards, zero_memory


def remainder_to_last(numel, world_size, rank):
    k = numel // world_size
    return rank * k, numel if rank == world_size - 1 else (rank + 1) * k


def ceil_slices(numel, world_size, rank):
    k = -(-numel // world_size)
    return min(rank * k, numel), min((rank + 1) * k, numel)


def ceil_slices_past_the_end(numel, world_size, rank):
    k = -(-numel // world_size)
    return rank * k, (rank + 1) * k


def test_shard_bounds_check():
    assert run_check("ex-9-shard-bounds", flat_shards.shard_bounds).passed
    result = run_check("ex-9-shard-bounds", remainder_to_last)
    assert not result.passed and "whole remainder" in result.message
    assert "numel=10, world_size=4, rank 0: expected (0, 3), got (0, 2)" in result.message
    result = run_check("ex-9-shard-bounds", ceil_slices)
    assert not result.passed and "differ by at most one element" in result.message
    result = run_check("ex-9-shard-bounds", ceil_slices_past_the_end)
    assert not result.passed and "run past the end" in result.message
    result = run_check("ex-9-shard-bounds", lambda n, w, r: None)
    assert not result.passed and "expected a pair (start, end)" in result.message


def test_zero_memory_check():
    assert run_check("ex-9-memory", zero_memory.zero_memory_per_rank).passed
    # floats are fine: the formula with / instead of integer division

    def with_floats(psi, n, stage, k=12):
        replicated, sharded = {0: (4 + k, 0), 1: (4, k), 2: (2, 2 + k), 3: (0, 4 + k)}[stage]
        return replicated * psi + sharded * psi / n

    assert run_check("ex-9-memory", with_floats).passed

    def forgets_fp16_params(psi, n, stage, k=12):
        fp16_params = 2 * psi if stage in (1, 2) else 0
        return zero_memory.zero_memory_per_rank(psi, n, stage, k) - fp16_params

    result = run_check("ex-9-memory", forgets_fp16_params)
    assert not result.passed and "2Ψ short" in result.message

    def stage2_is_stage1(psi, n, stage, k=12):
        return zero_memory.zero_memory_per_rank(psi, n, 1 if stage == 2 else stage, k)

    result = run_check("ex-9-memory", stage2_is_stage1)
    assert not result.passed and "stage 2 shards the gradients" in result.message

    def k_sixteen(psi, n, stage, k=12):
        return zero_memory.zero_memory_per_rank(psi, n, stage, 16)

    result = run_check("ex-9-memory", k_sixteen)
    assert not result.passed and "master weights" in result.message
    assert "expected 120,000,000,000 bytes, got 150,000,000,000" in result.message


def _gather(flat_params):
    """All-gather the shards in place, one broadcast per owner (simple, not fast)."""
    world = dist.get_world_size()
    for owner in range(world):
        s, e = flat_shards.shard_bounds(flat_params.numel(), world, owner)
        if e > s:
            piece = flat_params[s:e].clone()
            dist.broadcast(piece, src=owner)
            flat_params[s:e] = piece


def reference_sharded_step(flat_params, flat_grad, step_fn):
    from dpcourse.collectives import ring_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = flat_shards.shard_bounds(flat_params.numel(), world, rank)
    step_fn(flat_params[start:end], ring_reduce_scatter(flat_grad, op="mean"))
    _gather(flat_params)


def sum_not_mean(flat_params, flat_grad, step_fn):
    from dpcourse.collectives import ring_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = flat_shards.shard_bounds(flat_params.numel(), world, rank)
    step_fn(flat_params[start:end], ring_reduce_scatter(flat_grad, op="sum"))
    _gather(flat_params)


def no_all_gather(flat_params, flat_grad, step_fn):
    from dpcourse.collectives import ring_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = flat_shards.shard_bounds(flat_params.numel(), world, rank)
    step_fn(flat_params[start:end], ring_reduce_scatter(flat_grad, op="mean"))


def whole_tensor_step(flat_params, flat_grad, step_fn):
    from dpcourse.collectives import ring_all_reduce

    step_fn(flat_params, ring_all_reduce(flat_grad, op="mean"))


@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setattr(ch09, "RANK_TIMEOUT", 20.0)


def test_sharded_step_check(short_timeouts):
    assert run_check("ex-9-sharded-step", reference_sharded_step).passed
    result = run_check("ex-9-sharded-step", sum_not_mean)
    assert not result.passed and "divide by the world size" in result.message
    result = run_check("ex-9-sharded-step", no_all_gather)
    assert not result.passed and "all-gather the updated shards" in result.message
    result = run_check("ex-9-sharded-step", whole_tensor_step)
    assert not result.passed and "That is the whole tensor" in result.message


def test_sharded_step_check_reports_a_raising_rank(short_timeouts):
    def raises(flat_params, flat_grad, step_fn):
        raise ValueError("oops")

    result = run_check("ex-9-sharded-step", raises)
    assert not result.passed and "ValueError: oops" in result.message


def test_sharded_step_not_attempted():
    def stub(flat_params, flat_grad, step_fn):
        raise NotImplementedError("write it")

    assert run_check("ex-9-sharded-step", stub).status == "not attempted"


# ------------------------------------------------------------------- ZeRO-2 during backward
def _rank_chunks_padded(grad, world):
    """Rank r's shard_bounds chunk of ``grad`` in part r of a flat buffer, each padded to the
    longest (reduce_scatter_tensor hands out equal parts)."""
    bounds = [flat_shards.shard_bounds(grad.numel(), world, r) for r in range(world)]
    longest = max(e - s for s, e in bounds)
    send = grad.new_zeros(world * longest)
    for r, (s, e) in enumerate(bounds):
        send[r * longest : r * longest + e - s] = grad[s:e]
    return send, longest, bounds


def _hooks(params, launch, free=True):
    """Register ``launch(p) -> (handle, output, shard numel)`` on every parameter; ``finish``
    waits and returns the averaged shards in order."""
    world = dist.get_world_size()
    pending = {}

    def hook(p, i):
        pending[i] = launch(p)
        if free:
            p.grad = None

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: hook(p, i))

    def finish():
        shards = []
        for i in range(len(params)):
            handle, out, n = pending.pop(i)
            if handle is not None:
                handle.wait()
            shards.append(out[:n] / world)
        return shards

    return finish


def _reduce_scatter(p):
    rank, world = dist.get_rank(), dist.get_world_size()
    send, longest, bounds = _rank_chunks_padded(p.grad.detach().reshape(-1), world)
    out = send.new_empty(longest)
    start, end = bounds[rank]
    return dist.reduce_scatter_tensor(out, send, async_op=True), out, end - start


def reference_zero2_hooks(params):
    return _hooks(params, _reduce_scatter)


def waits_in_the_hook(params):
    """Launches asynchronously, then waits at once in the hook: nothing overlaps."""

    def launch(p):
        handle, out, n = _reduce_scatter(p)
        handle.wait()
        return handle, out, n

    return _hooks(params, launch)


def blocking_in_the_hook(params):
    """dist.reduce_scatter_tensor without async_op=True: it returns once done, in the hook."""

    def launch(p):
        rank, world = dist.get_rank(), dist.get_world_size()
        send, longest, bounds = _rank_chunks_padded(p.grad.detach().reshape(-1), world)
        out = send.new_empty(longest)
        dist.reduce_scatter_tensor(out, send)
        start, end = bounds[rank]
        return None, out, end - start

    return _hooks(params, launch)


def ring_zero2_hooks(params):  # the package's ring, synchronous: it blocks backward
    from dpcourse.collectives import ring_reduce_scatter

    world = dist.get_world_size()

    def launch(p):
        grad = p.grad.detach().reshape(-1)
        return None, ring_reduce_scatter(grad, op="sum"), grad.tensor_split(world)[
            dist.get_rank()].numel()

    return _hooks(params, launch)


def all_reduce_then_slice(params):
    def launch(p):
        rank, world = dist.get_rank(), dist.get_world_size()
        grad = p.grad.detach().reshape(-1).clone()
        start, end = flat_shards.shard_bounds(grad.numel(), world, rank)
        return dist.all_reduce(grad, async_op=True), grad[start:], end - start

    return _hooks(params, launch)


def ring_all_reduce_then_slice(params):
    def launch(p):
        from dpcourse.collectives import ring_all_reduce

        rank, world = dist.get_rank(), dist.get_world_size()
        grad = p.grad.detach().reshape(-1).clone()
        ring_all_reduce(grad)
        start, end = flat_shards.shard_bounds(grad.numel(), world, rank)
        return None, grad[start:], end - start

    return _hooks(params, launch)


def after_backward(params):
    """Reduce-scatters everything in finish(), once backward has returned (stage 1's timing)."""
    world = dist.get_world_size()

    def finish():
        shards = []
        for p in params:
            handle, out, n = _reduce_scatter(p)
            handle.wait()
            shards.append(out[:n] / world)
            p.grad = None
        return shards

    return finish


def all_at_the_last_hook(params):
    """One bucket of everything, launched when the last gradient is ready."""
    world, ready, pending = dist.get_world_size(), [], []

    def hook(p):
        ready.append(p)
        if len(ready) == len(params):
            for q in params:
                pending.append(_reduce_scatter(q))
                q.grad = None

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for handle, _, _ in pending:
            handle.wait()
        return [out[:n] / world for _, out, n in pending]

    return finish


def zero2_sum_not_mean(params):
    finish = reference_zero2_hooks(params)
    return lambda: [s * dist.get_world_size() for s in finish()]


def keeps_full_gradient(params):
    return _hooks(params, _reduce_scatter, free=False)


def frees_at_the_end(params):
    finish = keeps_full_gradient(params)

    def finish_and_free():
        shards = finish()
        for p in params:
            p.grad = None
        return shards

    return finish_and_free


def padded_at_the_end(params):
    """torch's equal chunks: the gradient padded at its end to N * ceil(numel / N)."""

    def launch(p):
        rank, world = dist.get_rank(), dist.get_world_size()
        grad = p.grad.detach().reshape(-1)
        c = -(-grad.numel() // world)
        padded = grad.new_zeros(world * c)
        padded[: grad.numel()] = grad
        out = grad.new_empty(c)
        start, end = flat_shards.shard_bounds(grad.numel(), world, rank)
        return dist.reduce_scatter_tensor(out, padded, async_op=True), out, end - start

    return _hooks(params, launch)


def test_zero2_check_passes_the_reference(short_timeouts):
    result = run_check("ex-9-zero2", reference_zero2_hooks)
    assert result.passed, result.text()


@pytest.mark.parametrize("wrong, phrases", [
    (all_reduce_then_slice, ["you called dist.all_reduce", "an all-reduce twice that"]),
    (ring_all_reduce_then_slice, ["you called collectives.ring_all_reduce"]),
    (after_backward, ["every reduce-scatter started after backward had returned"]),
    (all_at_the_last_hook, ["only once all 6 gradients were ready"]),
    (zero2_sum_not_mean, ["the sum over the 2 ranks: divide by the world size"]),
    (waits_in_the_hook, ["parameter 5's dist.reduce_scatter_tensor was waited on inside "
                         "backward (in launch): waiting there blocks backward until the "
                         "communication is done, so nothing overlaps",
                         "wait for it in finish()"]),
    (blocking_in_the_hook, ["parameter 5's dist.reduce_scatter_tensor was called without "
                            "async_op=True inside backward (in launch)", "async_op=True"]),
    (ring_zero2_hooks, ["parameter 5's collectives.ring_reduce_scatter was called inside "
                        "backward (in launch), and it has no async_op"]),
    (keeps_full_gradient, ["p.grad of parameters [0, 1, 2, 3, 4, 5] still holds the full "
                           "gradient"]),
    (frees_at_the_end, ["all 6 full gradients were still held"]),
    (padded_at_the_end, ["equal chunks of ceil(7/3)", "this rank's shard is shard_bounds"]),
])
def test_zero2_check_rejects(short_timeouts, wrong, phrases):
    result = run_check("ex-9-zero2", wrong)
    assert result.status == "failed", result.text()
    for phrase in phrases:
        assert phrase in result.message, f"{phrase!r} not in: {result.message}"


def test_zero2_not_attempted():
    def stub(params):
        raise NotImplementedError("write it")

    assert run_check("ex-9-zero2", stub).status == "not attempted"


# ------------------------------------------------------------------------------ FSDP
def flat_chunks(shapes, world):  # ZeRO's flat split of the layer's elements
    from dpcourse.collectives.ops import chunk_bounds

    total = sum(math.prod(s) for s in shapes)
    return [e - s for s, e in chunk_bounds(total, world)]


def leftover_rows_to_last(shapes, world):
    sizes = [0] * world
    for rows, *rest in shapes:
        for k in range(world):
            sizes[k] += (rows // world + (rows % world if k == world - 1 else 0)) * math.prod(rest)
    return sizes


def test_fsdp_chunks_check():
    from dpcourse.sharding.fsdp_layer import gather_chunk_numels

    assert run_check("ex-9-fsdp-chunks", gather_chunk_numels).passed
    result = run_check("ex-9-fsdp-chunks", flat_chunks)
    assert not result.passed and "cuts each parameter by rows" in result.message
    result = run_check("ex-9-fsdp-chunks", leftover_rows_to_last)
    assert not result.passed and "every leftover row" in result.message
    result = run_check("ex-9-fsdp-chunks", lambda shapes, w: [s[0] for s in shapes][:w])
    assert not result.passed


def test_fsdp_order_check():
    from dpcourse.harness.exercises.ch09 import BACKWARD_STEPS

    right = list(BACKWARD_STEPS)
    assert run_check("ex-9-fsdp-order", lambda: right).passed
    also_right = [right[0], right[1], right[4], right[2], right[3]]  # free parameters first
    assert run_check("ex-9-fsdp-order", lambda: also_right).passed
    early_free = [right[0], right[4], right[1], right[2], right[3]]
    result = run_check("ex-9-fsdp-order", lambda: early_free)
    assert not result.passed and "before backward has used them" in result.message
    grads_gone = [right[0], right[1], right[3], right[2], right[4]]
    result = run_check("ex-9-fsdp-order", lambda: grads_gone)
    assert not result.passed and "before the reduce-scatter has sent them" in result.message
    result = run_check("ex-9-fsdp-order", lambda: right[:4])
    assert not result.passed and "each of" in result.message


# ------------------------------------------------ the wrong answers students write (issue 43)
def zero_memory_for_adam_only(psi, n, stage, k=12):
    """Kind 1, a default never varied: K = 12 whatever k is given."""
    return zero_memory.zero_memory_per_rank(psi, n, stage)


def test_zero_memory_uses_the_k_it_is_given(rejects):
    rejects("ex-9-memory", zero_memory_for_adam_only, "k = 4",
                "That is the answer for K = 12")


def _step_then_gather(flat_params, shard_grad, step_fn):
    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = flat_shards.shard_bounds(flat_params.numel(), world, rank)
    step_fn(flat_params[start:end], shard_grad)
    _gather(flat_params)


def all_reduce_then_slice_step(flat_params, flat_grad, step_fn):
    """Kind 2: the right shard of the mean, through an all-reduce (twice the bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    start, end = flat_shards.shard_bounds(flat_params.numel(), world, rank)
    mean = flat_grad.clone()
    dist.all_reduce(mean)
    _step_then_gather(flat_params, mean[start:end] / world, step_fn)


def dividing_the_gradient_in_place(flat_params, flat_grad, step_fn):
    """Kind 2: the mean, by dividing the caller's gradient in place before a summing
    reduce-scatter."""
    from dpcourse.collectives import ring_reduce_scatter

    flat_grad.div_(dist.get_world_size())
    _step_then_gather(flat_params, ring_reduce_scatter(flat_grad), step_fn)


def _gathering_through(make_piece):
    """A sharded step whose all-gather broadcasts buffers made by ``make_piece(flat, s, e)``."""

    def step(flat_params, flat_grad, step_fn):
        from dpcourse.collectives import ring_reduce_scatter

        rank, world = dist.get_rank(), dist.get_world_size()
        bounds = [flat_shards.shard_bounds(flat_params.numel(), world, r) for r in range(world)]
        start, end = bounds[rank]
        step_fn(flat_params[start:end], ring_reduce_scatter(flat_grad, op="mean"))
        for owner, (s, e) in enumerate(bounds):
            if e > s:
                piece = make_piece(flat_params, s, e)
                dist.broadcast(piece, src=owner)
                flat_params[s:e] = piece

    return step


# kind 1 (dtype): float32 buffers on the right device; kind 3: buffers made on the CPU
gathering_into_float32 = _gathering_through(
    lambda flat, s, e: torch.empty(e - s, device=flat.device).copy_(flat[s:e]))
gathering_through_the_host = _gathering_through(lambda flat, s, e: flat[s:e].cpu())


def _nccl_for_some_world_size() -> bool:
    """Whether a rank of the sharded step's check (2, 3 and 4 ranks) runs NCCL, which refuses
    CPU tensors: the check's own model of a GPU on a CPU, or the machine (or the machine the
    device audit models) where it gives NCCL. Over gloo a CPU buffer in a collective works."""
    if not torch.cuda.is_available() and not device_audit.requested():
        return True
    return any(runtime.choose_backend(n) == "nccl" for n in (2, 3, 4))


def test_sharded_step_rejects_what_students_write(short_timeouts, rejects):
    rejects("ex-9-sharded-step", all_reduce_then_slice_step, "you called dist.all_reduce",
                "twice the bytes")
    rejects("ex-9-sharded-step", dividing_the_gradient_in_place, "changed flat_grad")
    rejects("ex-9-sharded-step", gathering_into_float32, "71 elements in float64",
                "dist.broadcast of a torch.float32 tensor")
    if _nccl_for_some_world_size():
        rejects("ex-9-sharded-step", gathering_through_the_host, "on a machine with GPUs",
                "NCCL, the backend of a GPU per rank, takes GPU tensors only")


def _reduce_scatter_into(make_output):
    def launch(p):
        rank, world = dist.get_rank(), dist.get_world_size()
        send, longest, bounds = _rank_chunks_padded(p.grad.detach().reshape(-1), world)
        out = make_output(longest, send)
        start, end = bounds[rank]
        return dist.reduce_scatter_tensor(out, send, async_op=True), out, end - start

    return launch


def zero2_float32_output(params):
    """Kind 1 (dtype): the output buffer made with torch.empty(n, device=...), float32."""
    return _hooks(params, _reduce_scatter_into(lambda n, send: torch.empty(n, device=send.device)))


def zero2_host_output(params):
    """Kind 3: the output buffer of the right dtype made on the CPU."""
    return _hooks(params, _reduce_scatter_into(lambda n, send: torch.empty(n, dtype=send.dtype)))


def test_zero2_rejects_what_students_write(short_timeouts, rejects):
    rejects("ex-9-zero2", zero2_float32_output, "a float64 model",
                "dist.reduce_scatter_tensor of a torch.float32 tensor")
    if _nccl_for_some_world_size():
        rejects("ex-9-zero2", zero2_host_output, "on a machine with GPUs",
                "dist.reduce_scatter_tensor was given a tensor on the CPU")
