"""``python -m dpcourse.harness.bench slow_links``: chapter 12's methods trained to a target loss
over emulated slow links, beside the step-time model.

``nodes`` emulated machines (:mod:`dpcourse.harness.cluster`), one rank each, joined by links of
each rate of ``rates``. On each, every method of :data:`METHODS` trains the same model (chapter
1's MLP, 32 -> 256 -> 256 -> 8, 76,296 parameters) on the same data (chapter 1's regression task,
4,096 samples; each rank draws its own batches of 32, the same for every method) until the loss
on held-out samples reaches ``target`` or ``max_steps`` pass: our DDP (chapter 7) alone, with
fp16 compression and with PowerSGD of rank 1 and 4 (all with AdamW), local SGD and DiLoCo every
8 and 32 steps (AdamW inside; DiLoCo's outer SGD with Nesterov momentum, learning rate 0.7), and
Streaming DiLoCo (3 fragments, one per layer, 24 steps a round, sent 2 steps ahead, fp8). The
loss is that of the weights every rank shares (the last averaged ones for local SGD and DiLoCo),
every ``eval_every`` steps, evaluation excluded from the time.

Measured per method: the steps and training seconds to the target (rank 0's clock), the mean
step, the bytes sent per step as the collectives' arithmetic counts them (a ring all-reduce of
``b`` bytes sends ``2(N-1)/N b``; an all-to-all or all-gather ``(N-1)/N`` of the whole) and as
the node's network card counted them (``/proc/net/dev`` in its namespace: TCP/IP headers and
gloo's own messages included). Beside each, the model: :func:`dpcourse.communicating_less.
step_model.step_time` with the compute measured alone (no communication) and the link's latency
and bandwidth fitted from ping-pong messages; its time to target is the measured steps times the
modelled step. The machine is shared: steps and bytes do not depend on its load, times do
(medians of ``repeats`` passes of the timing where asked). Needs root (or CAP_NET_ADMIN); without
a cluster, :func:`train_on_rank` runs on plain ranks (the chapter's live cell).

Chapter 12: compression, local SGD and DiLoCo measured over slow links.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from dpcourse.communicating_less import (
    compression,
    diloco,
    local_sgd,
    powersgd,
    quantization,
    step_model,
    streaming_diloco,
)
from dpcourse.cost import hardware
from dpcourse.ddp.buckets import MB, BucketManager, HookBucket
from dpcourse.ddp.ddp import DDP
from dpcourse.harness.bench.cluster import fit_link_on_cluster
from dpcourse.harness.cluster import EmulatedCluster
from dpcourse.harness.launch import run_ranks
from dpcourse.harness.patching import replaced
from dpcourse.one_device import data, models

__all__ = ["METHODS", "make_model", "task", "batch_for", "train_on_rank", "compute_on_rank",
           "count_sent", "hook_overhead_on_rank", "model_step", "modelled", "live_run",
           "measure_rate", "measure"]

HELP = "compression, local SGD and DiLoCo to a target loss over emulated slow links, vs a model"

# name -> (kind, options)
METHODS: dict[str, tuple[str, dict]] = {
    "DDP": ("ddp", {}),
    "fp16": ("fp16", {}),
    "PowerSGD r=1": ("powersgd", {"rank": 1}),
    "PowerSGD r=4": ("powersgd", {"rank": 4}),
    "local SGD H=8": ("local_sgd", {"every": 8}),
    "local SGD H=32": ("local_sgd", {"every": 32}),
    "DiLoCo H=8": ("diloco", {"every": 8}),
    "DiLoCo H=32": ("diloco", {"every": 32}),
    "Streaming H=24": ("streaming", {"every": 24, "delay": 2, "alpha": 0.5, "quantize": True}),
}
LR, OUTER_LR, BATCH, START_POWERSGD = 1e-3, 0.7, 32, 10


def make_model() -> nn.Module:
    """Chapter 1's MLP, widened: 32 features, 256 hidden, 8 outputs, seeded."""
    torch.manual_seed(0)
    return models.MLP(32, 256, 8)


def task() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, held-out x, held-out y): chapter 1's regression, 4,096 samples."""
    x, y = data.random_regression(4096, 32, 8, seed=0).tensors
    return x[:3072], y[:3072], x[3072:], y[3072:]


