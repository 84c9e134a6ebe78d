"""PowerSGD from scratch: each gradient matrix sent as two thin factors, P and Q.

A layer's gradient M (n x m, a matrix of rank up to min(n, m)) is approximated by P Q^T with P
n x r and Q m x r, r small (1 to 4): (n + m) r values sent instead of n m. One step of power
iteration finds them (Vogels et al., 2019):

1. P = M Q, with Q from the last step (warm start) or random at the first;
2. all-reduce P (a sum: P is the same linear map of every rank's M, so the sum is P of the
   summed M), then orthogonalise its columns (Gram-Schmidt);
3. Q = M^T P, all-reduce Q and divide by N; the averaged gradient is approximated by P Q^T.

The paper orthogonalises P only; torch's hook also orthogonalises the reused Q before step 1,
and so does ours (:func:`factors`), to compute what torch's does.

The approximation drops what is outside the r directions; **error feedback** adds what was
dropped to the next step's gradient, so that over steps nothing is lost, only delayed (without
it PowerSGD is biased, and training stalls above the loss it reaches). The first
``start_powerSGD_iter`` steps run a plain all-reduce, as torch's hook does: early gradients
change fast, and compressing them hurts most. Vectors (biases) and matrices too small to gain
``min_compression_rate`` are all-reduced whole, in one flat tensor.

:func:`powersgd_hook` is a DDP communication hook (:mod:`.compression` says what that is): the
three steps, on one screen, with what they need written apart: which gradients to compress
(:func:`split_gradients`), P and Q as views of two flat tensors (:func:`factors`), and the rest
averaged uncompressed (:func:`average_whole`). It keeps the state, the random draws and the
order of torch's ``powerSGD_hook``, so that given the same :class:`PowerSGDState` both compute
the same gradients (``tests/test_communicating_less.py``, 2 to 4 ranks, 1-D parameters and
matrices smaller than the rank). One difference: ours runs its three all-reduces one after
another and returns a completed Future, where torch's chains them in callbacks so that backward
goes on meanwhile; the values are the same.

Chapter 12: PowerSGD, low-rank gradient compression.
"""

import numpy as np
import torch
import torch.distributed as dist

from dpcourse.communicating_less.compression import allreduce_hook

__all__ = ["PowerSGDState", "orthogonalize", "compressed_values", "split_gradients", "factors",
           "average_whole", "powersgd_hook"]


class PowerSGDState:
    """What PowerSGD keeps between steps, per bucket: the error it dropped, and P and Q for the
    warm start. The arguments are those of torch's ``PowerSGDState``, with its defaults;
    ``random_seed`` seeds the draws of Q, the same on every rank."""

    def __init__(self, process_group: dist.ProcessGroup | None = None,
                 matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0,
                 random_seed: int = 0) -> None:
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("start_powerSGD_iter must be 2 or more with error feedback or warm "
                             "start (as in torch: DDP may rebuild its buckets after step 1)")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0


def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of ``matrix`` (n x r, r <= n) orthonormal, in place:
    Gram-Schmidt, each column normalised, then removed from the columns after
    it. ``epsilon`` guards a column of zeros (a gradient that vanished)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col /= torch.norm(col, dim=0, keepdim=True) + epsilon
        rest = matrix[:, i + 1 :]
        rest -= torch.sum(col * rest, dim=0, keepdim=True) * col


