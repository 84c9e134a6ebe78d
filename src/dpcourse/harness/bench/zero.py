"""``python -m dpcourse.harness.bench zero``: ShardedOptimizer against ZeroRedundancyOptimizer and
DDP.

Three ways to train the same model with Adam on N ranks, side by side (chapter 9):

* ``DDP, unsharded``: ``torch.nn.parallel.DistributedDataParallel`` and an unsharded
  ``torch.optim.Adam`` on every rank (plain data parallelism);
* ``ZeroRedundancyOptimizer``: torch's DDP and ``torch.distributed.optim.ZeroRedundancyOptimizer``
  (each rank steps whole tensors, then broadcasts them);
* ``ShardedOptimizer``: :class:`dpcourse.sharding.zero.ShardedOptimizer` alone (our ring
reduce-scatter,
  a step of this rank's flat shard, our ring all-gather); ``stage 2`` as well.

Each training step (zero_grad, forward, backward, optimizer step) starts after a barrier and
counts as long as its slowest rank; the variants take turns (interleaved), and the table shows
medians, the ratio to ``ZeroRedundancyOptimizer`` and to ``DDP, unsharded``, and the optimizer-state
bytes per rank (measured: the tensors in the optimizer's state) as a fraction of the unsharded
state. The default model is an MLP of 4 layers of width 1024 whose last layer has 1001 outputs,
so that the parameter count (4,174,825) divides by neither 2 nor 4.

:func:`train_variants_on_rank` trains the variants side by side for chapter 9's comparisons of
losses, parameters and optimizer-state bytes.

Chapter 9: ShardedOptimizer measured against torch's ZeRO and plain DDP.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from dpcourse import runtime
from dpcourse.ddp import ddp
from dpcourse.harness.bench import interleaved_step_times
from dpcourse.harness.launch import run_ranks
from dpcourse.one_device.memory_measurement import optimizer_state_bytes
from dpcourse.sharding.zero import ShardedOptimizer

LR = 1e-4
HELP = "ShardedOptimizer step time vs ZeroRedundancyOptimizer and unsharded DDP; state bytes/rank"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--out-features", type=int, default=1001)


def make_mlp(width: int = 1024, out_features: int = 1001):
    """The benchmark's model (seeded): 4 Linear layers, ``width`` wide, ``out_features`` out."""

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, out_features),
    )  # fmt: skip


VARIANTS = ("DDP, unsharded", "ZeroRedundancyOptimizer", "ShardedOptimizer", "ShardedOptimizer s2")
NUDGED = "DDP, nudged"


def make_variant(name: str, model, optimizer_cls, **kwargs) -> tuple:
    """One way to train ``model`` on every rank of a process group, by ``name``:
    * ``"DDP, unsharded"``: torch's ``DistributedDataParallel`` and an unsharded
      ``optimizer_cls`` (plain data parallelism);
    * ``"ZeroRedundancyOptimizer"``: torch's DDP and ``ZeroRedundancyOptimizer(optimizer_cls)``;
    * ``"ShardedOptimizer"`` / ``"ShardedOptimizer s2"``:
    :class:`dpcourse.sharding.zero.ShardedOptimizer`,
      stage 1 / 2;
    * ``"DDP, nudged"`` (:data:`NUDGED`): ``"DDP, unsharded"`` with every weight, and every
      averaged gradient at every step, one float step away (``torch.nextafter``), to measure how
      far rounding alone carries a run (:func:`rounding_gap`).

    torch's DDP comes from :func:`dpcourse.ddp.ddp.wrap`, the one place variants of DDP are made.

    Returns ``(module to call, optimizer, the optimizer that holds this rank's state)``.
    """


    if name in ("DDP, unsharded", NUDGED):
        opt = optimizer_cls(model.parameters(), **kwargs)
        if name == NUDGED:
            _nudge(model, opt)
        return ddp.wrap("torch DDP", model)[0], opt, opt
    if name == "ZeroRedundancyOptimizer":
        zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_cls, **kwargs)
        return ddp.wrap("torch DDP", model)[0], zro, zro.optim
    if name in ("ShardedOptimizer", "ShardedOptimizer s2"):
        stage = 2 if name.endswith("s2") else 1
        opt = ShardedOptimizer(model.parameters(), optimizer_cls, stage=stage, **kwargs)
        return model, opt, opt
    raise ValueError(f"unknown variant {name!r}; the variants are {(*VARIANTS, NUDGED)}")


def _nudge(model, optimizer) -> None:
    """One float step up on every weight now, and one float step up or down (a fixed random
    choice per element) on every gradient before each step: what another summation order of the
    ranks' gradients (another backend, another device's kernels) does to a run, and no more."""

    g = torch.Generator().manual_seed(0)
    ways = {p: torch.where(torch.rand(p.shape, generator=g) < 0.5, -math.inf, math.inf).to(p.device)
            for p in model.parameters()}
    with torch.no_grad():
        for p in ways:
            p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))

    def nudge_gradients(opt, args, kwargs) -> None:
        for p, way in ways.items():
            if p.grad is not None:
                p.grad.copy_(torch.nextafter(p.grad, way))

    optimizer.register_step_pre_hook(nudge_gradients)


def rounding_gap(result: dict, reference: dict, nudged: dict, mask=None, *,
                 largest: float | None = None, factor: float = 4.0, mean_floor: float = 1e-5,
                 loss_rtol: float = 1e-4) -> tuple[float, float]:
    """Check that ``result`` trained as ``reference`` did, up to rounding; chapter 9.

    Each is what :func:`train_variants_on_rank` returns for a variant (``params`` on the CPU,
    ``losses``); ``nudged`` is the reference run one float step away in its weights and its
    gradients (:data:`NUDGED`), and ``mask`` (a boolean tensor) leaves elements out, such as
    attention's key biases, whose gradient is zero and whose Adam steps are noise.

    Two runs of the same maths agree bit for bit only where they round alike: same kernels, same
    order of summing the ranks' gradients. Across backends and devices they do not (NCCL sums in
    its own order, GPU kernels round otherwise), and Adam turns a last-bit difference in a
    gradient near zero into a step of up to the learning rate, in either direction, which later
    steps carry on. Which elements flip is chance: on 3 ranks with clipping, one element moved
    7.8e-4 apart in the nudged run on the CPU and in ShardedOptimizer's run on an H200, and by
    4e-6 in the nudged run on that H200. So the largest difference says little; it must stay
    within ``largest`` (what Adam can move an element in the run: 2 x steps x lr, say), and the
    comparison rests on the mean absolute difference, which a few flipped elements barely move
    and a real error moves everywhere: it may be ``factor`` times the nudged run's, or at least
    ``mean_floor`` (with 10 AdamW steps at lr 1e-3, a learning rate 2 % too large makes 1.1e-4 on
    2 to 4 ranks). Losses likewise, where ``result`` has them, or ``loss_rtol`` relative: a
    flipped element moves the loss too (1.2e-5 on that H200), a 2 % larger learning rate by 6e-4
    to 2e-3 from the second step on (3 ranks, clipped, CPU).
    Raises AssertionError naming the gaps; returns ``(largest difference, mean difference)``.
    """
    keep = slice(None) if mask is None else ~mask
    diff = (result["params"] - reference["params"])[keep].abs()
    spread = (nudged["params"] - reference["params"])[keep].abs()
    gap, mean, rounding = diff.max().item(), diff.mean().item(), spread.mean().item()
    assert mean <= max(factor * rounding, mean_floor), (
        f"the parameters' mean difference to the reference is {mean:.2e}, more than {factor:g} x "
        f"the {rounding:.2e} that rounding makes (the nudged run) and {mean_floor:g}")
    assert largest is None or gap <= largest, (
        f"an element differs from the reference by {gap:.2e}, more than {largest:g}")
    losses = [run["losses"] for run in (result, reference, nudged)] if "losses" in result else []
    for a, b, c in zip(*losses, strict=True):
        assert abs(a - b) <= max(factor * abs(c - b), loss_rtol * abs(b)), (
            f"loss {a} against the reference's {b} (nudged by rounding: {c})")
    return gap, mean


