"""Checks for chapter 7's exercises (DistributedDataParallel from scratch).

Chapter 7: exercise checks for DistributedDataParallel.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from dpcourse import runtime
from dpcourse.ddp import buckets
from dpcourse.harness.exercises.core import (
    Mismatch,
    call_learner,
    call_learner_in_place,
    call_learner_untouched,
    exercise,
    run_learner_on_ranks,
)
from dpcourse.harness.exercises.devices import as_on_gpus
from dpcourse.harness.exercises.waits import BackwardWatch, is_blocking
from dpcourse.one_device import models

RANK_TIMEOUT = 30.0  # seconds for one world size; a deadlock ends here


# ------------------------------------------------------------------------------ buckets
def _forward_order(sizes: list[int], cap: float) -> list[list[int]]:
    n = len(sizes)
    return [[n - 1 - i for i in b] for b in buckets.bucket_assignment(sizes[::-1], cap)]


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
    :func:`dpcourse.ddp.buckets.bucket_assignment` (torch's rule): reverse order, a bucket closes
    once it reaches ``cap_bytes``. Rejects forward order and closing before the cap is reached
    (a rule that keeps every bucket within the cap), saying which it was, and a ``param_bytes``
    changed in place (the caller's list of sizes)."""

    for sizes, cap in BUCKET_CASES:
        want = buckets.bucket_assignment(sizes, cap)
        where = f"param_bytes={sizes}, cap_bytes={cap}"
        try:
            got = call_learner_untouched(fn, ["param_bytes"], list(sizes), cap)
        except Mismatch as exc:
            raise Mismatch(f"{where}: {exc}") from None
        try:
            got = [list(map(int, b)) for b in got]
        except (TypeError, ValueError):
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
    # gloo the result often still comes out as the mean. The backend's own write of the result
    # may bump it too (gloo with CUDA tensors copies the sum back from the host: +1; gloo on the
    # CPU and NCCL: 0): measured here once, on a tensor of the same device, and allowed.
    probe = torch.zeros(1, device=device)
    before = probe._version
    dist.all_reduce(probe, async_op=True).wait()
    backend_bumps = probe._version - before
    launches: list[tuple[torch.Tensor, int]] = []
    real_all_reduce = dist.all_reduce
    watch = BackwardWatch()  # whether a wait happens while backward runs

    def recording(tensor, *args, **kwargs):
        launches.append((tensor, tensor._version))
        index = len(launches) - 1
        if watch.running and is_blocking(real_all_reduce, (tensor, *args), kwargs):
            watch.note(f"the all-reduce of gradient {index}", index, "blocking")
        return watch.work(real_all_reduce(tensor, *args, **kwargs),
                          f"the all-reduce of gradient {index}", index)

    dist.all_reduce = recording
    try:
        with as_on_gpus(device=[model]):  # a gradient moved to the CPU fails as on a GPU
            handles = [
                p.register_post_accumulate_grad_hook(
                    lambda p: call_learner_in_place(fn, p, pending))
                for p in model.parameters()
            ]
            loss = F.mse_loss(model(x), y)
            watch.begin(loss)
            loss.backward()
            watch.end()
    finally:
        dist.all_reduce = real_all_reduce
    for h in handles:
        h.remove()
    if watch.first is not None:
        return watch.first.message(
            "launch it with async_op=True, append its Work to `pending` and return: the caller "
            "waits for them all once backward is over")
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
    changed = [t for t, version in launches if t._version - version > backend_bumps]
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
    ``pending``; after waiting for them, every gradient is the ranks' mean. A wait inside
    backward (``wait()`` in the hook, or no ``async_op=True``) is rejected, as is a gradient
    changed after its launch; the model is modelled on a GPU (:func:`as_on_gpus`)."""
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

    def sampler(n, world, rank, epoch, seed):
        s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    # fewer samples than ranks too (3 on 4, 1 on 4, 2 on 7): the padding repeats the
    # permutation more than once
    for n, world, seed in [(10, 2, 0), (12, 4, 3), (11, 3, 0), (3, 4, 1), (7, 1, 2), (1, 4, 0),
                           (2, 7, 5)]:
        for epoch in (0, 1, 2):
            for rank in range(world):
                want = sampler(n, world, rank, epoch, seed)
                got = call_learner(fn, n, world, rank, epoch, seed)
                where = f"{n} samples, {world} ranks, rank {rank}, epoch {epoch}, seed {seed}"
                try:
                    got = [int(i) for i in got]
                except (TypeError, ValueError, RuntimeError):
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
                    again = (" (with fewer samples than ranks the permutation is repeated "
                             "more than once: order[:padding] is too short)" if n < world else "")
                    raise Mismatch(
                        f"{where}: {len(got)} indices, expected {len(want)}. Every "
                        "rank gets ceil(n / N): the permutation is padded by "
                        "repeating its first indices, so that all ranks take as "
                        f"many steps{again}"
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
    with as_on_gpus(device=[model]):  # a gradient made on the CPU fails as on a GPU
        call_learner(fn, model)
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
    skipping frozen parameters; the model is modelled on a GPU (:func:`as_on_gpus`), where a
    gradient made or moved to the CPU fails."""
    for world in (2, 3):
        problems = run_learner_on_ranks(_average_on_rank, world, fn, timeout=RANK_TIMEOUT)
        problem = next((p for p in problems if p), None)
        if problem:
            raise Mismatch(problem)
    return "every gradient is the mean over the ranks, frozen ones left alone, on 2 and 3 ranks"