def batch_for(step: int, rank: int, x: torch.Tensor, y: torch.Tensor):
    """Rank ``rank``'s batch at ``step``: the same for every method and link."""
    g = torch.Generator().manual_seed(100_003 * step + rank)
    idx = torch.randint(0, len(x), (BATCH,), generator=g)
    return x[idx], y[idx]


@contextlib.contextmanager
def count_sent() -> Iterator[list[float]]:
    """Bytes this rank sends in torch.distributed's all-reduces, all-to-alls and all-gathers
    called in the block, as their ring arithmetic counts them (a one-element list)."""
    sent = [0.0]
    inside = threading.local()  # torch may call the function again from inside it (a function
    # mode, as the device audit's guards do): count the outer call only

    def counted(share):
        def wrap(real):
            def collective(*args, **kwargs):
                if getattr(inside, "active", False):
                    return real(*args, **kwargs)
                inside.active = True
                try:
                    sent[0] += share(args, dist.get_world_size(kwargs.get("group")))
                    return real(*args, **kwargs)
                finally:
                    inside.active = False
            return collective
        return wrap

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    with replaced({
        "all_reduce": counted(lambda a, n: 2 * (n - 1) / n * nbytes(a[0])),
        "all_to_all_single": counted(lambda a, n: (n - 1) / n * nbytes(a[1])),
        "all_gather": counted(lambda a, n: (n - 1) * nbytes(a[1])),
    }):
        yield sent


def _wire_bytes() -> int | None:
    """Bytes this network namespace's eth0 has sent (None outside the emulated cluster)."""
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("eth0:"):
                return int(line.split(":", 1)[1].split()[8])
    return None


def _prepare(kind: str, options: dict, model: nn.Module):
    """(what forward goes through, what a step calls after backward, the shared weights by
    name, what to call at the end) for one method."""
    names = [n for n, _ in model.named_parameters()]
    if kind in ("ddp", "fp16", "powersgd"):
        ddp = DDP(model)
        if kind == "fp16":
            ddp.register_comm_hook(None, compression.fp16_compress_hook)
        if kind == "powersgd":
            state = powersgd.PowerSGDState(matrix_approximation_rank=options["rank"],
                                           start_powerSGD_iter=START_POWERSGD)
            ddp.register_comm_hook(state, powersgd.powersgd_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        return ddp, opt, opt.step, lambda: dict(model.named_parameters()), lambda: None
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    if kind == "local_sgd":
        every = options["every"]
        averaged = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = local_sgd.LocalSGD(inner, every, warmup_steps=every - 1)

        def step() -> None:
            opt.step()
            if opt.step_count % every == 0:  # averaged at this step: the shared weights
                for n, p in model.named_parameters():
                    averaged[n].copy_(p.detach())

        return model, opt, step, lambda: averaged, lambda: None
    if kind == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=0.9, nesterov=True)
        ours = diloco.DiLoCo(model, inner, outer, options["every"])
        return model, inner, ours.step, lambda: dict(zip(names, ours.start, strict=True)), \
            lambda: None
    if kind == "streaming":
        fragments = [model.fc1, model.fc2, model.fc3]
        outers = [torch.optim.SGD(f.parameters(), lr=OUTER_LR, momentum=0.9, nesterov=True)
                  for f in fragments]
        ours = streaming_diloco.StreamingDiLoCo(
            fragments, inner, outers, options["every"], options["delay"], options["alpha"],
            options["quantize"])

        def shared() -> dict[str, torch.Tensor]:
            starts = [s for f in ours.fragments for s in f.start]
            params = [p for f in ours.fragments for p in f.params]
            by_param = {id(p): s for p, s in zip(params, starts, strict=True)}
            return {n: by_param[id(p)] for n, p in model.named_parameters()}

        return model, inner, ours.step, shared, ours.close
    raise ValueError(f"unknown method kind {kind!r}")