def train_variants_on_rank(
    make_model: Callable,
    make_batch: Callable[[int, int], tuple],
    loss_fn: Callable,
    steps: int,
    optimizer_cls: type,
    variants: tuple[str, ...] = VARIANTS,
    return_params: bool = True,
    warmup: int = 0,
    max_norm: float | None = None,
    **optimizer_kwargs,
) -> dict[str, dict]:
    """Runs on every rank: train a fresh ``make_model()`` for ``steps`` steps in each way of
    :func:`make_variant`, on batches ``make_batch(step, rank)`` = ``(inputs..., target)``, in a
    torch-style loop: with ``warmup`` > 0 a ``LambdaLR`` warms the learning rate up linearly
    over that many steps, and ``max_norm`` clips the averaged gradients (torch's
    ``clip_grad_norm_``, or ``ShardedOptimizer.clip_grad_norm_`` on the global norm).

    Returns, per variant: ``losses`` (mean over ranks, per step), ``params`` (the final
    parameters, flattened, on the CPU), ``state_bytes`` (this rank's optimizer state) and
    ``grad_bytes`` (gradient memory this rank holds after the last step: the model's ``.grad``
    tensors plus ShardedOptimizer's own flat gradient buffer or gradient shard). With
    ``return_params=False``, ``params`` is ``None`` (large models travel back faster). Chapter 9.
    """


    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in variants:
        model = make_model()
        module, opt, holder = make_variant(name, model, optimizer_cls, **optimizer_kwargs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        losses = []
        for step in range(steps):
            *inputs, target = make_batch(step, rank)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(module(*inputs), target)
            loss.backward()
            if max_norm is not None and isinstance(opt, ShardedOptimizer):
                opt.clip_grad_norm_(max_norm)
            elif max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            scheduler.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        grad_bytes = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        if isinstance(opt, ShardedOptimizer):
            grad_bytes += opt.gradient_bytes()
        out[name] = {
            "losses": losses,
            "params": torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
            if return_params
            else None,
            "state_bytes": optimizer_state_bytes(holder),
            "grad_bytes": grad_bytes,
        }
    return out


def _make(name: str, model):
    return make_variant(name, model, torch.optim.Adam, lr=LR)


def time_on_rank(
    variants: tuple[str, ...], repeats: int, warmup: int, batch: int, width: int, out: int
) -> dict:
    """Runs on every rank: step times (slowest rank) per variant, interleaved, and this rank's
    optimizer-state bytes per variant."""



    rank, device = dist.get_rank(), runtime.device()
    base = make_mlp(width, out).to(device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randn(batch, out, generator=g).to(device)
    runs = [(name, *_make(name, copy.deepcopy(base))) for name in variants]

    def step(module, opt) -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(module(x), y).backward()
        opt.step()

    def after_round(i: int) -> None:
        if i + 1 == max(warmup, 1):
            _check_agreement(runs)

    per_step = interleaved_step_times([functools.partial(step, module, opt)
                                       for _, module, opt, _ in runs],
                                      repeats, warmup, device, after_round=after_round)
    state = {name: optimizer_state_bytes(local) for name, _, _, local in runs}
    return {"times": dict(zip(variants, per_step, strict=True)), "state_bytes": state}


def _check_agreement(runs) -> None:
    """The copies must agree (they saw the same data): a benchmark of a wrong implementation
    would be meaningless. Checked after the first steps only: the summation order of the
    gradients differs between the variants, and over tens of Adam steps such rounding
    differences grow (measured: up to 5e-4 after 23 steps on 4 ranks, for gloo's all-reduce
    against our ring alone), while after 1 to 5 steps they stay below 1e-7."""

    ref = torch.cat([p.detach().reshape(-1) for p in runs[0][1].parameters()])
    for name, module, _, _ in runs[1:]:
        got = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6, msg=f"{name} diverged")


def bench_zero(
    world_sizes: list[int], repeats: int, warmup: int, batch: int, width: int, out: int
) -> dict:
    num_params = 3 * (width * width + width) + width * out + out
    rows = []
    for n in world_sizes:
        per_rank = run_ranks(
            time_on_rank, n, VARIANTS, repeats, warmup, batch, width, out, timeout=1800
        )
        times = per_rank[0]["times"]
        medians = {name: statistics.median(t) for name, t in times.items()}
        unsharded = per_rank[0]["state_bytes"]["DDP, unsharded"]
        for name in VARIANTS:
            states = [r["state_bytes"][name] for r in per_rank]
            rows.append(
                {
                    "world_size": n,
                    "variant": name,
                    "median_s": medians[name],
                    "over_zero_redundancy": medians[name] / medians["ZeroRedundancyOptimizer"],
                    "over_ddp": medians[name] / medians["DDP, unsharded"],
                    "state_bytes_per_rank": states,
                    "max_state_over_unsharded": max(states) / unsharded,
                }
            )
    return {
        "num_params": num_params,
        "batch_per_rank": batch,
        "repeats": repeats,
        "model": f"MLP {width}-{width}-{width}-{width}-{out}",
        "rows": rows,
    }


def run(args: argparse.Namespace) -> dict:
    return bench_zero(
        args.world_sizes, args.repeats, args.warmup, args.batch, args.width, args.out_features
    )


def report(result: dict) -> None:
    print(
        f"Adam on {result['model']} ({result['num_params']:,} parameters), batch "
        f"{result['batch_per_rank']} per rank; median step of {result['repeats']} interleaved "
        "(slowest rank); ratios: lower is faster; state: the largest rank's optimizer-state "
        "bytes as a fraction of the unsharded state (1/N is ideal)"
    )
    print(
        f"{'N':>2} {'variant':<24} {'median':>9} {'/ZeRO-torch':>11} {'/DDP':>9} "
        f"{'state/rank':>11} {'x N':>6}"
    )
    for r in result["rows"]:
        n = r["world_size"]
        print(
            f"{n:>2} {r['variant']:<24} {r['median_s'] * 1e3:>7.1f}ms "
            f"{r['over_zero_redundancy']:>11.3f} {r['over_ddp']:>9.3f} "
            f"{r['max_state_over_unsharded']:>11.4f} {r['max_state_over_unsharded'] * n:>6.3f}"
        )