def compressed_values(shape: tuple[int, ...], rank: int, min_compression_rate: float = 2) -> int:
    """How many values a gradient of ``shape`` costs under PowerSGD of ``rank``: (n + m) r for
    the matrix n x m it is viewed as (the first dimension by the rest), where that is
    ``min_compression_rate`` times fewer than n m; n m otherwise (sent whole)."""
    n = shape[0]
    m = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    r = min(n, m, rank)
    return (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m


def split_gradients(gradients: list[torch.Tensor], state: PowerSGDState
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the matrices to compress, the gradients to send whole) of one bucket: each gradient
    viewed as its first dimension by the rest, compressed where (n + m) r is
    ``min_compression_rate`` times fewer values than n m. The matrices come grouped by shape, in
    torch's order, so that both hooks draw the same random Q for each."""
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    whole = []
    for g in gradients:
        m = g.view(g.shape[0], -1)
        rank = min(*m.shape, state.matrix_approximation_rank)
        if sum(m.shape) * rank * state.min_compression_rate < m.numel():
            by_shape.setdefault(m.shape, []).append(m)
        else:
            whole.append(g)
    return [m for ms in by_shape.values() for m in ms], whole


def factors(state: PowerSGDState, i: int, matrices: list[torch.Tensor],
            like: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """P (n x r) and Q (m x r) of every matrix of bucket ``i``, views into two flat tensors of
    ``state`` (one all-reduce each), on ``like``'s device. Q is orthonormal: last step's (the
    warm start, orthogonalised again as torch's hook does) or, at the first step or without
    warm start, drawn at random with a seed that every rank draws alike."""
    ranks = [min(*m.shape, state.matrix_approximation_rank) for m in matrices]
    fresh = not state.warm_start or i not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[i] = like.new_empty(sum(m.shape[0] * r for m, r in zip(
            matrices, ranks, strict=True)))
        state.q_memory_dict[i] = like.new_empty(sum(m.shape[1] * r for m, r in zip(
            matrices, ranks, strict=True)))
    ps, qs, p_at, q_at = [], [], 0, 0
    for m, r in zip(matrices, ranks, strict=True):
        ps.append(state.p_memory_dict[i][p_at : p_at + m.shape[0] * r].view(m.shape[0], r))
        qs.append(state.q_memory_dict[i][q_at : q_at + m.shape[1] * r].view(m.shape[1], r))
        p_at, q_at = p_at + m.shape[0] * r, q_at + m.shape[1] * r
    with torch.random.fork_rng(devices=[], enabled=fresh):
        if fresh:  # the same seed on every rank: the same random Q everywhere
            torch.manual_seed(state.rng.randint(1_000_000_000))
        for q in qs:
            if fresh:
                q.copy_(torch.randn(*q.shape, dtype=q.dtype))
            orthogonalize(q, state.orthogonalization_epsilon)
    return ps, qs


def average_whole(tensors: list[torch.Tensor], like: torch.Tensor,
                  group: dist.ProcessGroup | None) -> None:
    """Replace each of ``tensors`` by its mean over the ranks: one all-reduce of them all,
    flattened, summed then divided, as torch's hook does (where there are none, an empty
    all-reduce on ``like``'s device, as torch's too)."""
    flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else like.new_empty(0)
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    at = 0
    for t in tensors:
        t.copy_(flat[at : at + t.numel()].view_as(t))
        at += t.numel()


def powersgd_hook(
    state: PowerSGDState, bucket: dist.GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """The PowerSGD communication hook (steps 1-3 of the module), for torch's
    DDP or ours:
    ``ddp.register_comm_hook(PowerSGDState(...), powersgd_hook)``. The
    bucket's gradients are overwritten with the averaged approximation; its
    error is kept for the next step."""
    group, buffer, i = state.process_group, bucket.buffer(), bucket.index()
    if state.iter < state.start_powerSGD_iter:  # first steps: uncompressed
        state.iter += bucket.is_last()  # a step ends with its last bucket
        return allreduce_hook(group, bucket)
    if state.use_error_feedback:  # add back what the last step dropped
        buffer.add_(state.error_dict.setdefault(i, torch.zeros_like(buffer)))
        before = buffer.clone()
    matrices, whole = split_gradients(bucket.gradients(), state)
    ps, qs = factors(state, i, matrices, buffer)  # Q: last step's, or random
    for m, p, q in zip(matrices, ps, qs, strict=True):
        torch.matmul(m, q, out=p)  # 1. P = M Q
    average_whole(whole, buffer, group)  # vectors, small matrices: whole
    dist.all_reduce(state.p_memory_dict[i], group=group)  # 2. sum P
    for m, p, q in zip(matrices, ps, qs, strict=True):
        orthogonalize(p, state.orthogonalization_epsilon)  # ... orthonormal
        torch.matmul(m.t(), p, out=q)  # 3. Q = M^T P, averaged
    dist.all_reduce(state.q_memory_dict[i], group=group)
    state.q_memory_dict[i].div_(dist.get_world_size(group))
    for m, p, q in zip(matrices, ps, qs, strict=True):
        torch.matmul(p, q.t(), out=m)  # the averaged gradient: P Q^T
    if state.use_error_feedback:
        state.error_dict[i] = before - buffer  # kept for next step: M - P Q^T
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.iter += bucket.is_last()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut
