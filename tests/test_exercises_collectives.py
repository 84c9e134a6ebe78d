"""Chapters 5 and 6's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dpcourse import collectives as C
from dpcourse.harness.exercises import ch05, ch06, run_check


def linear_broadcast(t, src):
    C.linear_broadcast(t, src=src)


def tree_from_rank_zero_only(t, src):
    C.tree_broadcast(t, src=0)  # ignores the root it was given


def ring_for_multiples_only(t):
    """A ring whose chunks are n // N long: the last n % N values are never reduced."""
    r, n = dist.get_rank(), dist.get_world_size()
    k = t.numel() // n
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        si, ri = (r - s) % n, (r - s - 1) % n
        buf = torch.empty(k, device=t.device)
        req = dist.irecv(buf, left)
        dist.send(t[si * k : (si + 1) * k].clone(), right)
        req.wait()
        t[ri * k : (ri + 1) * k] += buf
    for s in range(n - 1):
        si, ri = (r - s + 1) % n, (r - s) % n
        buf = torch.empty(k, device=t.device)
        req = dist.irecv(buf, left)
        dist.send(t[si * k : (si + 1) * k].clone(), right)
        req.wait()
        t[ri * k : (ri + 1) * k] = buf


def ring_that_deadlocks(t):
    """Every rank sends first, blocking, and receives after: nobody is receiving."""
    r, n = dist.get_rank(), dist.get_world_size()
    dist.send(t, (r + 1) % n)
    buf = torch.empty_like(t)
    dist.recv(buf, (r - 1) % n)
    t += buf


def mean_instead_of_sum(t):
    C.ring_all_reduce(t, op="mean")


def returns_instead_of_in_place(t):
    return C.ring_all_reduce(t.clone())


@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setattr(ch05, "RANK_TIMEOUT", 8.0)
    monkeypatch.setattr(ch06, "RANK_TIMEOUT", 8.0)


def test_tree_broadcast_check():
    assert run_check("ex-5-tree-broadcast", lambda t, s: C.tree_broadcast(t, src=s)).passed
    result = run_check("ex-5-tree-broadcast", linear_broadcast)
    assert not result.passed and "the root sent 3 messages" in result.message
    assert "ceil(log2 4) = 2" in result.message
    result = run_check("ex-5-tree-broadcast", tree_from_rank_zero_only)
    assert not result.passed and "root 1" in result.message and "rank 1's value" in result.message


def test_ring_check_passes_the_reference_and_fails_wrong_rings(short_timeouts):
    assert run_check("ex-6-ring", C.ring_all_reduce).passed
    result = run_check("ex-6-ring", ring_for_multiples_only)
    assert not result.passed and "not a multiple of 4" in result.message
    result = run_check("ex-6-ring", mean_instead_of_sum)
    assert not result.passed and "mean where a sum" in result.message
    result = run_check("ex-6-ring", returns_instead_of_in_place)
    assert not result.passed and "not changed in place" in result.message


@pytest.mark.slow
def test_ring_check_stops_a_deadlock_and_shows_where(short_timeouts):
    result = run_check("ex-6-ring", ring_that_deadlocks)
    assert not result.passed
    assert "did not finish within 8 s" in result.message and "deadlock" in result.message
    assert (
        "in ring_that_deadlocks" in result.message and "dist.send(t, (r + 1) % n)" in result.message
    )