def train_on_rank(kind: str, options: dict, target: float, max_steps: int,
                  eval_every: int = 8) -> dict:
    """Runs on every rank: train one method until the shared weights' held-out loss reaches
    ``target`` (every rank decides alike: they evaluate the same weights) or ``max_steps``.
    Returns the loss curve ``[(step, loss, training seconds)]``, the step reached, the bytes sent
    (counted and, in the cluster, on the wire) and the per-step seconds."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x, y, test_x, test_y = task()
    model = make_model()
    forward, opt, step, shared, close = _prepare(kind, options, model)
    evaluator = copy.deepcopy(model)
    loss_fn = nn.functional.mse_loss

    def held_out() -> float:
        with torch.no_grad():
            return loss_fn(functional_call(evaluator, shared(), (test_x,)), test_y).item()

    curve, seconds, reached, step_seconds = [(0, held_out(), 0.0)], 0.0, None, []
    dist.barrier()
    wire = _wire_bytes()
    with count_sent() as sent:
        for t in range(1, max_steps + 1):
            bx, by = batch_for(t, rank, x, y)
            start = time.perf_counter()
            opt.zero_grad()
            loss_fn(forward(bx), by).backward()
            step()
            step_seconds.append(time.perf_counter() - start)
            seconds += step_seconds[-1]
            if t % eval_every == 0:
                curve.append((t, held_out(), seconds))
                if curve[-1][1] <= target:
                    reached = t
                    break
    close()
    steps = reached or max_steps
    # A rank's last collective can end before its own last message has left its card (it
    # waits for what it receives, not for what it sent, which a shaped link may still hold for
    # a tenth of a second): after a barrier every rank has received all the others sent.
    dist.barrier()
    wire_after = _wire_bytes()
    return {"curve": curve, "steps_to_target": reached, "steps": steps,
            "seconds_to_target": seconds if reached else None, "seconds": seconds,
            "mean_step": seconds / steps, "median_step": statistics.median(step_seconds),
            "sent_per_step": sent[0] / steps,
            "wire_per_step": None if wire is None else (wire_after - wire) / steps}


def compute_on_rank(steps: int = 60) -> float:
    """Runs on every rank: the median seconds of a training step of the model with no
    communication (the compute the model adds the communication to)."""
    torch.set_num_threads(1)
    x, y, _, _ = task()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    times = []
    for t in range(steps):
        bx, by = batch_for(t, dist.get_rank(), x, y)
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(bx), by).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[steps // 4:])


def hook_overhead_on_rank(steps: int = 40) -> dict[str, float]:
    """Runs on every rank: the seconds each hook of :data:`METHODS` adds to a step by its own
    arithmetic (casts; PowerSGD's products and orthogonalisations), measured with the hook
    all-reducing over a group of this rank alone, where the all-reduces cost nothing: the
    median step with the hook minus the median step without."""
    torch.set_num_threads(1)
    alone, _ = dist.new_subgroups(group_size=1)  # a collective: every rank, once
    x, y, _, _ = task()
    hooks = {"none": (None, None), "fp16": (alone, compression.fp16_compress_hook),
             "quantize": (alone, None)}
    for name, (kind, options) in METHODS.items():
        if kind == "powersgd":
            hooks[name] = (powersgd.PowerSGDState(alone, options["rank"], start_powerSGD_iter=2),
                           powersgd.powersgd_hook)
    times: dict[str, list[float]] = {name: [] for name in hooks}
    fragment = torch.randn(sum(p.numel() for p in make_model().parameters()) // 3)
    models_ = {name: make_model() for name in hooks}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=LR) for name, m in models_.items()}
    reducers = {name: BucketManager(list(m.parameters()), 25 * MB, 1)
                for name, m in models_.items()}
    for t in range(steps):
        bx, by = batch_for(t, dist.get_rank(), x, y)
        for name, (state, hook) in hooks.items():  # interleaved: the same load for each
            model, opt, bucket = models_[name], opts[name], reducers[name].buckets[0]
            if name == "quantize":  # Streaming DiLoCo's per sync: a third of the model in fp8
                start = time.perf_counter()
                quantization.quantized_all_reduce(fragment.clone(), state)
                times[name].append(time.perf_counter() - start)
                continue
            start = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            nn.functional.mse_loss(model(bx), by).backward()
            if hook is not None:
                for k in range(len(bucket.params)):
                    bucket.take_gradient(k)
                hook(state, HookBucket(bucket, 1)).wait()
            opt.step()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["none"][steps // 4:])
    return {name: statistics.median(t[steps // 4:]) if name == "quantize" else
            max(0.0, statistics.median(t[steps // 4:]) - base)
            for name, t in times.items() if name != "none"}


def model_step(kind: str, options: dict, world: int, compute_s: float, alpha: float,
               beta: float, overhead_s: float = 0.0) -> float:
    """The modelled mean step of one method (:func:`dpcourse.communicating_less.step_model.
    step_time`): DDP's one bucket after backward (nothing hidden), PowerSGD's three all-reduces,
    DiLoCo's one per parameter tensor and the count, Streaming DiLoCo's quantised fragment (an
    all-to-all and an all-gather, each of codes and scales: two all-reduces' latencies) every
    H/F steps, hidden behind ``delay`` steps of compute. ``overhead_s``: a hook's arithmetic per
    step; for Streaming DiLoCo its quantisation per synchronisation, spread over H/F steps."""
    shapes = [tuple(p.shape) for p in make_model().parameters()]
    if kind in ("ddp", "fp16", "powersgd"):
        payload = step_model.payload_bytes(kind, shapes, world, rank=options.get("rank", 1))
        return step_model.step_time(world, compute_s, payload, alpha, beta,
                                    all_reduces=3 if kind == "powersgd" else 1,
                                    overhead_s=overhead_s)
    if kind == "local_sgd":
        return step_model.step_time(world, compute_s, step_model.payload_bytes(kind, shapes),
                                    alpha, beta, every=options["every"])
    if kind == "diloco":
        return step_model.step_time(world, compute_s, step_model.payload_bytes(kind, shapes),
                                    alpha, beta, every=options["every"],
                                    all_reduces=len(shapes) + 1)
    fragments = 3
    payload = step_model.payload_bytes("streaming", shapes, world, fragments=fragments)
    return step_model.step_time(world, compute_s, payload, alpha, beta,
                                every=options["every"] / fragments, all_reduces=2,
                                hidden_s=options["delay"] * compute_s,
                                overhead_s=overhead_s / (options["every"] / fragments))


def modelled(run: dict, name: str) -> tuple[float, float | None]:
    """(the modelled mean step, the modelled seconds to the target) of method ``name`` in one
    link's recorded ``run`` (:func:`measure_rate`), from what was measured there: the compute,
    the hook's arithmetic, the link's latency and bandwidth, and the steps the method took. For
    PowerSGD the first ``START_POWERSGD`` steps are DDP's, uncompressed, as they ran."""
    kind, options = METHODS[name]
    m = run["results"][name]
    step = model_step(kind, options, run["nodes"], run["compute"], run["alpha"], run["beta"],
                      m["overhead"])
    if kind == "powersgd":
        ddp = model_step("ddp", {}, run["nodes"], run["compute"], run["alpha"], run["beta"])
        warm = min(START_POWERSGD, m["steps"])
        step = (warm * ddp + (m["steps"] - warm) * step) / m["steps"]
    return step, step_model.time_to_target(m["steps_to_target"], step)


def measure_rate(rate: str, nodes: int = 2, target: float = 0.12, max_steps: int = 1200,
                 methods: list[str] | None = None, eval_every: int = 8,
                 link_repeats: int = 3, repeats: int = 1) -> dict:
    """One link rate: fit the link, time the compute alone, train every method to the target."""
    with EmulatedCluster(nodes, link=rate) as cluster:
        fitted_alpha, beta, sizes, one_way = fit_link_on_cluster(cluster, [2**16, 2**18],
                                                                 repeats=link_repeats)
        # the latency a message pays here: a 4 KiB message's one-way time (the fit's own alpha
        # is about 0 on a shaped link, whose bucket lets a small message through at once), as
        # chapter 11's bench takes it
        alpha = one_way[sizes.index(2**12)]
        compute_s = run_ranks(compute_on_rank, nodes, cluster=cluster, timeout=600)[0]
        overhead = run_ranks(hook_overhead_on_rank, nodes, cluster=cluster, timeout=600)[0]
        results = {}
        for name in methods or list(METHODS):
            kind, options = METHODS[name]
            runs = [run_ranks(train_on_rank, nodes, kind, options, target, max_steps,
                              eval_every, cluster=cluster, timeout=3600) for _ in range(repeats)]
            if len({p[0]["steps_to_target"] for p in runs}) != 1:
                raise RuntimeError(f"{name}: repeats reached the target at different steps")
            per_rank = runs[0]
            r = per_rank[0]
            seconds = [p[0]["seconds"] for p in runs]
            r["seconds_repeats"] = seconds
            r["seconds"] = statistics.median(seconds)
            r["mean_step"] = r["seconds"] / r["steps"]
            if r["steps_to_target"] is not None:
                r["seconds_to_target"] = r["seconds"]
            r["wire_per_step_nodes"] = [p["wire_per_step"] for p in per_rank]
            r["overhead"] = overhead.get(name, overhead["quantize"] if kind == "streaming"
                                         else 0.0)
            results[name] = r
    run = {"rate": rate, "rate_bits": hardware.rate_bits(rate), "nodes": nodes,
           "alpha": alpha, "fitted_alpha": fitted_alpha, "beta": beta, "compute": compute_s,
           "overhead": overhead, "repeats": repeats, "target": target,
           "max_steps": max_steps, "eval_every": eval_every, "results": results}
    for name, r in results.items():
        r["model_step"], r["model_seconds_to_target"] = modelled(run, name)
    return run


def live_run(rate: str = "10mbit", nodes: int = 2, steps: int = 16,
             methods: tuple[str, ...] = ("DDP", "fp16", "DiLoCo H=8")) -> dict:
    """A few steps of ``methods`` on an emulated cluster (the chapter's live cell): bytes per
    step counted and on the wire, the mean step, and the model's step with the compute measured
    here and the link's configured rate (latency left out: no time for a fit)."""
    beta = hardware.rate_bits(rate) / 8
    with EmulatedCluster(nodes, link=rate) as cluster:
        compute_s = run_ranks(compute_on_rank, nodes, 24, cluster=cluster, timeout=300)[0]
        results = {}
        for name in methods:
            kind, options = METHODS[name]
            r = run_ranks(train_on_rank, nodes, kind, options, -1.0, steps, steps,
                          cluster=cluster, timeout=600)[0]
            r["model_step"] = model_step(kind, options, nodes, compute_s, 0.0, beta)
            results[name] = r
    return {"rate": rate, "nodes": nodes, "steps": steps, "compute": compute_s,
            "results": results}


def measure(rates=("10mbit", "100mbit", "1gbit"), nodes=(2, 4), **kwargs) -> dict:
    """:func:`measure_rate` for every node count and rate (an emulated cluster each)."""
    params = sum(p.numel() for p in make_model().parameters())
    return {"params": params, "batch_per_rank": BATCH, "lr": LR, "outer_lr": OUTER_LR,
            "start_powerSGD_iter": START_POWERSGD, "methods": {n: list(m) for n, m in
                                                              METHODS.items()},
            "runs": [measure_rate(rate, n, **kwargs) for n in nodes for rate in rates]}


# ----------------------------------------------------------------------------- the CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", nargs="+", default=["10mbit", "100mbit", "1gbit"],
                        help="links between nodes, as tc writes them")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--target", type=float, default=0.12, help="held-out MSE to reach")
    parser.add_argument("--max-steps", type=int, default=1200)
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS))
    parser.add_argument("--repeats", type=int, default=1,
                        help="train each method this many times per link (the median time)")


