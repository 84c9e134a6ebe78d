"""Checks for chapter 7's exercises (DistributedDataParallel from scratch).

Chapter 7: exercise checks for DistributedDataParallel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dpcourse.exercises.core import Mismatch, call_learner, exercise, run_learner_on_ranks

RANK_TIMEOUT = 30.0  # seconds for one world size; a deadlock ends here


# ------------------------------------------------------------------------------ buckets
def _forward_order(sizes: list[int], cap: float) -> list[list[int]]:
    from dpcourse.buckets import bucket_assignment

    n = len(sizes)
    return [[n - 1 - i for i in b] for b in bucket_assignment(sizes[::-1], cap)]


def _closing_early(sizes: list[int], cap: float) -> list[list[int]]:
    """A plausible wrong rule: close the bucket *before* a parameter that would take it past the
    cap (a parameter larger than the cap alone), so that no bucket exceeds the cap."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(sizes))):
        if current and size + sizes[i] > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += sizes[i]
    return buckets + ([current] if current else [])


BUCKET_CASES = [
    ([4, 4, 4], 100),
    ([4, 4, 4], 8),
    ([640, 128, 4096, 128, 256, 8], 4500),
    ([1, 50, 1, 1], 8),
    ([640, 128, 4096, 128, 256, 8], 300),
    ([8, 8, 8], 8),
    ([4, 4, 4], 0),
    ([], 10),
    ([3, 7, 2, 9, 1, 1, 4, 12, 5], 10),
]


@exercise("ex-7-buckets", function="my_bucket_assignment", timeout=20)
def bucket_assignment(fn: Callable) -> str:
    """``fn(param_bytes, cap_bytes)`` groups parameter indices into buckets like
    :func:`dpcourse.buckets.bucket_assignment` (torch's rule): reverse order, a bucket closes
    once it reaches ``cap_bytes``. Rejects forward order and closing before the cap is reached
    (a rule that keeps every bucket within the cap), saying which it was."""
    from dpcourse.buckets import bucket_assignment as reference

    for sizes, cap in BUCKET_CASES:
        want = reference(sizes, cap)
        got = call_learner(fn, list(sizes), cap)
        where = f"param_bytes={sizes}, cap_bytes={cap}"
        try:
            got = [list(map(int, b)) for b in got]
        except TypeError:
            raise Mismatch(f"{where}: expected a list of lists of indices, got {got!r}") from None
        if got == want:
            continue
        flat = sorted(i for b in got for i in b)
        if flat != list(range(len(sizes))):
            raise Mismatch(
                f"{where}: every parameter must be in exactly one bucket; your "
                f"buckets {got} hold the indices {flat}"
            )
        if got == _forward_order(sizes, cap) and len(sizes) > 1:
            raise Mismatch(
                f"{where}: your buckets {got} start from parameter 0. Backward "
                "produces the last layer's gradients first, so fill buckets from the "
                f"last parameter backwards: expected {want}"
            )
        if [b for b in got if b] == _closing_early(sizes, cap):
            raise Mismatch(
                f"{where}: you got {got}: you close a bucket before a parameter that would "
                "take it past the cap. torch's DDP adds that parameter, then closes the "
                "bucket (a bucket ends once it reaches the cap, so it can exceed the cap by "
                f"its last parameter): expected {want}"
            )
        for b in got[:-1]:
            total = sum(sizes[i] for i in b)
            if total < cap:
                raise Mismatch(
                    f"{where}: bucket {b} holds {total} bytes and was closed before reaching "
                    f"the cap of {cap}: expected {want}"
                )
        raise Mismatch(f"{where}: expected {want}, got {got}")
    return "reverse order, each bucket closed once it reaches the cap, for every case tried"