# ------------------------------------------------------------------------------ bucketed DDP
class _Branchy(nn.Module):
    """7 features -> 3 outputs with awkward sizes, a frozen bias, and a layer ``extra`` in the
    middle that a step may leave unused on some ranks or on all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra = nn.Linear(7, 13), nn.Linear(13, 13)
        self.b, self.c = nn.Linear(13, 5), nn.Linear(5, 3)
        self.c.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.c(torch.relu(self.b(h)))


# Caps in bytes: 3 buckets of 85, 182 and 104 values (`extra` alone in the middle one), and 2
# of 267 and 104 (`extra` with b and c). Every bucket's size differs from the others' of its
# cap and from every single parameter's, so an all-reduce's size says which bucket it carries.
DDP_CAPS = (300, 700)
# Each step's micro-batches: (inside no_sync(), which ranks use `extra`); the last is synced.
DDP_STEPS = [
    [(False, "rank 0")],
    [(False, "all")],
    [(False, "none")],
    [(True, "all"), (True, "none"), (False, "rank 0")],
    [(True, "all"), (False, "all")],
]
DDP_LR = 0.1
# Gradients against torch's DDP: the same sums in another order, so a few float32 roundings on
# the CPU; NCCL and cuBLAS sum in their own orders, hence the looser GPU tolerance.
DDP_TOLERANCE = {"cpu": dict(rtol=1e-5, atol=1e-6), "cuda": dict(rtol=1e-4, atol=1e-5)}


class _Stop(Exception):
    """Raised on every rank at once when the ranks' all-reduces disagree (instead of a hang)."""


def _uses_extra(users: str, rank: int) -> bool:
    return users == "all" or (users == "rank 0" and rank == 0)