def run(args: argparse.Namespace) -> dict:
    return measure(args.rates, args.nodes, target=args.target, max_steps=args.max_steps,
                   methods=args.methods, repeats=args.repeats)


def report(result: dict) -> None:
    print(f"chapter 1's MLP ({result['params']:,} parameters), batch {result['batch_per_rank']} "
          "per rank, to the target held-out loss; measured (model)")
    for r in result["runs"]:
        print(f"\n{r['nodes']} nodes, {r['rate']} (fitted {r['beta'] * 8 / 1e6:.1f} Mbit/s, "
              f"latency {r['alpha'] * 1e3:.2f} ms), compute {r['compute'] * 1e3:.2f} ms a step")
        print(f"{'method':>16} {'steps':>6} {'KB/step sent':>13} {'wire':>8} "
              f"{'mean step ms':>18} {'s to target':>16}")
        for name, m in r["results"].items():
            wire = "-" if m["wire_per_step"] is None else f"{m['wire_per_step'] / 1e3:8.1f}"
            to = ("never" if m["seconds_to_target"] is None else
                  f"{m['seconds_to_target']:6.1f} ({m['model_seconds_to_target']:6.1f})")
            print(f"{name:>16} {m['steps_to_target'] or '-':>6} "
                  f"{m['sent_per_step'] / 1e3:13.1f} {wire:>8} "
                  f"{m['mean_step'] * 1e3:8.2f} ({m['model_step'] * 1e3:7.2f}) {to:>16}")
