"""When does data parallelism scale? Step-time model, measurements, noise scale (chapter 10).

Three parts, each tested in ``tests/test_scaling.py``:

1. **The step-time model.** One data-parallel step is the compute of one rank plus the part of
   the gradient all-reduce that does not overlap with it; the all-reduce costs what the
   alpha-beta model of chapter 6 (:mod:`dpcourse.costmodel`) says. From it come weak and strong
   scaling efficiency and the largest world size that keeps an efficiency target. The hardware
   figures below are published peak numbers, quoted with their sources; everything computed
   from them is a *model*, not a measurement.
2. **Measured points.** :func:`ddp_step_times_on_rank` times ``torch.nn.parallel.
   DistributedDataParallel`` steps of the course's MLP, the same steps without communication,
   and all-reduces of a few sizes (to fit alpha and beta), on whatever ranks it runs on.
3. **Large-batch limits** (McCandlish et al., 2018). The gradient noise scale
   ``B_simple = tr(Sigma) / |G|^2`` from gradients of two batch sizes (the paper's appendix A.1),
   exactly from per-example gradients on a small data set, steps-to-target against batch size,
   and the steps/examples trade-off ``(S/S_min - 1)(E/E_min - 1) = 1``.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dpcourse import costmodel

__all__ = [
    "GPU",
    "Link",
    "H100",
    "A100",
    "NVLINK4",
    "NVLINK3",
    "IB_NDR",
    "IB_HDR",
    "training_flops",
    "compute_time",
    "gradient_bytes",
    "bucket_count",
    "all_reduce_time",
    "hierarchical_all_reduce_time",
    "overlapped_step_time",
    "step_time",
    "efficiency",
    "largest_world_size",
    "BACKWARD_FRACTION",
    "ddp_step_times_on_rank",
    "NoiseScale",
    "noise_scale_from_norms",
    "measure_noise_scale",
    "exact_noise_scale",
    "steps_to_target",
    "best_steps_to_target",
    "fit_steps_to_target",
    "tradeoff_examples",
]

# ------------------------------------------------------------------------ published figures


@dataclass(frozen=True)
class GPU:
    """A GPU's peak dense throughput in FLOP/s for the training precision, and its source."""

    name: str
    peak_flops: float
    source: str


@dataclass(frozen=True)
class Link:
    """A link of latency ``alpha`` (seconds per message) and bandwidth ``beta`` (bytes per
    second, one direction, per GPU), and where the bandwidth figure comes from. The latencies
    are assumptions of the right order (a few microseconds), not datasheet figures."""

    name: str
    alpha: float
    beta: float
    source: str


H100 = GPU(
    "H100 SXM5, bf16 dense",
    989e12,
    "NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity)",
)
A100 = GPU(
    "A100 SXM4, bf16 dense",
    312e12,
    "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS BF16 dense (624 with sparsity)",
)
NVLINK4 = Link(
    "NVLink 4 (H100, within a node)",
    3e-6,
    450e9,
    "NVIDIA H100 datasheet: NVLink 900 GB/s, i.e. 450 GB/s each way",
)
NVLINK3 = Link(
    "NVLink 3 (A100, within a node)",
    3e-6,
    300e9,
    "NVIDIA A100 datasheet: NVLink 600 GB/s, i.e. 300 GB/s each way",
)
IB_NDR = Link(
    "InfiniBand NDR, one 400 Gb/s NIC per GPU",
    5e-6,
    50e9,
    "NVIDIA ConnectX-7 / Quantum-2 NDR: 400 Gb/s = 50 GB/s each way",
)
IB_HDR = Link(
    "InfiniBand HDR, one 200 Gb/s NIC per GPU",
    5e-6,
    25e9,
    "NVIDIA ConnectX-6 / Quantum HDR: 200 Gb/s = 25 GB/s each way",
)

# Backward costs about twice the forward (a gradient for the weights and one for the inputs),
# so it is about 2/3 of a step's compute: the part bucketed DDP can hide all-reduces behind.
BACKWARD_FRACTION = 2.0 / 3.0


def training_flops(num_params: float, tokens: float) -> float:
    """FLOPs of one training step of a dense Transformer: ``6 * params * tokens`` (2 for the
    forward, 4 for the backward; Kaplan et al., 2020), attention's extra FLOPs left out."""
    return 6.0 * num_params * tokens


def compute_time(num_params: float, tokens: float, gpu: GPU = H100, mfu: float = 0.4) -> float:
    """Seconds of compute for one step on one GPU at model-FLOPs utilisation ``mfu``."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction of the peak, in (0, 1]; got {mfu}")
    return training_flops(num_params, tokens) / (gpu.peak_flops * mfu)


def gradient_bytes(num_params: float, dtype: torch.dtype | str = "bf16") -> float:
    """Bytes of one full gradient: 2 per parameter in bf16/fp16, 4 in fp32."""
    size = {"bf16": 2, "fp16": 2, "fp32": 4}.get(dtype) if isinstance(dtype, str) else None
    if size is None:
        if not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"dtype must be 'bf16', 'fp16', 'fp32' or a torch dtype; got {dtype!r}"
            )
        size = torch.empty((), dtype=dtype).element_size()
    return float(num_params) * size


def bucket_count(
    grad_bytes: float, bucket_cap_bytes: float = 25 * 2**20, first_bucket_bytes: float = 0.0
) -> int:
    """How many all-reduces DDP launches for ``grad_bytes`` of gradients in buckets of at most
    ``bucket_cap_bytes`` (DDP's default cap is 25 MiB). PyTorch's DDP makes its first bucket
    smaller (1 MiB) so that the first all-reduce starts early: pass ``first_bucket_bytes=2**20``
    to count it. Bytes only: DDP never splits a parameter, so real buckets can be a little fuller.
    """
    if bucket_cap_bytes <= 0 or first_bucket_bytes < 0:
        raise ValueError(
            f"bucket sizes must be positive, got {bucket_cap_bytes} and {first_bucket_bytes}"
        )
    if first_bucket_bytes and grad_bytes > first_bucket_bytes:
        return 1 + math.ceil((grad_bytes - first_bucket_bytes) / bucket_cap_bytes)
    return max(1, math.ceil(grad_bytes / bucket_cap_bytes))


# ------------------------------------------------------------------------------ the model


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")


def all_reduce_time(
    grad_bytes: float,
    world_size: int,
    alpha: float,
    beta: float,
    buckets: int = 1,
    algorithm: str = "ring",
) -> float:
    """Modelled seconds to all-reduce ``grad_bytes`` in ``buckets`` equal all-reduces, one after
    the other: every bucket pays the latency term, the bytes are paid once. For the ring:
    ``buckets * 2(N-1) alpha + 2(N-1)/N * grad_bytes / beta`` (chapter 6's formula)."""
    _check_world(world_size)
    if buckets < 1:
        raise ValueError(f"buckets must be at least 1, got {buckets}")
    latencies, volume = costmodel.terms(algorithm, int(world_size))
    return buckets * latencies * alpha + volume * grad_bytes / beta


def hierarchical_all_reduce_time(
    grad_bytes: float,
    world_size: int,
    gpus_per_node: int = 8,
    intra: Link = NVLINK4,
    inter: Link = IB_NDR,
    buckets: int = 1,
) -> float:
    """Modelled two-level all-reduce over ``world_size / gpus_per_node`` nodes: a ring
    reduce-scatter inside each node (NVLink), then ``gpus_per_node`` ring all-reduces in
    parallel across nodes, each of 1/g of the data over its own GPU's NIC, then an all-gather
    inside the node. With one node it is a ring on ``intra``; with one GPU per node a ring on
    ``inter``. ``world_size`` must be below or a multiple of ``gpus_per_node``."""
    _check_world(world_size)
    g = min(gpus_per_node, int(world_size))
    if world_size % g:
        raise ValueError(
            f"world_size {world_size} is not a multiple of gpus_per_node {gpus_per_node}"
        )
    nodes = int(world_size) // g
    inside = all_reduce_time(grad_bytes, g, intra.alpha, intra.beta, buckets)
    across = all_reduce_time(grad_bytes / g, nodes, inter.alpha, inter.beta, buckets)
    return inside + across


def overlapped_step_time(compute_s: float, comm_s: float, overlap: float = 0.0) -> float:
    """Seconds of a step whose all-reduce of ``comm_s`` seconds can run behind the fraction
    ``overlap`` of its ``compute_s``: ``compute + max(0, comm - overlap * compute)``. For any
    all-reduce model (the flat ring of :func:`step_time`, the two-level one of
    :func:`hierarchical_all_reduce_time`)."""
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap is a fraction of the compute, in [0, 1]; got {overlap}")
    return compute_s + max(0.0, comm_s - overlap * compute_s)


def step_time(
    world_size: int,
    compute_s: float,
    grad_bytes: float,
    alpha: float,
    beta: float,
    overlap: float = 0.0,
    buckets: int = 1,
) -> float:
    """Modelled seconds of one data-parallel step: ``compute_s`` (one rank's forward, backward
    and update) plus the ring all-reduce time that is not hidden behind compute.

    ``overlap`` is the fraction of the compute the all-reduce can run behind: 0 when it starts
    after backward, about :data:`BACKWARD_FRACTION` (2/3) for bucketed DDP, which overlaps it
    with backward, 1 in the ideal limit. So ``step = compute + max(0, comm - overlap*compute)``.
    """
    comm = all_reduce_time(grad_bytes, world_size, alpha, beta, buckets)
    return overlapped_step_time(compute_s, comm, overlap)


def efficiency(
    world_size: int,
    compute_s: float,
    grad_bytes: float,
    alpha: float,
    beta: float,
    overlap: float = 0.0,
    buckets: int = 1,
    mode: str = "weak",
) -> float:
    """Modelled scaling efficiency: throughput on ``world_size`` ranks over ``world_size`` times
    the throughput of one rank (1 means perfect scaling).

    ``mode="weak"``: the batch per rank is fixed (the global batch grows with N); ``compute_s``
    is one rank's compute, the same at every N, and the efficiency is ``compute_s / step``.
    ``mode="strong"``: the global batch is fixed; ``compute_s`` is the compute of the whole
    batch on one rank, each of N ranks does ``compute_s / N``, and the efficiency is
    ``compute_s / (N * step)``.
    """
    if mode == "weak":
        per_rank = compute_s
    elif mode == "strong":
        per_rank = compute_s / world_size
    else:
        raise ValueError(f"mode must be 'weak' or 'strong', got {mode!r}")
    step = step_time(world_size, per_rank, grad_bytes, alpha, beta, overlap, buckets)
    return per_rank / step


def largest_world_size(
    target: float, efficiency_at: Callable[[int], float], limit: int = 2**24
) -> int:
    """The largest N in [1, limit] with ``efficiency_at(N) >= target``, for an efficiency that
    does not grow with N (true of :func:`efficiency` for the ring: its latency and bandwidth
    terms both grow with N). Bisection, so it costs about log2(limit) calls. Returns 0 if even
    N = 1 misses the target."""
    if efficiency_at(1) < target:
        return 0
    if efficiency_at(limit) >= target:
        return limit
    lo, hi = 1, limit  # efficiency_at(lo) >= target > efficiency_at(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if efficiency_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


# ------------------------------------------------------------------------ measured points


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ddp_step_times_on_rank(
    per_rank_batches: Sequence[int],
    hidden: int = 512,
    in_features: int = 64,
    steps: int = 15,
    warmup: int = 3,
    comm_sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22),
    comm_repeats: int = 5,
    bucket_cap_mb: float = 25.0,
) -> dict:
    """Run on every rank (with :func:`dpcourse.launch.run_ranks`, any N including 1): for each
    per-rank batch size, median seconds of a ``torch`` DDP training step of the course's MLP and
    of the same step without DDP (the compute alone), interleaved, each step started after a
    barrier and counted on the slowest rank; plus median all-reduce times of ``comm_sizes``
    bytes (``dist.all_reduce``, float32) to fit alpha and beta as in chapter 6.

    The model is ``MLP(in_features, hidden, 2)`` on the rank's device
    (:func:`dpcourse.runtime.device`): CPU with gloo here, a GPU with NCCL where there is one.
    Returns ``{"world_size", "device", "num_params", "grad_bytes", "batches", "compute",
    "ddp", "comm_sizes", "comm"}`` (times in seconds, the same on every rank; ``device`` is the
    rank's own). Chapter 10 compares them with :func:`step_time` fitted to this machine.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dpcourse import runtime
    from dpcourse.commbench import slowest_rank, time_all_reduce_on_rank
    from dpcourse.models import MLP

    device = runtime.device()
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = MLP(in_features, hidden, 2).to(device)
    num_params = sum(p.numel() for p in base.parameters())
    plain = copy.deepcopy(base)
    ddp = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, device_ids=None)
    opts = {
        "compute": torch.optim.SGD(plain.parameters(), lr=1e-3),
        "ddp": torch.optim.SGD(ddp.parameters(), lr=1e-3),
    }
    models = {"compute": plain, "ddp": ddp}
    loss_fn = nn.MSELoss()
    out: dict[str, list[float]] = {"compute": [], "ddp": []}
    for b in per_rank_batches:
        g = torch.Generator().manual_seed(1000 + dist.get_rank())
        x = torch.randn(b, in_features, generator=g).to(device)
        y = torch.randn(b, 2, generator=g).to(device)
        times: dict[str, list[float]] = {"compute": [], "ddp": []}
        for i in range(warmup + steps):
            for name, model in models.items():  # interleaved: drifts in load hit both alike
                dist.barrier()
                _sync(device)
                start = time.perf_counter()
                opts[name].zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                opts[name].step()
                _sync(device)
                elapsed = slowest_rank(time.perf_counter() - start, device)
                if i >= warmup:
                    times[name].append(elapsed)
        for name in out:
            out[name].append(statistics.median(times[name]))
    comm = [0.0] * len(comm_sizes)
    if world > 1:
        comm = time_all_reduce_on_rank(comm_sizes, ("library",), comm_repeats)["library"]
    return {
        "world_size": world,
        "device": str(device),
        "num_params": num_params,
        "grad_bytes": 4 * num_params,
        "batches": list(per_rank_batches),
        "compute": out["compute"],
        "ddp": out["ddp"],
        "comm_sizes": list(comm_sizes),
        "comm": comm,
    }


# ----------------------------------------------------------------- the gradient noise scale


@dataclass(frozen=True)
class NoiseScale:
    """Estimates of ``|G|^2`` (the squared norm of the true gradient) and ``tr(Sigma)`` (the
    trace of the per-example gradient covariance); ``b_simple = tr(Sigma) / |G|^2`` is
    McCandlish et al.'s simple noise scale, an estimate of the critical batch size."""

    g2: float
    trace: float
    g2_stderr: float = math.nan  # standard errors, where several pairs were averaged
    trace_stderr: float = math.nan

    @property
    def b_simple(self) -> float:
        return self.trace / self.g2


def noise_scale_from_norms(
    g_small_sq: float, g_big_sq: float, b_small: float, b_big: float
) -> NoiseScale:
    """Unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` from the squared norms of two gradient
    estimates, averaged over ``b_small`` and ``b_big`` examples (McCandlish et al., 2018,
    appendix A.1). Both follow from ``E|G_B|^2 = |G|^2 + tr(Sigma)/B``::

        |G|^2     = (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
        tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big)

    In data-parallel training both come for free: a rank's local gradient (b_small) and the
    all-reduced one (b_big = N * b_small). Their ratio is a biased estimate of B_simple; the
    paper averages the numerator and denominator over many steps before dividing.
    """
    if not b_big > b_small > 0:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return NoiseScale(float(g2), float(trace))


def _loss_fn_default(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _flat_grad(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads])


def measure_noise_scale(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    b_small: int,
    b_big: int,
    repeats: int = 50,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _loss_fn_default,
    seed: int = 0,
) -> NoiseScale:
    """The two-batch-size estimate of the noise scale at ``model``'s current parameters:
    ``repeats`` times, draw a batch of ``b_small`` and one of ``b_big`` examples (with
    replacement, so that the data set is the distribution and the estimates are unbiased),
    compute the squared gradient norms, average them, then apply
    :func:`noise_scale_from_norms`. ``loss_fn`` must average over the batch (the mean gradient).
    ``inputs``/``targets``: the whole data set, first dimension the examples. The standard
    errors come from the spread of the single-pair estimates."""
    g = torch.Generator().manual_seed(seed)
    n = len(inputs)
    small, big = [], []
    for _ in range(repeats):
        for b, acc in ((b_small, small), (b_big, big)):
            idx = torch.randint(0, n, (b,), generator=g)
            grad = _flat_grad(model, loss_fn(model(inputs[idx]), targets[idx]))
            acc.append(float(grad.double().square().sum()))
    pooled = noise_scale_from_norms(float(np.mean(small)), float(np.mean(big)), b_small, b_big)
    if repeats < 2:
        return pooled
    # The estimators are linear in the norms: the pooled one is the mean of the single pairs'.
    pairs = [noise_scale_from_norms(s, b, b_small, b_big) for s, b in zip(small, big, strict=True)]
    return NoiseScale(
        pooled.g2,
        pooled.trace,
        float(np.std([p.g2 for p in pairs], ddof=1)) / math.sqrt(repeats),
        float(np.std([p.trace for p in pairs], ddof=1)) / math.sqrt(repeats),
    )


def exact_noise_scale(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _loss_fn_default,
) -> NoiseScale:
    """``|G|^2`` and ``tr(Sigma)`` computed exactly from every per-example gradient of a small
    data set (``torch.func.vmap`` over examples): ``G`` is their mean and ``Sigma`` their
    covariance (dividing by n, the data set being the whole distribution). The truth that
    :func:`measure_noise_scale` estimates."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def one_loss(p, x, y):
        return loss_fn(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, inputs, targets)
    flat = torch.cat([g.reshape(len(inputs), -1) for g in per_example.values()], dim=1).double()
    mean = flat.mean(0)
    trace = (flat - mean).square().sum(1).mean()
    return NoiseScale(float(mean.square().sum()), float(trace))


# ------------------------------------------------------------ steps to a target, the trade-off


def steps_to_target(
    make_model: Callable[[], nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    batch_size: int,
    lr: float,
    target_loss: float,
    max_steps: int = 2000,
    eval_every: int = 5,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _loss_fn_default,
    seed: int = 0,
) -> int | None:
    """Steps of plain SGD (batches drawn with replacement) until the loss on the whole data set
    is at most ``target_loss``, checked every ``eval_every`` steps; None if ``max_steps`` are
    not enough (or the loss diverges). The model starts from ``make_model()`` every time."""
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    n = len(inputs)
    for step in range(1, max_steps + 1):
        idx = torch.randint(0, n, (batch_size,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(inputs[idx]), targets[idx]).backward()
        opt.step()
        if step % eval_every == 0:
            with torch.no_grad():
                full = float(loss_fn(model(inputs), targets))
            if not math.isfinite(full) or full > 1e6:  # diverged
                return None
            if full <= target_loss:
                return step
    return None


def best_steps_to_target(
    make_model: Callable[[], nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    batch_size: int,
    lrs: Sequence[float],
    target_loss: float,
    max_steps: int = 2000,
    start_lr: float | None = None,
    **kwargs,
) -> tuple[int | None, float | None]:
    """The fewest steps to ``target_loss`` over the learning rates ``lrs``, as McCandlish et al.
    and Shallue et al. tune the learning rate for every batch size. Returns ``(steps, lr)``, or
    ``(None, None)`` if no learning rate reaches the target within ``max_steps``.

    To stay cheap it assumes steps are unimodal in the learning rate: it starts at ``start_lr``
    (default: the middle of the sorted ``lrs``; pass the best rate of the next smaller batch),
    walks up while the steps fall, then down, and stops every run once it needs more steps than
    the best so far."""
    lrs = sorted(lrs)
    if not lrs:
        raise ValueError("lrs must hold at least one learning rate")
    best: tuple[int | None, float | None] = (None, None)

    def attempt(lr: float) -> bool:
        nonlocal best
        limit = max_steps if best[0] is None else best[0] - 1
        s = steps_to_target(
            make_model, inputs, targets, batch_size, lr, target_loss, limit, **kwargs
        )
        if s is not None:
            best = (s, lr)
        return s is not None

    middle = len(lrs) // 2 if start_lr is None else lrs.index(start_lr)
    attempt(lrs[middle])
    for lr in lrs[middle + 1 :]:  # larger rates while they help
        if not attempt(lr) and best[0] is not None:
            break
    for lr in reversed(lrs[:middle]):  # then smaller ones
        if not attempt(lr) and best[0] is not None:
            break
    return best


def fit_steps_to_target(
    batch_sizes: Sequence[float], steps: Sequence[float]
) -> tuple[float, float, float]:
    """Fit McCandlish et al.'s ``S = S_min (1 + B_crit / B)`` to measured (batch size, steps):
    linear least squares of ``S = S_min + E_min / B`` weighted by 1/S (relative error). Returns
    ``(S_min, E_min, B_crit)`` with ``E_min = S_min * B_crit`` the fewest examples."""
    b = np.asarray(batch_sizes, dtype=float)
    s = np.asarray(steps, dtype=float)
    if b.shape != s.shape or b.size < 2:
        raise ValueError("need at least two (batch size, steps) pairs of the same length")
    design = np.stack([np.ones_like(b), 1.0 / b], axis=1) / s[:, None]
    (s_min, e_min), *_ = np.linalg.lstsq(design, np.ones_like(s), rcond=None)
    return float(s_min), float(e_min), float(e_min / s_min)


def tradeoff_examples(steps_ratio):
    """``E/E_min`` on the curve ``(S/S_min - 1)(E/E_min - 1) = 1`` for ``S/S_min`` > 1 (a number
    or an array): the fewer the steps, the more examples it takes."""
    r = np.asarray(steps_ratio, dtype=float)
    if np.any(r <= 1):
        raise ValueError("S/S_min must be greater than 1: no batch size needs fewer than S_min")
    return 1.0 + 1.0 / (r - 1.0)