def _ddp_batch(rank: int, step: int, micro: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    n = 2 + (rank + step + micro) % 4  # 2 to 5 samples: uneven micro-batches and shards
    return torch.randn(n, 7, generator=g).to(device), torch.randn(n, 3, generator=g).to(device)


def _run_step(model: Callable, rank: int, step: int, device: torch.device,
              no_sync: Callable, before: Callable = lambda inside, loss: None) -> None:
    """The micro-batches of ``DDP_STEPS[step]``, forward and backward, those marked so inside
    ``no_sync()``; ``before(inside_no_sync, loss)`` runs before each backward."""

    for k, (inside, users) in enumerate(DDP_STEPS[step]):
        x, y = _ddp_batch(rank, step, k, device)
        with no_sync() if inside else contextlib.nullcontext():
            loss = F.mse_loss(model(x, _uses_extra(users, rank)), y)
            before(inside, loss)
            loss.backward()


def _ddp_reference(model: nn.Module, rank: int, device: torch.device) -> list[dict]:
    """torch's DDP(find_unused_parameters=True) through ``DDP_STEPS``: per step, each
    parameter's averaged gradient ("want") and this rank's own accumulated one ("local")."""

    # A parameter no step uses: torch's DDP would otherwise print a warning on every rank the
    # first time a step finds no unused parameter (the learner's model does not have it).
    holder = nn.Module()
    holder.net, holder.spare = model, nn.Parameter(torch.zeros(1, device=device))
    holder.forward = model.forward
    wrapped = DistributedDataParallel(
        holder,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=True,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=DDP_LR)
    steps = []
    for step in range(len(DDP_STEPS)):
        alone = copy.deepcopy(model)  # the same weights, no communication: the local gradient
        _run_step(alone, rank, step, device, contextlib.nullcontext)
        optimizer.zero_grad(set_to_none=True)
        _run_step(wrapped, rank, step, device, wrapped.no_sync)
        steps.append({
            "local": {n: p.grad for n, p in alone.named_parameters() if p.requires_grad},
            "want": {n: None if p.grad is None else p.grad.clone()
                     for n, p in model.named_parameters() if p.requires_grad},
        })
        optimizer.step()
    return steps


class _Launches:
    """Stands in for ``dist.all_reduce`` while the learner's DDP runs the steps. Before each
    all-reduce, every rank tells the others (an all_gather over a gloo group of the check's
    own) what it is about to launch; at the end of a step, how many it launched. If the ranks
    disagree, or launch something other than the next bucket, every rank raises
    :class:`_Stop` at that point, before a real all-reduce could pair mismatched tensors. A wait
    for an all-reduce while backward runs (``backward``, :mod:`~dpcourse.harness.exercises.waits`)
    is
    told at the next agreement, the all-reduce after it or the end of the step."""

    CALL, END = 0, 1

    def __init__(self, side, names: list[list[str]], numels: list[int],
                 param_numels: dict[str, int], real: Callable) -> None:
        self.side, self.names, self.numels, self.real = side, names, numels, real
        self.param_numels = param_numels
        self.step, self.inside_no_sync, self.in_backward = -1, False, False
        self.count, self.count_in_backward = 0, 0
        self.backward = BackwardWatch()
        self.problem: str | None = None

    def all_reduce(self, tensor, *args, **kwargs):
        if self.step < 0:  # outside the check's steps
            return self.real(tensor, *args, **kwargs)
        index, what = self.count, f"bucket {self.count}'s all-reduce"
        blocking = self.backward.running and is_blocking(self.real, (tensor, *args), kwargs)
        if blocking:
            self.backward.note(what, index, "blocking")
        self._agree([self.CALL, self.step, index, tensor.numel(), int(self.inside_no_sync),
                     int(self.in_backward), int(blocking), self._waited()])
        self.count += 1
        self.count_in_backward += int(self.in_backward)
        return self.backward.work(self.real(tensor, *args, **kwargs), what, index)

    def _waited(self) -> int:
        """1 + the index of the all-reduce this rank waited for while backward ran, or 0."""
        first = self.backward.first
        return first.tag + 1 if first is not None and first.how == "waited" else 0

    def end_of_step(self) -> None:
        self._agree([self.END, self.step, self.count, 0, 0, self.count_in_backward, 0,
                     self._waited()])
        self.count, self.count_in_backward = 0, 0
        self.backward = BackwardWatch()

    def _agree(self, row: list[int]) -> None:
        mine = torch.tensor(row, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.side))]
        dist.all_gather(rows, mine, group=self.side)
        rows = [r.tolist() for r in rows]
        callers = None
        if any(row[6] or row[7] for row in rows):  # the same on every rank: gather together
            callers = [""] * len(rows)
            first = self.backward.first
            dist.all_gather_object(callers, first.caller if first else "", group=self.side)
        self.problem = self._verdict(rows, callers)
        if self.problem:
            raise _Stop(self.problem)

    def _bucket(self, numel: int) -> str:
        if numel in self.numels:
            k = self.numels.index(numel)
            return f"bucket {k} ({numel} values: {', '.join(self.names[k])})"
        return f"{numel} values (no bucket has that size)"

    def _unused(self, k: int, ranks) -> str:
        """Why ``ranks`` may have held bucket ``k`` back in this step, if they may have."""
        users = DDP_STEPS[self.step][-1][1]
        idle = [r for r in ranks if not _uses_extra(users, r)]
        if not idle or not any(n.startswith("extra.") for n in self.names[k]):
            return ""
        who = "any rank" if users == "none" else "rank " + ", ".join(map(str, idle))
        return (f" In the last backward of step {self.step}, `extra` got no gradient on {who}, "
                f"so bucket {k} never filled there; but every rank must launch every bucket (in "
                "finish(), with zeros for the gradients that never came, or what no_sync() "
                "accumulated), or the ranks pair different all-reduces or wait for each other "
                "forever.")

    def _verdict(self, rows: list[list[int]], callers: list[str] | None = None) -> str | None:
        """What is wrong, the same on every rank, from every rank's row: kind (CALL or END),
        step, index, size, inside no_sync(), launched in backward (END: how many), blocking in
        backward, 1 + the index of an all-reduce waited for in backward; ``callers``: the
        function of each rank's first wait in backward."""
        step, due = self.step, len(self.numels)
        for r, (kind, _, _, numel, inside, _, blocking, waited) in enumerate(rows):
            caller = f" (in {callers[r]})" if callers and callers[r].isidentifier() else ""
            if kind == self.CALL and inside:
                return (f"step {step}: rank {r} launched an all-reduce ({numel} values) in a "
                        "backward inside no_sync(). Inside no_sync() gradients only accumulate "
                        "locally: the hook must return at once, and the next backward outside "
                        "no_sync() sends the accumulated sum")
            if waited:
                return (f"step {step}: on rank {r}, bucket {waited - 1}'s all-reduce was waited "
                        f"on inside backward{caller}: waiting there blocks backward until the "
                        "communication is done, so nothing overlaps; keep the Work handle and "
                        "wait for it in finish(), once backward is over")
            if kind == self.CALL and blocking:
                return (f"step {step}: rank {r} called dist.all_reduce for {self._bucket(numel)} "
                        f"without async_op=True inside backward{caller}: it holds backward up "
                        "until the bucket has travelled, so nothing overlaps. Launch it with "
                        "async_op=True, keep the Work and wait for it in finish()")
        what = [row[:4] for row in rows]  # kind, step, index, size: what each rank launched
        if any(w != what[0] for w in what):
            ends = [r for r, row in enumerate(rows) if row[0] == self.END]
            calls = [r for r, row in enumerate(rows) if row[0] == self.CALL]
            if ends and calls:
                r, q = ends[0], calls[0]
                numel = rows[q][3]
                k = self.numels.index(numel) if numel in self.numels else -1
                return (f"step {step}: rank {r} ended the step after {rows[r][2]} "
                        f"all-reduce(s), while rank {q} launched another, {self._bucket(numel)}."
                        + (self._unused(k, [r]) if k >= 0 else ""))
            index = rows[0][2]
            if not ends and all(row[2] == index for row in rows) and index < due:
                r = next(r for r, row in enumerate(rows) if row[3] != self.numels[index])
                return (f"step {step}: all-reduce number {index + 1} should carry "
                        f"{self._bucket(self.numels[index])}, but rank {r} launched "
                        f"{self._bucket(rows[r][3])}." + self._unused(index, [r])
                        + " Collectives pair up by the order in which the ranks call them: "
                        "launch the buckets strictly in bucket order on every rank (a bucket "
                        "still waiting for a gradient holds back the buckets after it)")
            return f"step {step}: the ranks launched different all-reduces: " + "; ".join(
                f"rank {r}: {'end of step after' if row[0] else 'all-reduce number'} "
                f"{row[2] + (row[0] == self.CALL)} ({row[3]} values)"
                for r, row in enumerate(rows))
        kind, _, index, numel = what[0]
        if kind == self.CALL:
            if index >= due:
                return (f"step {step}: all-reduce number {index + 1} ({numel} values), but "
                        f"there are {due} buckets: launch one all-reduce per bucket, once "
                        "per step")
            if numel == self.numels[index]:
                return None
            single = [n for n, size in self.param_numels.items() if size == numel]
            if single:
                return (f"step {step}: all-reduce number {index + 1} carried {numel} values, "
                        f"the gradient of {single[0]} alone, where "
                        f"{self._bucket(self.numels[index])} was due: that is one all-reduce "
                        "per parameter. Send each bucket's gradients as one flat tensor: one "
                        "all-reduce per bucket")
            message = (f"step {step}: all-reduce number {index + 1} carried "
                       f"{self._bucket(numel)}, where {self._bucket(self.numels[index])} was "
                       "due." + self._unused(index, range(len(rows))))
            if numel in self.numels[index + 1:]:
                return message + (" Launch the buckets strictly in bucket order: a bucket still "
                                  "waiting for a gradient holds back the buckets after it, and "
                                  "finish() launches whatever is left")
            return message + " Launch the buckets in order, each as one flat tensor"
        if index < due:
            return (f"step {step}: the ranks launched {index} all-reduce(s) for {due} buckets. "
                    "Every bucket travels in every step, even one whose parameters got no "
                    "gradient on any rank (torch's DDP with find_unused_parameters=True sends "
                    "it too): finish() launches what backward did not, with zeros")
        if DDP_STEPS[step][-1][1] == "all":  # every rank used every parameter
            early = min(row[5] for row in rows)
            if early == 0:
                return (f"step {step}: every parameter got its gradient, but no all-reduce was "
                        "launched while backward ran: they all waited for finish(). Launch each "
                        "bucket from the hook as soon as its last gradient has arrived, so that "
                        "it travels while backward computes the earlier layers")
            if early < due:
                return (f"step {step}: every parameter got its gradient, but only {early} of "
                        f"{due} buckets were launched during backward: launch each bucket from "
                        "the hook as soon as its last gradient has arrived (and the buckets "
                        "before it have left)")
        return None


def _compare_gradients(model: nn.Module, want: dict, local: dict, step: int, world: int,
                       tolerance: dict) -> str | None:
    """This rank's gradients after ``finish()`` against torch's DDP; a hint where it can tell
    what went wrong. A gradient that is None counts as zeros (torch's DDP leaves a parameter
    that no rank used without one)."""

    def value(grad, p):
        return torch.zeros_like(p) if grad is None else grad.detach()

    accumulated = len(DDP_STEPS[step]) > 1
    for n, p in model.named_parameters():
        if not p.requires_grad:
            if p.grad is not None:
                return f"the frozen {n} got a gradient: leave parameters without one alone"
            continue
        got, w, mine = value(p.grad, p), value(want[n], p), value(local[n], p)
        if torch.allclose(got, w, **tolerance):
            continue
        where = f"step {step}, {world} ranks: {n}.grad"
        if world > 1 and torch.allclose(got, w * world, **tolerance):
            return (f"{where} is the sum of the ranks' gradients, not their mean: divide each "
                    "bucket by the world size (before launching it)")
        if torch.allclose(got, mine, **tolerance) and world > 1:
            return (f"{where} is still this rank's own gradient: after waiting for a bucket's "
                    "all-reduce, copy its averaged values back into the parameters' .grad")
        users = DDP_STEPS[step][-1][1]
        if accumulated and n.startswith("extra.") and users != "all":
            return (f"{where}: `extra` got gradients under no_sync() but none in the last "
                    f"backward of the step on every rank{' but rank 0' * (users != 'none')}; "
                    "the mean differs by "
                    f"up to {(got - w).abs().max().item():.3g}. A parameter whose hook did not "
                    "fire in the synced backward still sends what it accumulated (its .grad), "
                    "zeros only if it has none")
        if accumulated:
            return (f"{where} (after {len(DDP_STEPS[step]) - 1} micro-batch(es) under no_sync() "
                    "and one outside) differs from the ranks' mean of the accumulated sum, by "
                    f"up to {(got - w).abs().max().item():.3g}. Inside no_sync() the hooks "
                    "must leave the gradients alone (no division, no counting); the synced "
                    "backward divides the accumulated sum once, when its bucket is launched, "
                    "and a parameter that got no gradient in that last backward still sends "
                    "what it accumulated")
        return (f"{where} differs from torch's DDP by up to {(got - w).abs().max().item():.3g} "
                f"(tolerance rtol={tolerance['rtol']:g}, atol={tolerance['atol']:g})")
    return None


def _ddp_case(fn: Callable, cap: int, side) -> str | None:
    """One bucket cap: torch's DDP first, then the learner's, step by step."""


    rank, world, device = dist.get_rank(), dist.get_world_size(), runtime.device()
    tolerance = DDP_TOLERANCE["cuda" if device.type == "cuda" else "cpu"]
    torch.manual_seed(0)
    model = _Branchy().to(device)
    reference = _ddp_reference(copy.deepcopy(model), rank, device)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    names = list(params)
    sizes = [p.numel() * p.element_size() for p in params.values()]
    bucket_names = [[names[i] for i in b] for b in buckets.bucket_assignment(sizes, cap)]
    numels = [sum(params[n].numel() for n in b) for b in bucket_names]
    launches = _Launches(side, bucket_names, numels, {n: p.numel() for n, p in params.items()},
                         dist.all_reduce)
    with as_on_gpus(device=[model]):
        learner = call_learner(fn, model, cap)
    for method in ("no_sync", "finish"):
        if not callable(getattr(learner, method, None)):
            return (f"bucket_cap_bytes={cap}: my_bucketed_ddp returned {type(learner).__name__}, "
                    f"which has no method {method}(): return the object (MyBucketedDDP(...))")
    optimizer = torch.optim.SGD(model.parameters(), lr=DDP_LR)

    def before(inside: bool, loss: torch.Tensor) -> None:
        launches.inside_no_sync, launches.in_backward = inside, True
        launches.backward.begin(loss)

    dist.all_reduce = launches.all_reduce
    try:
        for step, expected in enumerate(reference):
            optimizer.zero_grad(set_to_none=True)
            launches.step = step
            try:
                with as_on_gpus(device=[model]):  # a CPU tensor among the gradients fails
                    _run_step(model, rank, step, device, learner.no_sync, before)
                    launches.inside_no_sync, launches.in_backward = False, False
                    launches.backward.end()
                    call_learner(learner.finish)
                launches.end_of_step()
            except Exception:
                if launches.problem:  # found on every rank at the same all_gather
                    return f"bucket_cap_bytes={cap}, {world} ranks, {launches.problem}"
                raise
            finally:
                launches.step = -1
            problem = _compare_gradients(model, expected["want"], expected["local"], step,
                                         world, tolerance)
            flags = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(flags, torch.tensor([float(problem is not None)]), group=side)
            if any(f.item() for f in flags):  # all ranks stop at the same step
                return f"bucket_cap_bytes={cap}: {problem}" if problem else None
            optimizer.step()
    finally:
        dist.all_reduce = launches.real
    return None


def _bucketed_ddp_on_rank(fn: Callable) -> str | None:
    side = dist.new_group(backend="gloo")  # the check's own messages, apart from the learner's
    try:
        for cap in DDP_CAPS:
            problem = _ddp_case(fn, cap, side)
            if problem:
                return problem
        return None
    finally:
        dist.destroy_process_group(side)


@exercise("ex-7-bucketed-ddp", function="my_bucketed_ddp", timeout=150)
def bucketed_ddp(fn: Callable) -> str:
    """``fn(module, bucket_cap_bytes)`` returns an object whose gradient hooks put gradients in
    buckets (``buckets.bucket_assignment``) and launch each full bucket's all-reduce
    asynchronously, in bucket order, during backward; with ``no_sync()`` (a context manager)
    and ``finish()`` (after the last backward of a step: launch what is left, wait, write the
    means back). Compared, gradient by gradient after each step, with torch's
    ``DistributedDataParallel(find_unused_parameters=True)`` on 2 and 3 ranks: 5 steps of a
    model whose middle layer some ranks skip, with and without ``no_sync()``, at two bucket
    caps (tolerance: rtol 1e-5, atol 1e-6 on the CPU; 1e-4 and 1e-5 on a GPU). Every trainable
    parameter's ``.grad`` is compared, a None on either side counting as zeros (torch's DDP
    leaves a layer that no rank used without one); the frozen one must keep none. Every
    all-reduce is checked before it is launched: one per bucket, in bucket order, the same on
    every rank, none inside ``no_sync()``, and in a step where every parameter is used, every
    bucket launched while backward runs; none waited for (``wait()``, or no
    ``async_op=True``) before backward is over, which would leave nothing to overlap."""
    for world in (2, 3):
        problems = run_learner_on_ranks(_bucketed_ddp_on_rank, world, fn, timeout=RANK_TIMEOUT)
        problem = next((p for p in problems if p), None)
        if problem:
            raise Mismatch(problem)
    return (
        "one asynchronous all-reduce per bucket, in bucket order, launched during backward and "
        "waited for only after it, unused parameters and no_sync() handled. After each of "
        f"{len(DDP_STEPS)} steps, on 2 and 3 ranks at bucket caps of "
        f"{' and '.join(map(str, DDP_CAPS))} bytes, every trainable parameter's .grad equals "
        "torch's DistributedDataParallel(find_unused_parameters=True)'s within rtol 1e-5, atol "
        "1e-6 (1e-4 and 1e-5 on a GPU), a None counting as zeros (torch's DDP leaves `extra` "
        "without a gradient in the step no rank uses it, yours may send zeros), and the frozen "
        "c.bias has none"
    )