def test_rounds_and_bytes_checks():
    import math

    assert run_check("ex-5-rounds", lambda n: math.ceil(math.log2(n)) if n > 1 else 0).passed
    result = run_check("ex-5-rounds", lambda n: math.floor(math.log2(n)) + 1)
    assert not result.passed and "power of two" in result.message
    result = run_check("ex-5-rounds", lambda n: n - 1)
    assert not result.passed and "that is the line" in result.message
    assert run_check("ex-6-bytes", lambda b, n: 2 * (n - 1) * b // n).passed
    result = run_check("ex-6-bytes", lambda b, n: (n - 1) * b // n)
    assert not result.passed and "one phase" in result.message
    result = run_check("ex-6-bytes", lambda b, n: 2 * (n - 1) * b)
    assert not result.passed and "1/N of the data" in result.message


# ------------------------------------------- answers that a result alone cannot tell apart
def library_broadcast(t, src):
    dist.broadcast(t, src)


def relay_broadcast(t, src):
    """Right result, N-1 rounds: each rank passes the data to the next."""
    r, n = dist.get_rank(), dist.get_world_size()
    v = (r - src) % n
    if v > 0:
        dist.recv(t, (r - 1) % n)
    if v < n - 1:
        dist.send(t, (r + 1) % n)


def library_all_reduce(t):
    dist.all_reduce(t)


def library_reduce_scatter_then_all_gather(t):
    """The ring's two phases, each one library call (torch 2.13's reduce_scatter_single and
    all_gather_single where this torch has them, else the floor's _tensor forms), on a length
    the ranks divide."""
    n = dist.get_world_size()
    part = torch.empty(t.numel() // n, dtype=t.dtype, device=t.device)
    getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(
        part, t[: part.numel() * n].clone())
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(t[: part.numel() * n], part)


def gather_to_rank_zero(t):
    """Right result, the naive all-reduce: every rank sends to rank 0, which sends the sum back."""
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        for peer in range(1, n):
            buf = torch.empty_like(t)
            dist.recv(buf, peer)
            t += buf
        for peer in range(1, n):
            dist.send(t, peer)
    else:
        dist.send(t, 0)
        dist.recv(t, 0)


def ring_of_whole_tensors(t):
    """Right result, neighbours only, but the whole tensor around the ring N-1 times."""
    r, n = dist.get_rank(), dist.get_world_size()
    passing = t.clone()
    for _ in range(n - 1):
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.irecv, buf, (r - 1) % n),
               dist.P2POp(dist.isend, passing, (r + 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        t += buf
        passing = buf


def test_the_checks_reject_the_library_a_relay_and_a_gather(short_timeouts):
    result = run_check("ex-5-tree-broadcast", library_broadcast)
    assert not result.passed and "torch.distributed's collectives" in result.message
    result = run_check("ex-5-tree-broadcast", relay_broadcast)
    assert not result.passed and "relay of N-1 rounds" in result.message
    result = run_check("ex-6-ring", library_all_reduce)
    assert not result.passed and "torch.distributed's collectives" in result.message
    result = run_check("ex-6-ring", library_reduce_scatter_then_all_gather)
    assert not result.passed and "torch.distributed's collectives" in result.message
    result = run_check("ex-6-ring", gather_to_rank_zero)
    assert not result.passed and "only to its right neighbour" in result.message
    result = run_check("ex-6-ring", ring_of_whole_tensors)
    assert not result.passed and "not the whole of it" in result.message


def test_the_overlap_exercise_solution_runs_and_times_with_the_device_clock(capsys):
    """ex-5-overlap's solution (a code block in the notebook's text, so nbval does not run it):
    it runs, and times with dpcourse.timing.DeviceClock, not the host's clock alone."""
    import json
    import re
    from pathlib import Path

    from dpcourse.harness.launch import run_ranks

    notebook = Path(__file__).resolve().parents[1] / "chapters" / "05_collectives.ipynb"
    text = next(
        "".join(c["source"])
        for c in json.loads(notebook.read_text())["cells"]
        if "{solution} ex-5-overlap" in "".join(c["source"])
    )
    solution = text[text.index("{solution} ex-5-overlap"):]
    code = re.search(r"```python\n(.*?)```", solution, re.S).group(1)
    assert "DeviceClock" in code and "perf_counter" not in code
    namespace = {"__name__": "ex_5_overlap", "torch": torch, "dist": dist,
                 "run_ranks": run_ranks}
    exec(compile(code, "ex-5-overlap solution", "exec"), namespace)
    blocking, overlapped = (float(v) for v in capsys.readouterr().out.split())
    assert blocking > 0 and overlapped > 0


# ------------------------------------------------ the wrong answers students write (issue 43)
def _tree(t, src, receive):
    rank, world = dist.get_rank(), dist.get_world_size()
    v, step = (rank - src) % world, 1
    while step < world:
        if v < step and v + step < world:
            dist.send(t, (v + step + src) % world)
        elif step <= v < 2 * step:
            receive(t, (v - step + src) % world)
        step *= 2


def tree_into_a_float_buffer(t, src):
    """Kind 1 (dtype, shape): receives into a 1-D float32 buffer on the tensor's device."""

    def receive(t, peer):
        buf = torch.empty(t.numel(), device=t.device)
        dist.recv(buf, peer)
        t.copy_(buf.view_as(t))

    _tree(t, src, receive)


def tree_into_a_host_buffer(t, src):
    """Kind 3: receives into a buffer made on the CPU, then adds it where the tensor is."""

    def receive(t, peer):
        buf = torch.zeros(t.shape, dtype=t.dtype)
        dist.recv(buf, peer)
        t.mul_(0).add_(buf)

    _tree(t, src, receive)


def test_tree_broadcast_rejects_what_students_write(short_timeouts, rejects):
    rejects("ex-5-tree-broadcast", tree_into_a_float_buffer, "raised TypeError",
                "dist.recv of a torch.float32 tensor", "torch.float64")
    rejects("ex-5-tree-broadcast", tree_into_a_host_buffer, "on a machine with GPUs",
                "add_() got host tensor")


def _ring(t, slicing=False, buffer=None):
    """A ring with chapter 6's schedule; ``slicing`` cuts the tensor along dim 0 instead of a
    flat view; ``buffer(k, flat)`` makes the receive buffers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = t if slicing else t.view(-1)
    n = flat.shape[0]
    bounds = [(len(c) and c[0].item(), len(c) and c[-1].item() + 1)
              for c in torch.tensor_split(torch.arange(n), world)]
    right, left = (rank + 1) % world, (rank - 1) % world
    make = buffer or (lambda k, flat: flat.new_empty((k, *flat.shape[1:])))

    def exchange(send, receive):
        ops = [dist.P2POp(dist.irecv, receive, left)] if receive.numel() else []
        ops += [dist.P2POp(dist.isend, send, right)] if send.numel() else []
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()

    for step in range(world - 1):
        s0, s1 = bounds[(rank - step - 1) % world]
        r0, r1 = bounds[(rank - step - 2) % world]
        incoming = make(r1 - r0, flat)
        exchange(flat[s0:s1].clone(), incoming)
        flat[r0:r1] += incoming
    for step in range(world - 1):
        s0, s1 = bounds[(rank - step) % world]
        r0, r1 = bounds[(rank - step - 1) % world]
        incoming = make(r1 - r0, flat)
        exchange(flat[s0:s1].clone(), incoming)
        flat[r0:r1] = incoming


def ring_slicing_rows(t):
    """Kind 1 (shape): chunks of the tensor's rows, right for a 1-D tensor only."""
    _ring(t, slicing=True)


def ring_float32_buffers(t):
    """Kind 1 (dtype): receive buffers made with torch.empty(k, device=...), float32."""
    _ring(t, buffer=lambda k, flat: torch.empty(k, device=flat.device))


def ring_host_buffers(t):
    """Kind 3: receive buffers of the right dtype made on the CPU."""
    _ring(t, buffer=lambda k, flat: torch.empty(k, dtype=flat.dtype))


def ring_on_a_flat_copy(t):
    """Kind 2: reduces a flattened copy, written back only when the tensor is 1-D (where
    reshape gives a view)."""
    flat = t.reshape(-1).clone() if t.dim() > 1 else t
    _ring(flat)


def test_ring_rejects_what_students_write(short_timeouts, rejects):
    rejects("ex-6-ring", ring_slicing_rows, "(2x7, bfloat16)", "send chunks of the tensor")
    rejects("ex-6-ring", ring_float32_buffers, "irecv of a torch.float32 tensor",
                "tensor of shape (5, 6), torch.float64")
    rejects("ex-6-ring", ring_host_buffers, "on a machine with GPUs",
                "got host tensor(s)")
    rejects("ex-6-ring", ring_on_a_flat_copy, "(5x6, float64)",
                "the tensor was not changed at all")
