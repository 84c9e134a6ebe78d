"""``python -m dpcourse.harness.bench ddp``: training-step time of the from-scratch DDP against
torch's.

Every variant of chapter 7 (step 2: one all-reduce per gradient after backward; step 3: one
asynchronous all-reduce per gradient from hooks; step 4: :class:`dpcourse.ddp.ddp.DDP` with buckets,
with and without overlap) trains its own copy of the same model on the same batch, next to
``torch.nn.parallel.DistributedDataParallel`` (default settings). Repetitions are interleaved
(variant after variant, rotating which goes first, so that drifts in machine load hit all
alike); each step starts after
a barrier and counts as long as its slowest rank; the table shows medians and their ratio to
torch's DDP. Models: an MLP of 4 layers of width 1024 (batch 64 per rank) and the course's
:class:`~dpcourse.one_device.models.TinyTransformer` (DigitsToWords, batch 64 per rank).
Chapter 7 uses :func:`time_variants_on_rank` for its bucket-size plot and
and :func:`dpcourse.ddp.timeline.timed_backward` for its timeline of one step.

Chapter 7: timing the from-scratch DDP against torch's.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.ddp import ddp
from dpcourse.ddp.workloads import model_and_batch
from dpcourse.harness.bench import interleaved_step_times
from dpcourse.harness.launch import run_ranks

HELP = "step time of the from-scratch DDP variants as ratios to torch DDP"

DEFAULT_VARIANTS = (
    "torch DDP",
    "step 2",
    "step 3",
    "DDP cap 0",
    "DDP no overlap",
    "DDP",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank")
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"])


def _variant_options(label: str) -> tuple[str, dict]:
    """A variant label of this benchmark as ``(variant, options)`` for
    :func:`dpcourse.ddp.ddp.wrap`:
    ``"DDP cap X"`` is ``DDP`` with ``bucket_cap_mb=X``, ``"DDP no overlap"`` (optionally
    ``"... cap X"``) with ``overlap=False``; other labels are variants of their own."""
    if not label.startswith("DDP"):
        return label, {}
    rest = label[3:].strip()
    overlap = not rest.startswith("no overlap")
    rest = rest.removeprefix("no overlap").strip()
    cap = float(rest.removeprefix("cap").strip()) if rest else 25.0
    return "DDP", {"bucket_cap_mb": cap, "overlap": overlap}


def time_variants_on_rank(
    model_name: str, variants: Sequence[str], repeats: int = 30, warmup: int = 3, batch: int = 64
) -> dict[str, list[float]]:
    """Runs on every rank: training-step times (seconds, slowest rank) of each variant, on
    its own copy of the same model, interleaved. Returns ``{variant: [time per repetition]}``."""


    rank = dist.get_rank()
    device = runtime.device()
    model, inputs, loss_fn = model_and_batch(model_name, batch, rank)
    *xs, target = inputs
    runs = []
    for name in variants:
        replica = copy.deepcopy(model)
        variant, options = _variant_options(name)
        wrapped, synchronise = ddp.wrap(variant, replica, **options)
        optimizer = torch.optim.SGD(replica.parameters(), lr=1e-3)
        runs.append((name, wrapped, synchronise, optimizer))

    def step(wrapped, synchronise, optimizer) -> None:
        optimizer.zero_grad()
        loss_fn(wrapped(*xs), target).backward()
        synchronise()
        optimizer.step()

    steps = [functools.partial(step, *run[1:]) for run in runs]
    per_step = interleaved_step_times(steps, repeats, warmup, device, rotate=True)
    return {name: t for (name, *_), t in zip(runs, per_step, strict=True)}


def paired_median(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of (variant ``a``'s step - variant ``b``'s), from
    :func:`time_variants_on_rank`'s interleaved times: the two steps of a round run one after
    the other, so a busy machine slows both alike, where medians of each would drift apart."""

    return statistics.median(x - y for x, y in zip(times[a], times[b], strict=True))


def bench_ddp(
    world_size: int, repeats: int, warmup: int, batch: int, model_names: Sequence[str]
) -> dict:
    rows = []
    for model_name in model_names:
        times = run_ranks(
            time_variants_on_rank,
            world_size,
            model_name,
            DEFAULT_VARIANTS,
            repeats,
            warmup,
            batch,
            timeout=1800,
        )[0]
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name in DEFAULT_VARIANTS:
            rows.append(
                {
                    "model": model_name,
                    "variant": name,
                    "median_s": medians[name],
                    "over_torch_ddp": medians[name] / medians["torch DDP"],
                }
            )
    return {"world_size": world_size, "repeats": repeats, "batch_per_rank": batch, "rows": rows}


def run(args: argparse.Namespace) -> dict:
    return bench_ddp(args.world_size, args.repeats, args.warmup, args.batch, args.models)


_DESCRIPTIONS = {
    "torch DDP": "torch.nn.parallel.DistributedDataParallel",
    "step 2": "all_reduce_gradients after backward",
    "step 3": "PerParameterDDP: async all-reduce per gradient",
    "DDP cap 0": "DDP, one bucket per parameter, overlapped",
    "DDP no overlap": "DDP, 25 MiB buckets, sent after backward",
    "DDP": "DDP, 25 MiB buckets, overlapped",
}


def report(result: dict) -> None:
    print(
        f"training step on {result['world_size']} ranks, batch {result['batch_per_rank']} per "
        f"rank; median of {result['repeats']} interleaved steps (slowest rank), ratio to torch "
        "DDP (lower is faster)"
    )
    print(f"{'model':<12} {'variant':<15} {'median':>9} {'/torch':>7}  what")
    for r in result["rows"]:
        print(
            f"{r['model']:<12} {r['variant']:<15} {r['median_s'] * 1e3:>7.2f}ms "
            f"{r['over_torch_ddp']:>7.3f}  {_DESCRIPTIONS.get(r['variant'], '')}"
        )