# ------------------------------------------------------------------------------ the hook
def _hook_on_rank(fn: Callable) -> str | None:
    """Runs on every rank: the learner's hook launches the all-reduces during backward."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from dpcourse import models, runtime

    rank, world, device = dist.get_rank(), dist.get_world_size(), runtime.device()
    torch.manual_seed(0)
    model = models.MLP().to(device)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(6, 5, generator=g).to(device), torch.randn(6, 2, generator=g).to(device)
    F.mse_loss(model(x), y).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters()}
    want = {}
    for n, grad in local.items():
        want[n] = grad.clone()
        dist.all_reduce(want[n])
        want[n] /= world
    model.zero_grad(set_to_none=True)
    pending: list = []
    # Each all-reduce's tensor and its version counter when it was launched: an in-place change
    # made after launching (dividing by N after the call, say) bumps the counter, although on
    # gloo the result often still comes out as the mean; the backend writing the sum does not.
    launches: list[tuple[torch.Tensor, int]] = []
    real_all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        launches.append((tensor, tensor._version))
        return real_all_reduce(tensor, *args, **kwargs)

    handles = [
        p.register_post_accumulate_grad_hook(lambda p: fn(p, pending)) for p in model.parameters()
    ]
    dist.all_reduce = recording
    try:
        F.mse_loss(model(x), y).backward()
    finally:
        dist.all_reduce = real_all_reduce
    for h in handles:
        h.remove()
    changed = [t for t, version in launches if t._version != version]
    launched = len(pending)
    if any(w is None for w in pending):
        return (
            "your hook appended None: dist.all_reduce returns a Work to wait for only with "
            "async_op=True; without it, it blocks inside backward and returns None"
        )
    if launched == 0:
        return (
            "nothing was appended to `pending`: append the Work that "
            "dist.all_reduce(param.grad, async_op=True) returns, so it can be waited for "
            "before the optimizer step"
        )
    for work in pending:
        work.wait()
    if changed:
        return (
            f"{len(changed)} gradient(s) were changed in place after their all-reduce was "
            "launched (divided after the call?): the all-reduce runs on in the background while "
            "you return, so what it sends and what it leaves are a race. Divide first, then "
            "launch"
        )
    if launched != len(local):
        return f"{launched} all-reduces were launched for {len(local)} parameters"
    for n, p in model.named_parameters():
        if torch.allclose(p.grad, want[n] * world, rtol=1e-5, atol=1e-7) and world > 1:
            return (
                f"{world} ranks: {n}.grad is the sum of the ranks' gradients; divide by the "
                "world size (before launching: the all-reduce runs on while you return)"
            )
        if torch.equal(p.grad, local[n]):
            return f"{world} ranks: {n}.grad is this rank's own gradient, not averaged"
        if not torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7):
            diff = (p.grad - want[n]).abs().max().item()
            return f"{world} ranks: {n}.grad differs from the ranks' mean by up to {diff:.3g}"
    return None


@exercise("ex-7-hook", function="my_launch_all_reduce", timeout=120)
def launch_all_reduce(fn: Callable) -> str:
    """``fn(param, pending)``, called by a post-accumulate-grad hook, must launch an
    asynchronous all-reduce of ``param.grad`` divided by the world size and append its Work to
    ``pending``; after waiting for them, every gradient is the ranks' mean."""
    for world in (2, 3):
        problems = run_learner_on_ranks(_hook_on_rank, world, fn, timeout=RANK_TIMEOUT)
        problem = next((p for p in problems if p), None)
        if problem:
            raise Mismatch(problem)
    return "launches one asynchronous all-reduce per gradient and averages, on 2 and 3 ranks"


# ------------------------------------------------------------------------------ sampler
@exercise("ex-7-sampler", function="my_epoch_indices", timeout=20)
def epoch_indices(fn: Callable) -> str:
    """``fn(num_samples, world_size, rank, epoch, seed)`` returns the indices
    ``DistributedSampler`` gives ``rank`` in ``epoch``, for shuffled sampling."""
    from torch.utils.data import DistributedSampler

    def sampler(n, world, rank, epoch, seed):
        s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    for n, world, seed in [(10, 2, 0), (12, 4, 3), (11, 3, 0), (3, 4, 1), (7, 1, 2)]:
        for epoch in (0, 1, 2):
            for rank in range(world):
                want = sampler(n, world, rank, epoch, seed)
                got = call_learner(fn, n, world, rank, epoch, seed)
                where = f"{n} samples, {world} ranks, rank {rank}, epoch {epoch}, seed {seed}"
                try:
                    got = [int(i) for i in got]
                except TypeError:
                    raise Mismatch(f"{where}: expected a list of indices, got {got!r}") from None
                if got == want:
                    continue
                if epoch > 0 and got == sampler(n, world, rank, 0, seed):
                    raise Mismatch(
                        f"{where}: you return epoch 0's order again. The sampler "
                        "seeds its permutation with seed + epoch (that is what "
                        "set_epoch changes), so every epoch is shuffled anew"
                    )
                if len(got) != len(want):
                    raise Mismatch(
                        f"{where}: {len(got)} indices, expected {len(want)}. Every "
                        "rank gets ceil(n / N): the permutation is padded by "
                        "repeating its first indices, so that all ranks take as "
                        "many steps"
                    )
                g = torch.Generator().manual_seed(seed + epoch)
                perm = torch.randperm(n, generator=g).tolist()
                size = len(want)
                padded = perm + (perm * world)[: size * world - n]
                if got == padded[rank * size : (rank + 1) * size]:
                    raise Mismatch(
                        f"{where}: you give rank {rank} a contiguous block of the "
                        "permutation; the sampler deals it out like cards, rank r "
                        f"taking positions r, r + N, r + 2N, ...: expected {want}"
                    )
                raise Mismatch(f"{where}: expected {want}, got {got}")
    return "the same indices as DistributedSampler with set_epoch, for every case tried"


# ------------------------------------------------------------------------------ step 2
def _average_on_rank(fn: Callable) -> str | None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from dpcourse import models, runtime

    rank, world, device = dist.get_rank(), dist.get_world_size(), runtime.device()
    torch.manual_seed(0)
    model = models.MLP().to(device)
    model.fc1.bias.requires_grad_(False)  # a frozen parameter: it has no gradient
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(6, 5, generator=g).to(device), torch.randn(6, 2, generator=g).to(device)
    F.mse_loss(model(x), y).backward()
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want = {}
    for n, grad in local.items():
        want[n] = grad.clone()
        dist.all_reduce(want[n])
        want[n] /= world
    fn(model)
    if model.fc1.bias.grad is not None:
        return "the frozen fc1.bias now has a gradient: skip parameters without requires_grad"
    for n, p in model.named_parameters():
        if n not in want:
            continue
        if torch.allclose(p.grad, want[n] * world, rtol=1e-5, atol=1e-7):
            return f"{world} ranks: {n}.grad is the sum of the ranks' gradients; divide by {world}"
        if torch.equal(p.grad, local[n]):
            return f"{world} ranks: {n}.grad did not change: all-reduce it"
        if not torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7):
            diff = (p.grad - want[n]).abs().max().item()
            return f"{world} ranks: {n}.grad differs from the ranks' mean by up to {diff:.3g}"
    return None


@exercise("ex-7-average", function="my_all_reduce_gradients", timeout=120)
def all_reduce_gradients(fn: Callable) -> str:
    """``fn(module)`` after backward leaves in every gradient the mean over the ranks (step 2),
    skipping frozen parameters."""
    for world in (2, 3):
        problems = run_learner_on_ranks(_average_on_rank, world, fn, timeout=RANK_TIMEOUT)
        problem = next((p for p in problems if p), None)
        if problem:
            raise Mismatch(problem)
    return "every gradient is the mean over the ranks, frozen ones left alone, on 2 and 3 ranks"
